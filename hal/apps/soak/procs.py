"""The soak's workers: one process per worker (the trainer, each rollout), started, killed, stopped and
restarted by the driver, and the in-process group of the colocated engine.

:class:`ProcessGroup` is a :class:`ckpt.manager.WorkerGroup`: the job's loop (:class:`hal.apps.weightsync.loop.Job`)
and verl's manager drive it as they drive the torchrun and Ray launchers' groups. Each worker is
``python -m hal.apps.soak.child FD`` (inside the sandbox's namespaces, :class:`hal.apps.soak.sandbox.Sandbox`),
connected to the driver by a socket pair carrying messages pickled with the standard :mod:`pickle` (tensors by
value; ``multiprocessing.connection``'s framing, not its pickler, whose torch reductions pass tensors as file
descriptors only between processes ``multiprocessing`` started):

* driver -> worker: ``("call", seq, call)`` (run in order, one at a time), ``call`` the pickle of
  ``(method, args, kwargs)``, and ``("stop",)``;
* worker -> driver: ``("reply", seq, ok, value, error)``, ``value`` the pickle of the result, and
  ``("notice", message)`` (sent the moment it happens: :class:`hal.apps.soak.strike.Host`'s).

A call's and a result's content are pickled apart from the message around them
(:func:`hal.apps.weightsync.messages.load_message`): one that does not load at the other end fails that call,
and the worker and its connection go on.

A reader thread per process hands messages to the driver's event loop; when the socket closes (the process
died: SIGKILL closes it at once) every call in flight fails with :class:`WorkerDied`, which
:meth:`ProcessGroup.is_dead` recognises, so the manager fails the update at once naming the worker. A worker
that does not answer (stopped) fails its call only at the manager's deadline. Every wait here is bounded.
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

START_LIMIT_S = 180.0
"""Seconds a worker process may take to start (import torch, build its model) and answer its first call."""
EXIT_WAIT_S = 10.0
"""Seconds a worker asked to stop may take to exit before it is killed."""
WORKER_ENV_DEFAULTS = {"TORCH_FR_BUFFER_SIZE": "64", "MALLOC_ARENA_MAX": "1"}
"""What each worker's environment holds unless ``hal soak``'s own sets it, so that the leak rule
(:func:`hal.apps.soak.checker.check_leaks`) reads what the program holds, not what a ring or an allocator keeps.

``TORCH_FR_BUFFER_SIZE``: entries of torch's flight recorder (c10d's ring of the last collectives, each with
its captured Python and C++ stacks), on for gloo with 2000 entries in torch 2.13. Measured: one gloo process's
``RssAnon`` grows about 0.8 KiB per collective until the ring is full (+1.6 MB after 2000 broadcasts), then
stays flat. The collective engine's processes grew 8 to 10 KiB per update (their rings fill after about 200
updates), and the leak rule (growth between two windows) read the filling ring as a leak (the trainer's +1.5 MB
in a 300-update run). 64 entries (about 50 KB) keep the recorder on and its growth far under one bucket.

``MALLOC_ARENA_MAX``: glibc gives threads their own malloc arenas, up to 8 per core, each a heap of its own
(mapped on a 64 MiB boundary). A burst of threads (a failed update's teardown, UCX's and asyncio's workers)
spreads allocations over more arenas, and each keeps partly used pages resident after everything is freed and
``malloc_trim`` ran: measured, 16 threads that free all they allocated left 1.8 MB held in 15 arenas, 0.1 MB
with one arena. The nixl rollouts' held memory stepped up at faults by new 1.7 MB arena heaps (+0.3 to 0.5 MB
resident each), and one 300-update run failed at +1.3 MB; with one arena the same seed grew -16 KB. One arena
costs lock contention between threads, nothing a soak measures."""


class WorkerDied(hal.HalError, RuntimeError):
    """The worker's process ended while a call was in flight (the message says how: signal or exit status)."""


class RemoteError(hal.HalError, RuntimeError):
    """A call raised in the worker; the message is its ``"ExceptionType: message"``."""


@dataclasses.dataclass
class ChildSpec:
    """What a worker process builds: ``options``' role of worker ``index`` (0: the trainer), reached at
    ``node_ip``, its strikes acting on ``surroundings`` (:class:`hal.apps.soak.strike.Surroundings`)."""

    options: JobOptions
    index: int
    node_ip: str
    surroundings: Any


def build_host(spec: ChildSpec, notify: Callable[[tuple], None], in_process: bool = False, engine: Any = None) -> Any:
    """The role of ``spec`` (trainer or rollout) on a striking engine, in a :class:`~hal.apps.soak.strike.Host`.

    Args:
        engine: the engine to strike through (the colocated engine shared in one process); default: a new one
            (:func:`hal.apps.weightsync.worker.make_engine`).
    """
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
    """Send ``message`` pickled by the standard pickler (see the module docstring).

    Raises:
        OSError: the other end is gone.
    """
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next message (blocks until one comes).

    Raises:
        EOFError: the other end closed the connection.
    """
    return pickle.loads(conn.recv_bytes())


def settle(future: asyncio.Future, ok: bool, value: bytes | None, error: str | None) -> None:
    """Complete a call's ``future`` from its reply (see the module docstring): the result that ``value`` pickles,
    or :class:`RemoteError` with ``error`` (``ok`` false), or with why ``value`` does not load here (the worker
    goes on)."""
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
    """The last ``lines`` non-empty lines among the last ``size`` bytes of the log at ``path``, joined by
    ``" | "`` (``""`` when there is none)."""
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
        self.dead: str | None = None
        """How the process ended (``None`` while it runs)."""
        self.stopped = False
        self.thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class ProcessGroup:
    """A :class:`ckpt.manager.WorkerGroup` of worker processes (see the module docstring).

    Args:
        options: the job's options (``rollouts`` rollout workers besides the trainer).
        sandbox: where the processes live (:class:`hal.apps.soak.sandbox.Sandbox`, entered).
        on_notice: ``on_notice(index, message)``, called on the event loop for each notice a worker sends.

    Call :meth:`start` (on the event loop that drives the group) before anything else; :meth:`close` at the end.
    """

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
        """Post ``method(*args, **kwargs)`` (``Host.arm``, ``Trainer.train``: sent by reference, as pickle sends a
        function) to worker ``index``; the future gives its result, or fails with
        :class:`RemoteError` (it raised there) or :class:`WorkerDied`."""
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
        """Kill worker ``index``'s process if it still runs, start a new one and wait until it answers.

        Raises:
            WorkerDied: the new process died while starting (its log's last lines say why).
            TimeoutError: it did not answer within :data:`START_LIMIT_S` seconds.
        """
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
    """The colocated engine's workers, in the driver's process: one shared engine, each worker in a
    :class:`~hal.apps.soak.strike.Host` (a :class:`ckpt.manager.WorkerGroup`, as
    :class:`hal.apps.weightsync.launchers.local.LocalGroup`)."""

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
