"""The subcommands' help from their docstrings, one line per paragraph, for tyro to wrap to the terminal.

tyro joins a field docstring's lines before removing their indentation, so a wrapped one shows broken;
:func:`flowing_help` hands tyro the docstrings already joined.
"""

from __future__ import annotations

import inspect
import re
import typing

import docstring_parser
import tyro

__all__ = ["DEVICE_DEFAULT", "flow", "flowing_help", "optional"]


# how a command resolves a --device left out: explicit > HAL_DEVICE > the first available auto-probed kind
DEVICE_DEFAULT = "$HAL_DEVICE, else auto: the first available of npu, cuda, plugin kinds, cpu; npu-sim only when named"


def flow(text: str) -> str:
    """``text`` with each paragraph on one line, its whitespace single spaces."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def flowing_help(cls: type) -> type:
    """Class decorator for a tyro subcommand dataclass (above ``@dataclasses.dataclass``): every field's docstring
    becomes its help, flowed; so does the class's ``__doc__``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for param in docstring_parser.parse_from_object(cls).params:
        if param.arg_name in hints and param.description:
            cls.__annotations__[param.arg_name] = typing.Annotated[
                hints[param.arg_name], tyro.conf.arg(help=flow(param.description))]
    if cls.__doc__:
        cls.__doc__ = flow(cls.__doc__)
    return cls


def optional(metavar: str, default: str) -> object:
    """A tyro marker for a ``T | None = None`` flag: its value shown as ``metavar``, its default in words."""
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=f"(default: {default})")

