"""The subcommands' help from their docstrings, one line per paragraph, for tyro to wrap to the terminal.

tyro reads a field's help from the docstring under it, but joins its lines before removing their
indentation, so a docstring continued on an indented line (every multi-line field docstring in a class body)
is shown broken where the source line ended, and a class docstring line starting with a non-letter (``(``, a
digit) starts a new line of the description. :func:`flowing_help` hands tyro the same docstrings already
joined: each field's as ``tyro.conf.arg(help=...)`` (through ``typing.Annotated``), the class's as its
``__doc__``. The source keeps readable, wrapped docstrings.
"""

from __future__ import annotations

import inspect
import re
import typing

import docstring_parser
import tyro

__all__ = ["DEVICE_DEFAULT", "flow", "flowing_help", "optional"]


DEVICE_DEFAULT = "$HAL_DEVICE, else auto: the first available of npu, cuda, plugin kinds, cpu; npu-sim only when named"
"""How a command resolves a ``--device`` left out, in words (hal.device's order: explicit > ``HAL_DEVICE`` >
the first available kind that is probed automatically; the simulated npu never is)."""


def flow(text: str) -> str:
    """``text`` with each paragraph (blocks split by a blank line) on one line, its whitespace single spaces."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def flowing_help(cls: type) -> type:
    """Class decorator for a tyro subcommand dataclass: every field's docstring becomes its help, flowed.

    Apply it above ``@dataclasses.dataclass``. A field's annotation ``T`` becomes
    ``Annotated[T, tyro.conf.arg(help=flow(docstring))]`` (markers already on ``T`` stay); a field without a
    docstring is left as it is. The class's ``__doc__`` (tyro's description of the subcommand) is flowed too.
    Returns ``cls`` itself.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    for param in docstring_parser.parse_from_object(cls).params:
        if param.arg_name in hints and param.description:
            cls.__annotations__[param.arg_name] = typing.Annotated[
                hints[param.arg_name], tyro.conf.arg(help=flow(param.description))]
    if cls.__doc__:
        cls.__doc__ = flow(cls.__doc__)
    return cls


def optional(metavar: str, default: str) -> object:
    """A tyro marker for a flag whose value may be left out (``T | None = None``): its value is shown as
    ``metavar`` (``--device KIND``) and its default in words (``default: $HAL_DEVICE, else auto``), not as
    tyro's ``{None}|STR`` and ``(default: None)``. Use as ``Annotated[str | None, optional("KIND", "...")]``."""
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=f"(default: {default})")

