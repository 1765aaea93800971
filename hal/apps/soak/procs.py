"""The soak's workers: one process per worker (the trainer, each rollout), started, killed, stopped and
restarted by the driver, and the in-process group of the colocated engine.

:class:`ProcessGroup` is a :class:`ckpt.manager.WorkerGroup`. Each worker is ``python -m hal.apps.soak.child FD``
inside the sandbox, joined to the driver by a socket pair carrying standard pickles (tensors by value):

* driver -> worker: ``("call", seq, call)`` (run in order), ``call`` the pickle of ``(method, args, kwargs)``;
  ``("stop",)``;
* worker -> driver: ``("reply", seq, ok, value, error)``, ``value`` the result's pickle; ``("notice", message)``.

Contents are pickled apart from their message, so one that does not load fails only its call. When a
process dies its socket closes and every call in flight fails with :class:`WorkerDied`; a stopped worker
fails its call at the manager's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import hal
from ckpt.manager import method_class
from hal.apps.weightsync.messages import load_message
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.worker import Where, Worker, describe_worker

# seconds a worker process may take to start (import torch, build its model) and answer its first call
START_LIMIT_S = 180.0
EXIT_WAIT_S = 10.0  # seconds a stopping worker has before it is killed
# set in each worker unless hal soak's environment sets them, so the leak rule reads what the program holds:
# torch's flight recorder ring (2000 gloo entries by default) grows ~0.8 KiB per collective until full, and
# glibc's per-thread arenas keep freed pages resident (1.8 MB in 15 arenas measured; 0.1 MB with one)
WORKER_ENV_DEFAULTS = {"TORCH_FR_BUFFER_SIZE": "64", "MALLOC_ARENA_MAX": "1"}


class WorkerDied(hal.HalError, RuntimeError):
    """The worker's process ended while a call was in flight (the message says how: signal or exit status)."""


class RemoteError(hal.HalError, RuntimeError):
    """A call raised in the worker; the message is its ``"ExceptionType: message"``."""


@dataclasses.dataclass
class ChildSpec:
    """What a worker process builds: ``options``' role of worker ``index`` (0: the trainer) at ``node_ip``, its
    strikes acting on ``surroundings``."""

    options: JobOptions
    index: int
    node_ip: str
    surroundings: Any


def build_host(spec: ChildSpec, notify: Callable[[tuple], None], in_process: bool = False, engine: Any = None) -> Any:
    """The role of ``spec`` on a striking ``engine`` (default: a new one), in a :class:`~hal.apps.soak.strike.Host`."""
    from hal.apps.soak.strike import Host, StrikingEngine
    from hal.apps.weightsync.rollout import Rollout
    from hal.apps.weightsync.trainer import Trainer
    from hal.apps.weightsync.worker import make_engine

    options, index = spec.options, spec.index
    real = engine if engine is not None else make_engine(options, index, spec.node_ip)
    striking = StrikingEngine.wrap(real)
    where = Where(index, spec.node_ip, os.getpid(), options.device)
    worker = Trainer(options, striking, where) if index == 0 else Rollout(options, striking, index, where=where)
    host = Host(worker, notify, spec.surroundings, in_process=in_process)
    striking.attach(host)
    host.min_bytes = worker.published_shape()[0] if index == 0 else worker.adapter.memory().bank_bytes
    return host


def send(conn: Connection, message: Any) -> None:
    """Send ``message`` pickled by the standard pickler; OSError when the other end is gone."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next message (blocks until one comes); EOFError when the other end closed."""
    return pickle.loads(conn.recv_bytes())


def settle(future: asyncio.Future, ok: bool, value: bytes | None, error: str | None) -> None:
    """Complete a call's ``future`` from its reply: the result ``value`` pickles, or :class:`RemoteError`."""
    if not ok:
        future.set_exception(RemoteError(error or "the call failed in the worker, which did not say why"))
        return
    value, why = load_message(value)
    if why is None:
        future.set_result(value)
    else:
        future.set_exception(RemoteError(f"its result does not load in the driver: {why}"))


