"""``python -m tests.readme_commands hal ARGS...``: check one ``hal`` command line of the README without running it.

The README test (``tests/test_readme.py``) runs the README's ``check`` blocks in bash with ``hal`` (and
``.venv/bin/hal``) pointing here: each command is parsed by the real parser (tyro, the same subcommand table as
the console script) and put through the checks that command makes before it starts any work (``hal sync``:
``validate``; ``hal bench``: ``selection``; ``hal launch``: the script exists). Exit status 0 when the line is
valid, else 2 with the command's own one-line error, as ``hal`` prints it.
"""

from __future__ import annotations

import pathlib
import sys

import tyro


def check(argv: list[str]) -> None:
    """Parse and check one command line (without the leading ``hal``); raises what the command would raise."""
    from hal.apps.cli import bench, info, launch, sync
    from hal.apps.cli.main import SUBCOMMANDS
    from hal.apps.errors import MissingFileError

    script: tuple[str, ...] = ()
    if "--" in argv:
        cut = argv.index("--")
        argv, script = argv[:cut], tuple(argv[cut + 1:])
    args = tyro.extras.subcommand_cli_from_dict(SUBCOMMANDS, args=argv, prog="hal")
    if isinstance(args, sync.Sync):
        sync.validate(args)
    elif isinstance(args, bench.Bench):
        bench.selection(args)
    elif isinstance(args, launch.Launch):
        if script and not pathlib.Path(script[0]).is_file():
            raise MissingFileError(f"hal launch: no script {script[0]}")
    elif isinstance(args, info.Info):
        info.collect(args.device)


def main() -> int:
    from hal.errors import HalError

    argv = sys.argv[1:]
    try:
        check(argv)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2
    print("checked: hal " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
