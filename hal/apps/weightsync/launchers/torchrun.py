"""The torchrun launcher: one process per worker, started by torch.distributed's elastic launcher (the
library behind ``torchrun``) on this machine, one device each.

Ranks ``0..T-1`` are the trainer (``--trainer-ranks T``; with T > 1 a sharded trainer whose ranks form their own
default process group for FSDP2, :class:`~hal.apps.weightsync.sharded_trainer.ShardedTrainer`), ranks ``T..``
the rollouts. Rank 0 runs the step loop and trainer rank 0; every other rank runs :func:`serve`, executing the
typed calls rank 0 sends it over a ``torch.distributed`` TCPStore (a pickled :class:`Call` under ``call/{rank}/{seq}``,
its :class:`Reply` under ``reply/{rank}/{seq}``). Every wait is bounded by the job's timeout; a rank that
raises is named in the error of the call, and a rank that dies takes the run down with it (the elastic
agent stops the others), reported by role and cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import pickle
import time
import uuid
from typing import Any, Sequence

import hal
from hal.apps.weightsync.loop import JobResult, StepHook, run
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import describe_worker, make_engine

LOOPBACK = "127.0.0.1"
POLL_S = 0.002
"""Seconds between two looks for a reply (replies carry their own timestamps: polling does not skew figures)."""
REPLY_MARGIN_S = 30.0
"""Seconds a reply may take beyond the timeout (a call that waits out the engine's timeout still answers)."""


@dataclasses.dataclass
class Call:
    """One call rank 0 sends a serving rank: ``method(*args, **kwargs)`` on its worker (``"stop"``: end)."""

    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Reply:
    """A serving rank's answer: the result, or its failure as ``"ExceptionType: message"``."""

    ok: bool
    value: Any = None
    error: str | None = None


class RemoteCallError(hal.HalError, RuntimeError):
    """A call on a serving rank raised; the message is its ``"ExceptionType: message"``."""


class TorchrunGroup:
    """A :class:`ckpt.manager.WorkerGroup` on rank 0: worker 0 here, workers 1..R the serving ranks.

    Args:
        local: this rank's worker (the trainer).
        store: a TCPStore every rank is connected to.
        world_size: the number of ranks.
        timeout: the job's timeout; a reply may take ``timeout + REPLY_MARGIN_S`` seconds.
        trainers: the trainer ranks (``0..trainers-1``); the rest are rollouts.
    """

    def __init__(self, local: Any, store: Any, world_size: int, timeout: float, trainers: int = 1) -> None:
        self.local, self.store, self.timeout = local, store, timeout
        self.trainer_world_size, self.rollout_world_size = trainers, world_size - trainers
        self.seq = [0] * world_size

    def submit(self, index: int, method: str, *args: Any, **kwargs: Any):
        """Start ``method`` on worker ``index``: posted to a serving rank now (so every rank of a collective
        phase is asked before rank 0's own part blocks), awaited by the returned coroutine."""
        if index == 0:
            return self.local.invoke(method, *args, **kwargs)
        seq = self.seq[index]
        self.seq[index] += 1
        self.store.set(f"call/{index}/{seq}", pickle.dumps(Call(method, args, kwargs)))
        return self.reply(index, seq, method)

    async def reply(self, index: int, seq: int, method: str) -> Any:
        """The reply to call ``seq`` of rank ``index``.

        Raises:
            RemoteCallError: the call raised there.
            TimeoutError: no reply within ``timeout + REPLY_MARGIN_S`` seconds.
        """
        key = f"reply/{index}/{seq}"
        limit = self.timeout + REPLY_MARGIN_S
        deadline = time.monotonic() + limit
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method} on rank {index}: no reply within {limit:g} s")
            await asyncio.sleep(POLL_S)
        reply = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        if not reply.ok:
            raise RemoteCallError(reply.error)
        return reply.value

    def stop(self, wait: bool) -> None:
        """Tell every serving rank to return; ``wait``: until each said it does (at most the timeout), so this
        rank, which hosts the store, does not end while a serving rank still reads from it.

        Raises:
            TimeoutError: ``wait`` and a serving rank did not answer within the timeout.
        """
        keys = []
        for index in range(1, self.trainer_world_size + self.rollout_world_size):
            seq = self.seq[index]
            self.seq[index] += 1
            self.store.set(f"call/{index}/{seq}", pickle.dumps(Call("stop")))
            keys.append(f"reply/{index}/{seq}")
        deadline = time.monotonic() + self.timeout
        while wait and not self.store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the serving ranks did not stop within {self.timeout:g} s")
            time.sleep(POLL_S)

    def describe(self, index: int) -> str:
        return f"{describe_worker(index, None, self.trainer_world_size)} (rank {index})"

    def is_dead(self, error: BaseException) -> bool:
        return False  # a dead rank ends the run through the elastic agent, which names it

    def explain(self, error: BaseException) -> str:
        return str(error) if isinstance(error, RemoteCallError) else f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        raise NotImplementedError("the torchrun launcher does not restart a rank (max_restarts=0)")