def explain_exit(returncode: int | None) -> str:
    """How a process ended, in words: ``"killed by SIGKILL"``, ``"exited with status 1"``."""
    if returncode is None:
        return "its process ended"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def log_tail(path: str, lines: int = 3, size: int = 4096) -> str:
    """The last ``lines`` non-empty lines among the last ``size`` bytes of the log at ``path``, joined by ``" | "``."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - size))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])


class Incarnation:
    """One process of worker ``index``: its ``Popen``, connection, calls in flight and reader thread."""

    def __init__(self, index: int, number: int, proc: subprocess.Popen, conn: Connection, log: str) -> None:
        self.index, self.number, self.proc, self.conn, self.log = index, number, proc, conn, log
        self.pending: dict[int, asyncio.Future] = {}
        self.seq = 0
        # how the process ended (None while it runs)
        self.dead: str | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class ProcessGroup:
    """A :class:`ckpt.manager.WorkerGroup` of worker processes in ``sandbox``; ``on_notice(index, message)`` runs
    on the event loop. Call :meth:`start` on that loop first and :meth:`close` at the end."""

    def __init__(self, options: JobOptions, sandbox: Any, on_notice: Callable[[int, tuple], None]) -> None:
        self.options, self.sandbox, self.on_notice = options, sandbox, on_notice
        self.trainer_world_size, self.rollout_world_size = 1, options.rollouts
        self.workers: list[Incarnation | None] = [None] * (1 + options.rollouts)
        self.whereabouts: list[Where | None] = [None] * (1 + options.rollouts)
        self.started = [0] * (1 + options.rollouts)
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- processes ------------------------------------------------------------------------------------------

    def spawn(self, index: int) -> Incarnation:
        """Start worker ``index``'s next process (it builds its role once it has read its spec)."""
        self.started[index] += 1
        ours, theirs = socket.socketpair()
        log_path = self.sandbox.log_path(index, self.started[index])
        # one device per worker, as torchrun's LOCAL_RANK gives each rank (hal.bind_local_device reads it)
        env = {**WORKER_ENV_DEFAULTS, **os.environ, hal.ENV_VAR: self.options.device, "LOCAL_RANK": str(index),
               **self.sandbox.env(index)}
        argv = [*self.sandbox.prefix(index), sys.executable, "-m", "hal.apps.soak.child", str(theirs.fileno())]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        conn = Connection(ours.detach())
        worker = Incarnation(index, self.started[index], proc, conn, log_path)
        spec = ChildSpec(self.options, index, self.sandbox.node_ip(index), self.sandbox.surroundings(index))
        try:
            send(conn, ("spec", spec))
        except OSError:
            pass  # it died at once: the reader sees it
        worker.thread = threading.Thread(target=self._read, args=(worker,), daemon=True,
                                         name=f"hal-soak-reader-{index}-{worker.number}")
        worker.thread.start()
        self.workers[index] = worker
        return worker

    def _read(self, worker: Incarnation) -> None:
        """The reader thread: hand each message to the loop; on end of file, the death."""
        while True:
            try:
                message = receive(worker.conn)
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - an unpicklable message: the worker is unusable
                self.loop.call_soon_threadsafe(self._on_death, worker, f"sent a message that does not load ({exc})")
                return
            self.loop.call_soon_threadsafe(self._on_message, worker, message)
        try:
            returncode = worker.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        self.loop.call_soon_threadsafe(self._on_death, worker, explain_exit(returncode))

    def _on_message(self, worker: Incarnation, message: tuple) -> None:
        if message[0] == "notice":
            self.on_notice(worker.index, message[1])
            return
        _, seq, ok, value, error = message
        future = worker.pending.pop(seq, None)
        if future is not None and not future.done():  # else a call the manager gave up on (cancelled)
            settle(future, ok, value, error)

    def _on_death(self, worker: Incarnation, how: str) -> None:
        if worker.dead is not None:
            return
        tail = log_tail(worker.log)
        worker.dead = how + (f"; its log ends: {tail}" if tail and "SIGKILL" not in how else "")
        with contextlib.suppress(OSError):
            worker.conn.close()
        for future in worker.pending.values():
            if not future.done():
                future.set_exception(WorkerDied(f"the worker died ({worker.dead})"))
        worker.pending.clear()

    async def start(self) -> None:
        """Start every worker's process (they build their roles concurrently)."""
        self.loop = asyncio.get_running_loop()
        for index in range(len(self.workers)):
            self.spawn(index)

    def alive(self, index: int) -> bool:
        """Whether worker ``index``'s current process runs."""
        worker = self.workers[index]
        return worker is not None and worker.dead is None

    def pid(self, index: int) -> int | None:
        worker = self.workers[index]
        return None if worker is None else worker.pid

    def stop_process(self, index: int) -> None:
        """Mark worker ``index`` stopped (it stopped itself with SIGSTOP); :meth:`resume` continues it."""
        worker = self.workers[index]
        if worker is not None:
            worker.stopped = True

    def resume(self, index: int) -> None:
        """SIGCONT worker ``index`` (stopped by a fault)."""
        worker = self.workers[index]
        if worker is not None and worker.stopped:
            worker.stopped = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGCONT)

    # -- WorkerGroup ----------------------------------------------------------------------------------------

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Post ``method(*args, **kwargs)`` to worker ``index``; the future fails with :class:`RemoteError` or
        :class:`WorkerDied`."""
        future = self.loop.create_future()
        # a call nobody awaits any more (the manager gave up on it, the run was stopped) fails quietly
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        worker = self.workers[index]
        if worker is None or worker.dead is not None:
            future.set_exception(WorkerDied(f"the worker died ({worker.dead if worker else 'never started'})"))
            return future
        try:
            method_class(method)
            call = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a string, a lambda, what does not pickle: this call fails, unsent
            future.set_exception(exc)
            return future
        seq = worker.seq
        worker.seq += 1
        worker.pending[seq] = future
        try:
            send(worker.conn, ("call", seq, call))
        except OSError:
            pass  # the process is gone: the reader thread fails the call
        return future

    def describe(self, index: int) -> str:
        worker = self.workers[index]
        where = self.whereabouts[index]
        text = describe_worker(index, where)
        return text if where is not None or worker is None else f"{text} (pid {worker.pid})"

    def is_dead(self, error: BaseException) -> bool:
        return isinstance(error, WorkerDied)

    def explain(self, error: BaseException) -> str:
        if isinstance(error, (WorkerDied, RemoteError)):
            return str(error)
        return f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        """Kill worker ``index``'s process if it still runs, start a new one and wait until it answers (at most
        :data:`START_LIMIT_S` seconds)."""
        await self.end(index)
        self.spawn(index)
        self.whereabouts[index] = None
        self.whereabouts[index] = await asyncio.wait_for(self.submit(index, Worker.where), START_LIMIT_S)

    async def end(self, index: int) -> None:
        """SIGKILL worker ``index``'s process (if it runs) and wait until it is gone (bounded)."""
        worker = self.workers[index]
        if worker is None:
            return
        if worker.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_WAIT_S
        while worker.dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Ask every worker to stop, wait at most :data:`EXIT_WAIT_S` seconds, then kill what still runs."""
        for worker in self.workers:
            if worker is not None and worker.dead is None:
                self.resume(worker.index)
                with contextlib.suppress(OSError):
                    send(worker.conn, ("stop",))
        deadline = time.monotonic() + EXIT_WAIT_S
        while any(w is not None and w.dead is None for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for index in range(len(self.workers)):
            await self.end(index)


class InProcessGroup:
    """The colocated engine's workers in the driver's process: one shared engine, each worker in a
    :class:`~hal.apps.soak.strike.Host`."""

    def __init__(self, options: JobOptions, on_notice: Callable[[int, tuple], None]) -> None:
        from hal.apps.weightsync.worker import make_engine

        self.options = options
        self.trainer_world_size, self.rollout_world_size = 1, options.rollouts
        shared = make_engine(options, 0, "127.0.0.1")
        self.workers = [build_host(ChildSpec(options, i, "127.0.0.1", None),
                                   lambda message, i=i: on_notice(i, message), in_process=True, engine=shared)
                        for i in range(1 + options.rollouts)]
        self.whereabouts: list[Where | None] = [None] * (1 + options.rollouts)

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.ensure_future(self.workers[index].invoke(method, *args, **kwargs))

    def describe(self, index: int) -> str:
        return describe_worker(index, None)

    def is_dead(self, error: BaseException) -> bool:
        return False

    def explain(self, error: BaseException) -> str:
        return f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        raise ValueError("the colocated engine's workers share the driver's process: none is replaced")

    def alive(self, index: int) -> bool:
        return True

    def pid(self, index: int) -> int:
        return os.getpid()

    async def start(self) -> None:
        """Nothing to start: the workers exist."""

    def resume(self, index: int) -> None:
        """Nothing is ever stopped in process."""

    def stop_process(self, index: int) -> None:
        """Nothing is ever stopped in process."""

    async def close(self) -> None:
        """Nothing to stop."""


__all__ = ["WORKER_ENV_DEFAULTS", "ChildSpec", "InProcessGroup", "ProcessGroup", "RemoteError", "WorkerDied",
           "build_host", "explain_exit", "receive", "send", "settle"]
