"""The torchrun launcher: one process per worker, started by torch.distributed's elastic launcher on this
machine, one device each.

Ranks ``0..T-1`` are the trainer (T > 1: a sharded trainer with its own process group), ranks ``T..`` the
rollouts. Rank 0 runs the step loop; every other rank runs :func:`serve`. Calls travel over ZeroMQ DEALER
sockets as two frames (sequence number, pickle); a serving rank publishes its kernel-picked port in the elastic
agent's store. Every wait is bounded by the job's timeout; a rank that raises is named in the call's error,
and a rank that dies takes the run down, reported by role and cause.
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
from typing import Any, Callable, Sequence

import hal
from ckpt.manager import method_class
from hal.apps.weightsync.loop import JobResult, StepHook, run
from hal.apps.weightsync.messages import load_message
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import describe_worker, make_engine

LOOPBACK = "127.0.0.1"
# seconds a reply may take beyond the timeout
REPLY_MARGIN_S = 30.0
STORE_PREFIX = "hal-sync"  # the job's keys in the elastic agent's store


@dataclasses.dataclass
class Call:
    """One call rank 0 sends a serving rank: ``method(*args, **kwargs)`` on its worker; ``None``: end."""

    method: Callable | None
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


def frames(seq: int, message: Call | Reply) -> list[bytes]:
    """``message`` as it travels: its sequence number apart from its pickle, so a pickle that does not load at
    the other end still fails only its call."""
    return [str(seq).encode(), pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)]


def unframe(parts: list[bytes]) -> tuple[int, Any, str | None]:
    """``(seq, message, None)`` from :func:`frames`' two frames, or ``(seq, None, why)`` where the pickle does not
    load here; ValueError for anything else."""
    if len(parts) != 2 or not parts[0].isdigit():
        got = f"{len(parts)} frame(s) starting {parts[0][:20]!r}" if parts else "no frame"
        raise ValueError(f"a call channel message must be 2 frames, a sequence number then a pickle; got {got}")
    return int(parts[0]), *load_message(parts[1])


def job_store(timeout: float, prefix: str = STORE_PREFIX) -> Any:
    """The launcher's store under ``prefix`` (DistributedTimeoutError after ``timeout`` seconds)."""
    return hal.launcher_store(timeout, prefix)


def bind_calls(context: Any, store: Any, rank: int) -> Any:
    """A serving rank's end of the call channel: a DEALER socket on a kernel-picked loopback port, published in
    ``store`` as ``calls/{rank}``."""
    import zmq

    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # a last reply (stop's) still goes out while the process ends
    port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
    store.set(f"calls/{rank}", str(port))
    return sock


def connect_calls(context: Any, store: Any, world_size: int) -> dict[int, Any]:
    """Rank 0's ends of the call channels, ``{rank: DEALER socket}``, each port waited for in ``store``."""
    import zmq

    sockets = {}
    for index in range(1, world_size):
        try:
            port = int(store.get(f"calls/{index}"))
        except (TimeoutError, RuntimeError) as exc:  # torch.distributed.DistStoreError is a RuntimeError
            raise hal.DistributedTimeoutError(f"rank {index} did not publish its call port within the store's "
                                              f"timeout (it failed or is gone): {exc}") from exc
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{LOOPBACK}:{port}")
        sockets[index] = sock
    return sockets


