"""``python -m hal.apps.soak.child FD``: one soak worker process (see :mod:`hal.apps.soak.procs`).

Reads its spec from file descriptor ``FD``, builds its role, then answers the driver's calls in order until
``("stop",)`` or until the driver's end closes (so nothing outlives a killed driver).
"""

from __future__ import annotations

import asyncio
import faulthandler
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any


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


def answer(loop: asyncio.AbstractEventLoop, host: Any, seq: int, call: bytes) -> tuple:
    """The reply to call ``seq`` run on ``host``: its pickled result, or its failure as ``"ExceptionType:
    message"`` (the worker goes on serving)."""
    from hal.apps.weightsync.messages import load_message

    loaded, why = load_message(call)
    if why is not None:
        return "reply", seq, False, None, f"the call does not load in the worker: {why}"
    method, args, kwargs = loaded
    try:
        value = loop.run_until_complete(host.invoke(method, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver, which names this worker
        return "reply", seq, False, None, f"{type(exc).__name__}: {exc}"
    try:
        return "reply", seq, True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - a result that does not pickle: say so instead
        return "reply", seq, False, None, f"the result of {method.__qualname__} does not pickle: {exc}"


def serve(conn: Connection) -> None:
    """Build the role the spec asks for, then serve calls until stopped or disconnected."""
    from hal.apps.shutdown import quiet_rank_exit

    die_with_parent()
    quiet_rank_exit()  # SIGINT / SIGTERM end it without a traceback
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a hung worker's stacks, into its log
    from hal.apps.soak.procs import build_host, receive, send

    kind, spec = receive(conn)
    if kind != "spec":
        raise ValueError(f"the first message must be the worker's spec, got {kind!r}")
    host = build_host(spec, lambda message: send(conn, ("notice", message)))
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                message = receive(conn)
            except EOFError:
                return  # the driver is gone
            if message[0] == "stop":
                return
            _, seq, call = message
            try:
                send(conn, answer(loop, host, seq, call))
            except (BrokenPipeError, ConnectionResetError):
                return  # the driver is gone
    finally:
        loop.close()


def main(argv: list[str]) -> int:
    """Entry point: ``argv[1]`` is the connection's file descriptor."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m hal.apps.soak.child FD (started by hal soak)", file=sys.stderr)
        return 2
    serve(Connection(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
