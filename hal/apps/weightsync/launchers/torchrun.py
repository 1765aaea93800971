"""The torchrun launcher: one process per worker, started by torch.distributed's elastic launcher on this
machine, one device each.

Ranks ``0..T-1`` are the trainer (T > 1: a sharded trainer with its own process group), ranks ``T..`` the
rollouts. Rank 0 runs the step loop; every other rank runs :func:`serve`. Calls travel over the job's call
channel (:mod:`hal.apps.weightsync.channel`), one loopback connection per serving rank, whose kernel-picked
port it publishes in the elastic agent's store. Every wait is bounded by the job's timeout; a rank that raises
is named in the call's error, and a rank that dies takes the run down, reported by role and cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import socket
import uuid
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import hal
from hal.apps.weightsync import channel
from hal.apps.weightsync.loop import JobResult, StepHook, run
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import describe_worker, make_engine

LOOPBACK = "127.0.0.1"
# seconds a reply may take beyond the timeout
REPLY_MARGIN_S = 30.0
STORE_PREFIX = "hal-sync"  # the job's keys in the elastic agent's store


def job_store(timeout: float, prefix: str = STORE_PREFIX) -> Any:
    """The launcher's store under ``prefix`` (DistributedTimeoutError after ``timeout`` seconds)."""
    return hal.launcher_store(timeout, prefix)


def accept_calls(store: Any, rank: int, timeout: float) -> Connection:
    """A serving rank's end of the call channel: a loopback port published in ``store`` as ``calls/{rank}``,
    connected by rank 0 within ``timeout`` seconds."""
    with socket.create_server((LOOPBACK, 0)) as server:
        store.set(f"calls/{rank}", str(server.getsockname()[1]))
        return channel.accept(server, timeout)


def connect_calls(store: Any, world_size: int, timeout: float) -> dict[int, Connection]:
    """Rank 0's ends of the call channels, ``{rank: connection}``, each port waited for in ``store``."""
    conns = {}
    for index in range(1, world_size):
        try:
            port = int(store.get(f"calls/{index}"))
        except (TimeoutError, RuntimeError) as exc:  # torch.distributed.DistStoreError is a RuntimeError
            raise hal.DistributedTimeoutError(f"rank {index} did not publish its call port within the store's "
                                              f"timeout (it failed or is gone): {exc}") from exc
        conns[index] = channel.connect(LOOPBACK, port, timeout)
    return conns


class TorchrunGroup:
    """A :class:`ckpt.manager.WorkerGroup` on rank 0: worker 0 here, the others serving ranks; a reply may take
    ``timeout + REPLY_MARGIN_S`` seconds."""

    def __init__(self, local: Any, conns: dict[int, Connection], world_size: int, timeout: float,
                 trainers: int = 1) -> None:
        self.local, self.timeout = local, timeout
        self.trainer_world_size, self.rollout_world_size = trainers, world_size - trainers
        self.callers = {index: channel.Caller(conn, "rank 0", name=f"hal-calls-{index}")
                        for index, conn in conns.items()}

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any):
        """Start ``method`` on worker ``index``: posted now, awaited by the returned coroutine."""
        if index == 0:
            return self.local.invoke(method, *args, **kwargs)
        posted = self.callers[index].post(method, *args, **kwargs)
        return self.reply(index, posted, getattr(method, "__qualname__", repr(method)))

    async def reply(self, index: int, posted: concurrent.futures.Future, method: str) -> Any:
        """The reply to ``posted`` on rank ``index``; RemoteError when it raised there, TimeoutError when late."""
        limit = self.timeout + REPLY_MARGIN_S
        try:
            return await asyncio.wait_for(asyncio.wrap_future(posted), limit)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{method} on rank {index}: no reply within {limit:g} s") from None

    def stop(self, wait: bool) -> None:
        """Tell every serving rank to return; ``wait``: until each said so (TimeoutError past the timeout)."""
        stops = [caller.stop() for caller in self.callers.values()]
        if wait and concurrent.futures.wait(stops, self.timeout).not_done:
            raise TimeoutError(f"the serving ranks did not stop within {self.timeout:g} s")

    def close(self) -> None:
        """Close the call channels (calls still in flight fail)."""
        for caller in self.callers.values():
            caller.close()

    def describe(self, index: int) -> str:
        return f"{describe_worker(index, None, self.trainer_world_size)} (rank {index})"

    def is_dead(self, error: BaseException) -> bool:
        return False  # a dead rank ends the run through the elastic agent, which names it

    def explain(self, error: BaseException) -> str:
        if isinstance(error, (channel.RemoteError, channel.WorkerDied)):
            return str(error)
        return f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        raise NotImplementedError("the torchrun launcher does not restart a rank (max_restarts=0)")


