"""How the CLI prints a results table whole: rich squeezes a table into the terminal's width, or into 80
columns where stdout is no terminal (piped, logged), wrapping or cutting its cells ("y…")."""

from __future__ import annotations

from typing import Any


def console_for(table: Any, least: int = 0) -> Any:
    """A ``rich.console.Console`` that prints ``table`` (a ``rich.table.Table``) without wrapping or cutting a
    cell: the terminal's where it is wide enough, else one as wide as the table's widest row needs (at least
    ``least`` columns; a terminal then wraps the long lines itself, which keeps every value whole)."""
    from rich.console import Console

    console = Console()
    needed = max(least, Console(width=1 << 12).measure(table).maximum)
    if not console.is_terminal or console.width < needed:
        console = Console(width=needed)
    return console


__all__ = ["console_for"]