class TorchrunGroup:
    """A :class:`ckpt.manager.WorkerGroup` on rank 0: worker 0 here, the others serving ranks; a reply may take
    ``timeout + REPLY_MARGIN_S`` seconds."""

    def __init__(self, local: Any, sockets: dict[int, Any], world_size: int, timeout: float,
                 trainers: int = 1) -> None:
        self.local, self.sockets, self.timeout = local, sockets, timeout
        self.trainer_world_size, self.rollout_world_size = trainers, world_size - trainers
        self.seq = [0] * world_size
        self.early: list[dict[int, Reply]] = [{} for _ in range(world_size)]  # replies read before their turn
        self.reading = [asyncio.Lock() for _ in range(world_size)]

    def post(self, index: int, call: Call) -> int:
        """Send ``call`` to serving rank ``index`` now; returns its sequence number."""
        import zmq

        seq = self.seq[index]
        message = frames(seq, call)
        self.seq[index] += 1
        sock = self.sockets[index]
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # stop() after the job's loop ended: no receive is pending on the socket
            zmq.Socket.shadow(sock.underlying).send_multipart(message)
        else:  # through zmq.asyncio (queued at once), so a receive already awaited on this socket is woken
            sock.send_multipart(message)
        return seq

    def _keep(self, index: int, parts: list[bytes]) -> None:
        """File a reply from rank ``index`` under its sequence number (a pickle that does not load fails that call)."""
        seq, reply, why = unframe(parts)
        if why is not None:
            reply = Reply(False, error=f"the reply does not load on rank 0: {why}")
        self.early[index][seq] = reply

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any):
        """Start ``method`` on worker ``index``: posted now, awaited by the returned coroutine."""
        if index == 0:
            return self.local.invoke(method, *args, **kwargs)
        method_class(method)  # a string or a lambda is refused here, not posted
        return self.reply(index, self.post(index, Call(method, args, kwargs)), method.__qualname__)

    async def reply(self, index: int, seq: int, method: str) -> Any:
        """The reply to call ``seq`` of rank ``index``; RemoteCallError when it raised there, TimeoutError when late."""
        limit = self.timeout + REPLY_MARGIN_S
        deadline = time.monotonic() + limit
        async with self.reading[index]:
            while seq not in self.early[index]:
                try:
                    parts = await asyncio.wait_for(self.sockets[index].recv_multipart(),
                                                   max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{method} on rank {index}: no reply within {limit:g} s") from None
                self._keep(index, parts)
            reply = self.early[index].pop(seq)
        if not reply.ok:
            raise RemoteCallError(reply.error)
        return reply.value

    def stop(self, wait: bool) -> None:
        """Tell every serving rank to return; ``wait``: until each said so (TimeoutError past the timeout)."""
        import zmq

        stops = {index: self.post(index, Call(None)) for index in self.sockets}
        deadline = time.monotonic() + self.timeout
        for index, seq in stops.items() if wait else ():
            sock = zmq.Socket.shadow(self.sockets[index].underlying)
            while seq not in self.early[index]:
                if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    raise TimeoutError(f"the serving ranks did not stop within {self.timeout:g} s")
                self._keep(index, sock.recv_multipart())

    def describe(self, index: int) -> str:
        return f"{describe_worker(index, None, self.trainer_world_size)} (rank {index})"

    def is_dead(self, error: BaseException) -> bool:
        return False  # a dead rank ends the run through the elastic agent, which names it

    def explain(self, error: BaseException) -> str:
        return str(error) if isinstance(error, RemoteCallError) else f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        raise NotImplementedError("the torchrun launcher does not restart a rank (max_restarts=0)")


def serve(worker: Any, sock: Any, rank: int, timeout: float) -> None:
    """A serving rank's loop: run each call from rank 0 in order until the stop; DistributedTimeoutError when
    none comes within ``timeout`` seconds."""
    import zmq

    def answer(seq: int, reply: Reply, method: Callable | None = None) -> None:
        try:
            message = frames(seq, reply)
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle is the call's failure
            name = getattr(method, "__qualname__", method)
            message = frames(seq, Reply(False, error=f"the result of {name} on rank {rank} does not pickle: "
                                                     f"{type(exc).__name__}: {exc}"))
        try:
            sock.send_multipart(message)
        except zmq.Again:
            raise hal.DistributedTimeoutError(f"rank {rank}: could not answer rank 0 within {timeout:g} s (rank 0 "
                                              "is gone)") from None

    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))  # a DEALER whose peer is gone blocks a send for ever
    loop = asyncio.new_event_loop()
    try:
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise hal.DistributedTimeoutError(f"rank {rank}: no call from rank 0 within {timeout:g} s")
            seq, call, why = unframe(sock.recv_multipart())
            if why is not None:
                answer(seq, Reply(False, error=f"the call does not load on rank {rank}: {why}"))
                continue
            if call.method is None:
                answer(seq, Reply(True))
                return
            try:
                reply = Reply(True, loop.run_until_complete(worker.invoke(call.method, *call.args, **call.kwargs)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0, which names this rank
                reply = Reply(False, error=f"{type(exc).__name__}: {exc}")
            answer(seq, reply, call.method)
    finally:
        loop.close()


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
    import zmq
    import zmq.asyncio

    from hal.apps.shutdown import quiet_rank_exit
    from hal.apps.weightsync.worker import Where

    quiet_rank_exit()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hal.bind_local_device(options.device_of(rank))  # LOCAL_RANK's device (--hybrid: the one this rank shares)
    store = job_store(options.timeout)
    # the call channel before the namespace: its socket and ZeroMQ's I/O thread keep the host's loopback
    context = zmq.asyncio.Context() if rank == 0 else zmq.Context()  # rank 0 awaits replies in its event loop
    try:
        if rank == 0:
            sockets = connect_calls(context, store, world_size)
        else:
            sock = bind_calls(context, store, rank)
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
        group = TorchrunGroup(trainer, sockets, world_size, options.timeout, options.trainer_ranks)
        try:
            result = asyncio.run(run(options, group, hooks))
        except BaseException:
            group.stop(wait=False)
            raise
        group.stop(wait=True)
        return dataclasses.asdict(result)
    finally:
        context.destroy(linger=1000)


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


__all__ = ["Call", "RemoteCallError", "Reply", "TorchrunGroup", "bind_calls", "connect_calls", "frames", "job_store",
           "launch", "link_endpoint", "rank_main", "role", "serve", "trainer_rank", "unframe"]
