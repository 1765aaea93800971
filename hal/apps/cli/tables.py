"""How the CLI prints a results table whole: rich squeezes a table into the terminal's width, or into 80
columns where stdout is no terminal (piped, logged), wrapping its cells onto more lines and, where even that
does not fit, cutting them short ("12…", "y…")."""

from __future__ import annotations

from typing import Any


def console_for(table: Any, least: int = 0) -> Any:
    """A ``rich.console.Console`` to print ``table`` (a ``rich.table.Table``) with no cell wrapped or cut: the
    terminal's where the table fits in it, else one as wide as the table's widest row needs (at least ``least``
    columns). In a narrower terminal the terminal then folds the long lines; every value stays whole (a fresh
    user's 80-column terminal showed ``hal sync``'s losses as ``12…``)."""
    from rich.console import Console

    console = Console()
    needed = max(least, Console(width=1 << 12).measure(table).maximum)
    if console.is_terminal and console.width >= needed:
        return console
    return Console(width=needed)


__all__ = ["console_for"]
