"""The soak's workers: one process per worker (the trainer, each rollout), started, killed, stopped and
restarted by the driver, and the in-process group of the colocated engine.

:class:`ProcessGroup` is a :class:`ckpt.manager.WorkerGroup`. Each worker is ``python -m hal.apps.soak.child FD``
inside the sandbox, joined to the driver by a socket pair: first its :class:`ChildSpec`, then the job's call
channel (:mod:`hal.apps.weightsync.channel`; tensors by value). When a process dies its socket closes and every
call in flight fails with :class:`WorkerDied`; a stopped worker fails its call at the manager's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import hal
from hal.apps.weightsync.channel import Caller, RemoteError, WorkerDied, send
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.worker import Where, Worker, describe_worker

# seconds a worker process may take to start (import torch, build its model) and answer its first call
START_LIMIT_S = 180.0
EXIT_WAIT_S = 10.0  # seconds a stopping worker has before it is killed
# set in each worker unless hal soak's environment sets them, so the leak rule reads what the program holds:
# torch's flight recorder ring (2000 gloo entries by default) grows ~0.8 KiB per collective until full, and
# glibc's per-thread arenas keep freed pages resident (1.8 MB in 15 arenas measured; 0.1 MB with one)
WORKER_ENV_DEFAULTS = {"TORCH_FR_BUFFER_SIZE": "64", "MALLOC_ARENA_MAX": "1"}


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
    """One process of worker ``index``: its ``Popen``, log and the driver's end of its call channel."""

    def __init__(self, index: int, number: int, proc: subprocess.Popen, log: str) -> None:
        self.index, self.number, self.proc, self.log = index, number, proc, log
        self.caller: Caller | None = None
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def dead(self) -> str | None:
        """How the process ended (``None`` while it runs)."""
        return self.caller.dead

    def ended(self, why: str | None) -> str:
        """How the process ended, with its log's last lines, once its end of the channel closed."""
        try:
            how = why or explain_exit(self.proc.wait(timeout=EXIT_WAIT_S))
        except subprocess.TimeoutExpired:
            how = explain_exit(None)
        tail = log_tail(self.log)
        return how + (f"; its log ends: {tail}" if tail and "SIGKILL" not in how else "")


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
        # one device per worker, as torchrun's LOCAL_RANK gives each rank (hal.set_device reads it)
        env = {**WORKER_ENV_DEFAULTS, **os.environ, hal.ENV_VAR: self.options.device, "LOCAL_RANK": str(index),
               **self.sandbox.env(index)}
        argv = [*self.sandbox.prefix(index), sys.executable, "-m", "hal.apps.soak.child", str(theirs.fileno())]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        conn = Connection(ours.detach())
        worker = Incarnation(index, self.started[index], proc, log_path)
        spec = ChildSpec(self.options, index, self.sandbox.node_ip(index), self.sandbox.surroundings(index))
        with contextlib.suppress(OSError):  # it died at once: the reader sees it
            send(conn, ("spec", spec))
        loop = self.loop
        worker.caller = Caller(conn, on_notice=lambda notice: loop.call_soon_threadsafe(self.on_notice, index, notice),
                               ended=worker.ended, name=f"hal-soak-reader-{index}-{worker.number}")
        self.workers[index] = worker
        return worker

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
        worker = self.workers[index]
        if worker is None:
            future = self.loop.create_future()
            future.set_exception(WorkerDied("the worker died (never started)"))
        else:
            future = asyncio.wrap_future(worker.caller.post(method, *args, **kwargs), loop=self.loop)
        # a call nobody awaits any more (the manager gave up on it, the run was stopped) fails quietly
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
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
                worker.caller.stop()
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


__all__ = ["WORKER_ENV_DEFAULTS", "ChildSpec", "InProcessGroup", "ProcessGroup", "build_host", "explain_exit"]
