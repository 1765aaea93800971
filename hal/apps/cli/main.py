"""Entry point of the ``hal`` console script: each subcommand is a tyro dataclass and a ``run(args)``.

A :class:`hal.HalError` prints one line and exits 2; any other exception is a bug and keeps its traceback.
Ctrl-C exits 130 (SIGTERM 143) once what the command started has stopped (:mod:`hal.apps.shutdown`).
"""

from __future__ import annotations

import os
import signal
import sys

import tyro

from hal.apps.cli.bench import Bench
from hal.apps.cli.bench import run as run_bench
from hal.apps.cli.info import Info
from hal.apps.cli.info import run as run_info
from hal.apps.cli.launch import Launch
from hal.apps.cli.launch import run as run_launch
from hal.apps.cli.plan import Plan
from hal.apps.cli.plan import run as run_plan
from hal.apps.cli.soak import Soak
from hal.apps.cli.soak import run as run_soak
from hal.apps.cli.sync import Sync
from hal.apps.cli.sync import run as run_sync
from hal.apps.shutdown import interrupted_status
from hal.errors import HalError

SUBCOMMANDS = {"info": Info, "launch": Launch, "sync": Sync, "plan": Plan, "bench": Bench, "soak": Soak}
RUNNERS = {Info: run_info, Launch: run_launch, Sync: run_sync, Plan: run_plan, Bench: run_bench, Soak: run_soak}
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT)


def main(argv: list[str] | None = None) -> int:
    """``hal ARGV``: the exit status (0, 1 for a failed job, 2 for a usage error, 130 after Ctrl-C, 141 for a
    closed stdout)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # nothing more can be written; point stdout at /dev/null so the interpreter's last flush fails no more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the launched script and its own flags: keep it away from tyro.
    script: tuple[str, ...] = ()
    if "--" in argv:
        cut = argv.index("--")
        argv, script = argv[:cut], tuple(argv[cut + 1:])
    args = tyro.extras.subcommand_cli_from_dict(SUBCOMMANDS, args=argv, prog="hal")
    if script:
        if not isinstance(args, Launch):
            print("hal: error: only 'hal launch' takes a script after '--'", file=sys.stderr)
            return 2
        args.script = (*args.script, *script)  # a script named before '--' (then without arguments) comes first
    try:
        return RUNNERS[type(args)](args)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # Ctrl-C or SIGTERM: what the command started is stopped by now (its finally blocks)
        status = interrupted_status(exc)
        if status is None:
            raise
        print("hal: interrupted" if status == INTERRUPTED else f"hal: stopped by {signal.Signals(status - 128).name}",
              file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
