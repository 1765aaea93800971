"""The one call channel to a worker process (the torchrun launcher's ranks, the soak's workers): pickles over a socket.

The driver sends ``("call", seq, data)``, ``data`` the pickle of ``(method, args, kwargs)``, and ``("stop", seq)``;
the worker runs them in order and answers each with ``("reply", seq, ok, value, error)``, ``value`` the result's
pickle, and may send ``("notice", message)``. Contents are pickled apart from their message, so one that does not
load at the other end fails only its call. When the worker's end closes, every call in flight fails with
:class:`WorkerDied`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import pickle
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

import hal
from ckpt.manager import method_class


class RemoteError(hal.HalError, RuntimeError):
    """A call raised in the worker, or it or its result did not travel; the message says which and why."""


class WorkerDied(hal.HalError, RuntimeError):
    """The worker's end of the channel closed while a call was in flight (the message says how it ended)."""


class CallerGone(hal.HalError, ConnectionError):
    """The driver's end of the channel closed: the worker has nobody to answer."""


def send(conn: Connection, message: Any) -> None:
    """Send ``message`` pickled; OSError when the other end is gone."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection, timeout: float | None = None) -> Any:
    """Return the next message; EOFError when the other end closed, TimeoutError when none came in ``timeout`` s."""
    if timeout is not None and not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout:g} s")
    return pickle.loads(conn.recv_bytes())


def load_message(data: bytes) -> tuple[Any, str | None]:
    """Return ``(message, None)`` from a pickle, or ``(None, "ExceptionType: message")`` where it does not load."""
    try:
        return pickle.loads(data), None
    except Exception as exc:  # noqa: BLE001 - any load failure is that one message's, reported to its caller
        return None, f"{type(exc).__name__}: {exc}"


def _connection(sock: socket.socket) -> Connection:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a call is a small message: send it now
    sock.settimeout(None)
    return Connection(sock.detach())


def accept(server: socket.socket, timeout: float) -> Connection:
    """Return the first connection to the listening ``server``; DistributedTimeoutError after ``timeout`` s."""
    server.settimeout(timeout)
    try:
        sock, _ = server.accept()
    except TimeoutError:
        raise hal.DistributedTimeoutError(f"no caller connected to {server.getsockname()} within {timeout:g} s") \
            from None
    return _connection(sock)


def connect(host: str, port: int, timeout: float) -> Connection:
    """Return a connection to the worker listening at ``host:port``."""
    return _connection(socket.create_connection((host, port), timeout))


def answer(loop: asyncio.AbstractEventLoop, host: Any, seq: int, data: bytes, where: str) -> tuple:
    """Return the reply to call ``seq`` run on ``host`` (``where`` in errors); every failure is that call's."""
    call, why = load_message(data)
    if why is not None:
        return "reply", seq, False, None, f"the call does not load on {where}: {why}"
    method, args, kwargs = call
    try:
        value = loop.run_until_complete(host.invoke(method, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver, which names this worker
        return "reply", seq, False, None, f"{type(exc).__name__}: {exc}"
    try:
        return "reply", seq, True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - a result that does not pickle: say so instead
        return ("reply", seq, False, None,
                f"the result of {method.__qualname__} on {where} does not pickle: {type(exc).__name__}: {exc}")


def serve(conn: Connection, host: Any, where: str, timeout: float | None = None) -> None:
    """Run the driver's calls on ``host`` in order until the stop.

    Raises CallerGone when the driver's end closes, DistributedTimeoutError when no call comes in ``timeout`` s."""
    gone = CallerGone(f"{where}: the caller is gone (its end of the call channel closed)")
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                message = receive(conn, timeout)
            except TimeoutError:
                raise hal.DistributedTimeoutError(f"{where}: no call within {timeout:g} s") from None
            except (EOFError, OSError):
                raise gone from None
            reply = ("reply", message[1], True, pickle.dumps(None), None) if message[0] == "stop" else \
                answer(loop, host, message[1], message[2], where)
            try:
                send(conn, reply)
            except OSError:
                raise gone from None
            if message[0] == "stop":
                return
    finally:
        loop.close()


def settle(future: concurrent.futures.Future, ok: bool, value: bytes | None, error: str | None,
           here: str = "the driver") -> None:
    """Complete a call's ``future`` from its reply: the result ``value`` pickles, or :class:`RemoteError`."""
    if ok:
        value, why = load_message(value)
        outcome = RemoteError(f"the reply does not load on {here}: {why}") if why is not None else None
    else:
        outcome = RemoteError(error or "the call failed in the worker, which did not say why")
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled: nobody waits for it
        if outcome is None:
            future.set_result(value)
        else:
            future.set_exception(outcome)


class Caller:
    """The driver's end of one worker's channel; a reader thread files the replies and runs ``on_notice(message)``.

    ``ended(why)`` says, on that thread, how the worker ended once its end closed (``why``: ``None``, or a message
    that did not load); ``here`` names the driver in errors."""

    def __init__(self, conn: Connection, here: str = "the driver", on_notice: Callable[[Any], None] | None = None,
                 ended: Callable[[str | None], str] | None = None, name: str = "hal-calls") -> None:
        self.conn, self.here, self.on_notice = conn, here, on_notice
        self.ended = ended or (lambda why: why or "its end of the call channel closed")
        self.seq = 0
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.dead: str | None = None  # how the worker ended (None while its end is open)
        self.lock, self.sending = threading.Lock(), threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True, name=name)
        self.reader.start()

    def post(self, method: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Send ``method(*args, **kwargs)``; a call that is refused or does not pickle fails its future, unsent."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            method_class(method)
            data = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a string, a lambda, what does not pickle: this call fails
            future.set_exception(exc)
            return future
        return self._send("call", future, data)

    def stop(self) -> concurrent.futures.Future:
        """Ask the worker to return from :func:`serve`; the future is done once it said so."""
        return self._send("stop", concurrent.futures.Future())

    def _send(self, kind: str, future: concurrent.futures.Future, *data: bytes) -> concurrent.futures.Future:
        with self.lock:
            if self.dead is not None:
                future.set_exception(WorkerDied(f"the worker died ({self.dead})"))
                return future
            seq = self.seq
            self.seq += 1
            self.pending[seq] = future
        with self.sending, contextlib.suppress(OSError):  # the worker is gone: the reader fails the call
            send(self.conn, (kind, seq, *data))
        return future

    def _read(self) -> None:
        why = None
        while True:
            try:
                message = receive(self.conn)
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - a message that does not load: the worker is unusable
                why = f"sent a message that does not load ({exc})"
                break
            if message[0] == "notice":
                if self.on_notice is not None:
                    self.on_notice(message[1])
                continue
            with self.lock:
                future = self.pending.pop(message[1], None)
            if future is not None:
                settle(future, *message[2:], here=self.here)
        dead = self.ended(why)
        with self.lock, self.sending:
            self.dead, pending, self.pending = dead, self.pending, {}
            self.conn.close()
        for future in pending.values():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(WorkerDied(f"the worker died ({dead})"))

    def close(self) -> None:
        """Shut the channel down: the reader ends, calls in flight fail with :class:`WorkerDied`."""
        with self.lock, contextlib.suppress(OSError):
            if not self.conn.closed:  # else the reader ended already
                sock = socket.socket(fileno=self.conn.fileno())
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()  # the fd stays the connection's
        self.reader.join(timeout=1.0)


__all__ = ["CallerGone", "Caller", "RemoteError", "WorkerDied", "accept", "answer", "connect", "load_message",
           "receive", "send", "serve", "settle"]