def serve(worker: Any, store: Any, rank: int, timeout: float) -> None:
    """A serving rank's loop: run each call rank 0 sends, in order, until ``"stop"``.

    Raises:
        hal.DistributedTimeoutError: no call came within ``timeout`` seconds (rank 0 is gone or stuck).
    """
    loop = asyncio.new_event_loop()
    seq = 0
    try:
        while True:
            key = f"call/{rank}/{seq}"
            try:
                message = store.get(key)  # blocks at most the store's timeout
            except Exception as exc:
                raise hal.DistributedTimeoutError(f"rank {rank}: no call from rank 0 within {timeout:g} s "
                                                  f"({type(exc).__name__}: {exc})") from exc
            call = pickle.loads(message)
            store.delete_key(key)
            if call.method == "stop":
                store.set(f"reply/{rank}/{seq}", pickle.dumps(Reply(True)))
                return
            try:
                reply = Reply(True, loop.run_until_complete(worker.invoke(call.method, *call.args, **call.kwargs)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0, which names this rank
                reply = Reply(False, error=f"{type(exc).__name__}: {exc}")
            store.set(f"reply/{rank}/{seq}", pickle.dumps(reply))
            seq += 1
    finally:
        loop.close()


def trainer_rank(options: JobOptions, engine: Any, rank: int, store: Any, where: Any = None) -> Trainer:
    """Trainer rank ``rank``'s role: the whole model (one trainer rank, running at ``where``), or its shards,
    after joining the trainer ranks' own default process group (FSDP2's) over the job's ``store`` (under a
    prefix of its own)."""
    if not options.sharded:
        return Trainer(options, engine, where)
    import torch.distributed as dist

    from hal.apps.weightsync.sharded_trainer import ShardedTrainer

    hal.init_process_group(options.device, store=dist.PrefixStore("trainer-ranks", store), rank=rank,
                           world_size=options.trainer_ranks, timeout=options.timeout)
    return ShardedTrainer(options, engine, rank)


def link_endpoint(rank: int) -> str:
    """The emulated network's endpoint name of global rank ``rank`` (``options.link_gbit``)."""
    return f"rank{rank}"


def rank_main(options: JobOptions, ctl_port: int, hooks: Sequence[StepHook], net: Any = None) -> dict[str, Any] | None:
    """One process: rank 0 runs the job (with ``hooks``) and returns its result (as a dict); the others serve.
    With ``net`` (``options.link_gbit``) the rank's engine runs in its own network namespace
    (:meth:`hal.apps.links.EmulatedNetwork.enter`).
    SIGINT and SIGTERM end it quietly (:func:`hal.apps.shutdown.quiet_rank_exit`)."""
    from hal.apps.shutdown import quiet_rank_exit
    from hal.apps.weightsync.worker import Where

    quiet_rank_exit()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hal.bind_local_device(options.rank_device)  # one device per rank, LOCAL_RANK's (with --hybrid: device 0)
    store = hal.connect_store(LOOPBACK, ctl_port, rank, world_size, timeout=options.timeout)
    # after the control store, whose socket stays on the host's loopback (a socket keeps its namespace)
    node_ip = LOOPBACK if net is None else net.enter(link_endpoint(rank))
    where = Where(rank, node_ip, os.getpid(), options.device)
    if rank >= options.trainer_ranks and options.rollout == "vllm":  # hal's engine is built inside vLLM's worker
        from hal.apps.weightsync.vllm_role import VllmRolloutRole

        serve(VllmRolloutRole(options, rank), store, rank, options.timeout)
        return None
    engine = make_engine(options, rank, node_ip)
    if rank >= options.trainer_ranks:
        serve(Rollout(options, engine, rank, where=where), store, rank, options.timeout)
        return None
    trainer = trainer_rank(options, engine, rank, store, where)
    if rank != 0:
        serve(trainer, store, rank, options.timeout)
        return None
    group = TorchrunGroup(trainer, store, world_size, options.timeout, options.trainer_ranks)
    try:
        result = asyncio.run(run(options, group, hooks))
    except BaseException:
        group.stop(wait=False)
        raise
    group.stop(wait=True)
    return dataclasses.asdict(result)


def role(rank: int, trainers: int = 1) -> str:
    """What a global rank is: ranks ``0..trainers-1`` train, the rest serve."""
    if rank < trainers:
        return "trainer (rank 0)" if trainers == 1 else f"trainer rank {rank} (rank {rank})"
    return f"rollout {rank} (rank {rank})"


def launch(options: JobOptions, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Run the job with one process per worker; ``hooks`` (pickled to rank 0) run around each publish.

    What the run makes for itself is removed when it ends (success, failure or interrupt): the file engine's
    directory when ``options.file_root`` is ``None`` (``$TMPDIR/hal-sync-*``; a given one is kept), the model
    vLLM starts from (``hal-sync-vllm-*``) and the elastic agent's logs (``hal-elastic-*``). On SIGINT or
    SIGTERM the agent stops the ranks with SIGTERM, which end within :data:`hal.apps.shutdown.RANK_EXIT_GRACE_S`
    seconds (SIGKILL after :data:`hal.apps.shutdown.LAUNCH_SHUTDOWN_TIMEOUT_S`), and the ``KeyboardInterrupt``
    (SIGINT) or torch's ``SignalException`` (SIGTERM) propagates (:mod:`hal.apps.shutdown`).

    Raises:
        hal.apps.errors.WorkerFailedError: a rank failed; names it (role) and how (exception, signal, exit code).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hal.apps.errors import worker_failed
    from hal.apps.shutdown import (LAUNCH_SHUTDOWN_TIMEOUT_S, OWN_LAUNCH_SIGNALS, elastic_logs, own_elastic_launch,
                                   scratch_dir)
    from hal.distributed import pick_port

    import ckpt

    os.environ[hal.ENV_VAR] = options.device
    with contextlib.ExitStack() as scratch:
        if options.file_root is None and ckpt.checkpoint_engine_says(options.engine, "publishes_to_files"):
            options = dataclasses.replace(options, file_root=scratch.enter_context(scratch_dir("hal-sync-")))
        if options.rollout == "vllm" and options.vllm_model_dir is None:
            from hal.apps.weightsync.vllm_role import save_initial_model

            # the directory vLLM starts from
            options = save_initial_model(options, root=scratch.enter_context(scratch_dir("hal-sync-vllm-")))
        logs = scratch.enter_context(scratch_dir("hal-elastic-"))
        net = None
        if options.link_gbit is not None:
            from hal.apps.links import emulated_network, link_gbit_to_bps

            net = scratch.enter_context(emulated_network({link_endpoint(r): link_gbit_to_bps(options.link_gbit)
                                                          for r in range(options.world_size)}))
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=options.world_size,
                              run_id=f"hal-sync-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint=f"{LOOPBACK}:0", max_restarts=0, monitor_interval=0.1,
                              start_method="spawn", logs_specs=elastic_logs(logs),
                              shutdown_timeout=LAUNCH_SHUTDOWN_TIMEOUT_S, signals_to_handle=OWN_LAUNCH_SIGNALS)
        try:
            with own_elastic_launch(logs):
                per_rank = elastic_launch(config, rank_main)(options, pick_port(), list(hooks), net)
        except ChildFailedError as exc:
            raise worker_failed(exc, functools.partial(role, trainers=options.trainer_ranks), "hal sync") from None
    return JobResult(**per_rank[0])


__all__ = ["Call", "RemoteCallError", "Reply", "TorchrunGroup", "launch", "link_endpoint", "rank_main", "role", "serve",
           "trainer_rank"]
