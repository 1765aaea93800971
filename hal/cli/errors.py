"""Errors of the ``hal`` command line: a wrong argument, a missing file or extra; exit status 2, no traceback.

Each derives from :class:`hal.HalError` and from the built-in a caller would catch (``ValueError``,
``FileNotFoundError``, ``ImportError``). ``hal.cli.main`` prints errors of the ``HalError`` tree as one
line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from hal.errors import HalError


class UsageError(HalError, ValueError):
    """A command-line argument is wrong (a count below 1, an unknown name); the message names the flag."""


class MissingFileError(HalError, FileNotFoundError):
    """A file named on the command line (a script, a model) does not exist."""


class MissingExtraError(HalError, ImportError):
    """An option needs an optional dependency that is not installed; the message says what to install."""
