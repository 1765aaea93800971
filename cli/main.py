"""Entry point of the ``hal`` console script.

Each subcommand is a dataclass parsed by tyro and a ``run(args) -> exit status`` function. Errors the user
can fix (an unknown device, a missing file, a bad size) print one line and exit 2, without a traceback.
"""

from __future__ import annotations

import sys
import tyro

from cli.info import Info
from cli.info import run as run_info
from hal.errors import HalError

SUBCOMMANDS = {"info": Info}
RUNNERS = {Info: run_info}


def main(argv: list[str] | None = None) -> int:
    args = tyro.extras.subcommand_cli_from_dict(SUBCOMMANDS, args=argv, prog="hal")
    try:
        return RUNNERS[type(args)](args)
    except (HalError, ValueError, FileNotFoundError) as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