def serve(worker: Any, conn: Connection, rank: int, timeout: float) -> None:
    """A serving rank's loop: run each call from rank 0 in order until the stop; DistributedTimeoutError when
    none comes within ``timeout`` seconds, CallerGone when rank 0's end closes."""
    channel.serve(conn, worker, f"rank {rank}", timeout)


def trainer_rank(options: JobOptions, engine: Any, rank: int, store: Any, where: Any = None) -> Trainer:
    """Trainer rank ``rank``'s role: the whole model, or its shards after joining the trainer ranks' own
    process group over ``store``."""
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


def rank_main(options: JobOptions, hooks: Sequence[StepHook], net: Any = None) -> dict[str, Any] | None:
    """One process: rank 0 runs the job and returns its result (a dict); the others serve. With ``net`` the rank
    runs in its own network namespace."""
    from hal.apps.shutdown import quiet_rank_exit
    from hal.apps.weightsync.worker import Where

    quiet_rank_exit()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hal.set_device(options.device_of(rank))  # LOCAL_RANK's device (--hybrid: the one this rank shares)
    store = job_store(options.timeout)
    # the call channel before the namespace: its sockets keep the host's loopback
    conns = connect_calls(store, world_size, options.timeout) if rank == 0 else \
        {rank: accept_calls(store, rank, options.timeout)}
    group = None
    try:
        sock = conns.get(rank)
        node_ip = LOOPBACK if net is None else net.enter(link_endpoint(rank))
        where = Where(rank, node_ip, os.getpid(), options.device)
        if rank >= options.trainer_ranks and options.rollout == "vllm" and not options.resharded:
            from hal.apps.weightsync.vllm_role import VllmRolloutRole

            # hal's engine is built inside vLLM's worker
            serve(VllmRolloutRole(options, rank), sock, rank, options.timeout)
            return None
        engine = make_engine(options, rank, node_ip)
        if rank >= options.trainer_ranks:
            if options.resharded:  # the server's tensor-parallel ranks: a default process group of their own
                import torch.distributed as dist

                server, tp_rank = options.tp_rank(rank)
                hal.init_process_group(options.device_of(rank), store=dist.PrefixStore(f"rollout-tp/{server}", store),
                                       rank=tp_rank, world_size=options.rollout_tp, timeout=options.timeout)
            if options.rollout == "vllm":  # a vLLM rank over that group, hal's engine beside it
                from hal.apps.weightsync.vllm_tp import VllmTPRolloutRole

                role = VllmTPRolloutRole(options, engine, rank, where=where)
            else:
                role = Rollout(options, engine, rank, where=where)
            serve(role, sock, rank, options.timeout)
            return None
        trainer = trainer_rank(options, engine, rank, store, where)
        if rank != 0:
            serve(trainer, sock, rank, options.timeout)
            return None
        group = TorchrunGroup(trainer, conns, world_size, options.timeout, options.trainer_ranks)
        try:
            result = asyncio.run(run(options, group, hooks))
        except BaseException:
            group.stop(wait=False)
            raise
        group.stop(wait=True)
        return dataclasses.asdict(result)
    finally:
        if group is not None:
            group.close()  # its readers end first
        for conn in conns.values():
            conn.close()


def role(rank: int, trainers: int = 1) -> str:
    """What a global rank is: ranks ``0..trainers-1`` train, the rest serve."""
    if rank < trainers:
        return "trainer (rank 0)" if trainers == 1 else f"trainer {rank} (rank {rank})"
    return f"rollout {rank} (rank {rank})"


def launch(options: JobOptions, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Run the job with one process per worker; ``hooks`` (pickled to rank 0) run around each publish.

    What the run makes for itself is removed however it ends; SIGINT or SIGTERM stop the ranks and propagate.
    WorkerFailedError names a failed rank and how.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hal.apps.errors import worker_failed
    from hal.apps.shutdown import (LAUNCH_SHUTDOWN_TIMEOUT_S, OWN_LAUNCH_SIGNALS, elastic_logs, own_elastic_launch,
                                   scratch_dir)

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
        if options.rollout == "vllm" and options.resharded:  # what a killed vLLM rank leaves in shared memory
            from hal.apps.weightsync.vllm_tp import remove_shm_segments

            scratch.callback(remove_shm_segments, config.run_id)
        try:
            with own_elastic_launch(logs):
                per_rank = elastic_launch(config, rank_main)(options, list(hooks), net)
        except ChildFailedError as exc:
            raise worker_failed(exc, functools.partial(role, trainers=options.trainer_ranks), "hal sync") from None
    return JobResult(**per_rank[0])


__all__ = ["TorchrunGroup", "accept_calls", "connect_calls", "job_store", "launch", "link_endpoint", "rank_main",
           "role", "serve", "trainer_rank"]
