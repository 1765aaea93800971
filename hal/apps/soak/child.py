"""``python -m hal.apps.soak.child FD``: one soak worker process (see :mod:`hal.apps.soak.procs`).

Reads its spec from file descriptor ``FD``, builds its role, then serves the driver's calls
(:func:`hal.apps.weightsync.channel.serve`) until the stop or until the driver's end closes (so nothing
outlives a killed driver).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from multiprocessing.connection import Connection


PR_SET_PDEATHSIG = 1
# makes a worker write every thread's Python stack to its log (a hung run)
STACKS_SIGNAL = signal.SIGUSR2


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its driver ends (``PR_SET_PDEATHSIG``), where ``prctl`` exists."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def serve(conn: Connection) -> None:
    """Build the role the spec asks for, then serve calls until stopped or disconnected."""
    from hal.apps.shutdown import quiet_rank_exit

    die_with_parent()
    quiet_rank_exit()  # SIGINT / SIGTERM end it without a traceback
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a hung worker's stacks, into its log
    from hal.apps.soak.procs import build_host
    from hal.apps.weightsync import channel

    kind, spec = channel.receive(conn)
    if kind != "spec":
        raise ValueError(f"the first message must be the worker's spec, got {kind!r}")
    host = build_host(spec, lambda message: channel.send(conn, ("notice", message)))
    try:
        channel.serve(conn, host, f"worker {spec.index}")
    except channel.CallerGone:
        return  # the driver is gone


def main(argv: list[str]) -> int:
    """Entry point: ``argv[1]`` is the connection's file descriptor."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m hal.apps.soak.child FD (started by hal soak)", file=sys.stderr)
        return 2
    serve(Connection(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
