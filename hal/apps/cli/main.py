"""Entry point of the ``hal`` console script.

Each subcommand is a dataclass parsed by tyro and a ``run(args) -> exit status`` function. Errors the user
can fix (an unknown device, a missing file, a bad size: the :class:`hal.HalError` tree, which holds the
``engines`` and ``ckpt`` errors and :mod:`hal.apps.errors`) print one line and exit 2, without a traceback.
Any other exception is a bug: it propagates with its traceback (exit status 1). Ctrl-C (SIGINT) prints
``hal: interrupted`` and exits 130 once what the command started has stopped and its temporary directories
are gone; a SIGTERM torch.distributed.elastic's agent caught, ``hal: stopped by SIGTERM`` and 143
(:mod:`hal.apps.shutdown`).
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
from hal.apps.cli.soak import Soak
from hal.apps.cli.soak import run as run_soak
from hal.apps.cli.sync import Sync
from hal.apps.cli.sync import run as run_sync
from hal.apps.shutdown import interrupted_status
from hal.errors import HalError

SUBCOMMANDS = {"info": Info, "launch": Launch, "sync": Sync, "bench": Bench, "soak": Soak}
RUNNERS = {Info: run_info, Launch: run_launch, Sync: run_sync, Bench: run_bench, Soak: run_soak}
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""


def main(argv: list[str] | None = None) -> int:
    """``hal ARGV``: the exit status (0, 1 for a failed job, 2 for a usage error, 130 after Ctrl-C; 141 when the
    reader of stdout went away, as ``hal sync --help | head`` does, quietly, as a shell tool killed by SIGPIPE)."""
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
