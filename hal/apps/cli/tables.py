"""How the CLI prints a results table whole: rich squeezes a table into the terminal's width, or into 80
columns where stdout is no terminal (piped, logged), wrapping its cells onto more lines, or cutting those of a
``no_wrap`` column short ("y…")."""

from __future__ import annotations

from typing import Any


def console_for(table: Any, least: int = 0) -> Any:
    """A ``rich.console.Console`` to print ``table`` (a ``rich.table.Table``) with no cell wrapped or cut.

    Piped or logged, it is as wide as the table's widest row needs (at least ``least`` columns). In a terminal
    it is the terminal's own where the table fits, or where every column may wrap (rich then wraps a cell inside
    its box, which reads better than lines the terminal folds); else, a column that must not wrap would be cut
    short, so it is as wide as the table needs and the terminal folds the long lines.
    """
    from rich.console import Console

    console = Console()
    needed = max(least, Console(width=1 << 12).measure(table).maximum)
    if console.is_terminal and (console.width >= needed or not any(column.no_wrap for column in table.columns)):
        return console
    return Console(width=needed)


__all__ = ["console_for"]
