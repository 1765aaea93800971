"""How the CLI prints a results table whole (rich would squeeze it into the terminal, or 80 columns when piped,
cutting cells short)."""

from __future__ import annotations

from typing import Any


def console_for(table: Any, least: int = 0) -> Any:
    """A ``rich.console.Console`` printing ``table`` with no cell wrapped or cut: the terminal's where it fits, else
    one as wide as the widest row (at least ``least`` columns)."""
    from rich.console import Console

    console = Console()
    needed = max(least, Console(width=1 << 12).measure(table).maximum)
    if console.is_terminal and console.width >= needed:
        return console
    return Console(width=needed)


__all__ = ["console_for"]
