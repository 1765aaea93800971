"""Process body of the verl multi-sender interop test: verl 0.9.1's own ``CheckpointEngineManager`` drives
hal-collective with ``multi_sender=True`` (through verl's ``engine_kwargs``), 2 trainer ranks and 2 rollouts.

All four workers live in this one process, as in ``verl_ckpt_workers.manager_colocated``; Ray is replaced where
the manager reaches it: ``RayWorkerGroup`` by :class:`Group`, whose ``execute_checkpoint_engine`` runs every
worker's call in its own thread (as every Ray actor runs its own, so the blocking ``init_process_group`` joins
meet), and ``ray.get``, which waits for those threads or runs the workers' coroutines concurrently. The trainer
ranks are verl's ``ActorRolloutRefWorker`` (its real ``update_weights``) over an engine whose
``get_per_tensor_param`` yields that rank's FSDP2 dim-0 rows (:class:`ckpt.RowShard`) and the whole tensors it
owns; the rollouts are verl's ``CheckpointEngineWorker`` (its real ``__init__``: registry lookup through
``custom_backend_module``) with hal's ``InMemoryRolloutAdapter``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import types

import torch

from tests.interop.verl_ckpt_workers import Replica

BUCKET_MB = 1
TRAINERS = 2


def weights(step: int) -> dict[str, torch.Tensor]:
    """Full tensors at ``step``: odd rows, fewer rows than senders, a part larger than the 1 MiB bucket, and a
    1-d and a 0-d tensor owned whole by one trainer rank."""
    g = torch.Generator().manual_seed(900 + step)
    return {"embed.weight": torch.randn(65, 32, generator=g), "layer.0.bias": torch.randn(1, 3, generator=g),
            "big.weight": torch.randn(1201, 512, generator=g),  # rank 0's 601 rows: 1.2 MB > 1 MiB
            "norm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
            "step": torch.tensor(step, dtype=torch.int64)}


OWNER = {"norm.weight": 1, "step": 0}


class ShardedEngine:
    """A trainer engine's ``get_per_tensor_param`` (verl's return shape) for FSDP2 rank ``rank`` of ``world``."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.step = rank, world, 0

    def get_per_tensor_param(self):
        import ckpt

        def parts():
            for name, full in weights(self.step).items():
                if name in OWNER:
                    if OWNER[name] == self.rank:
                        yield name, full
                    continue
                a, b = ckpt.dim0_rows(full.shape[0], self.world, self.rank)
                yield name, ckpt.RowShard(full[a:b].clone(), a, tuple(full.shape))
        return parts(), None


def configs(device: str):
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    engine_kwargs = {"hal-collective": {"device": device, "timeout": 60, "multi_sender": True}}
    ce = CheckpointEngineConfig(backend="hal-collective", custom_backend_module="ckpt.verl_plugin",
                                update_weights_bucket_megabytes=BUCKET_MB, engine_kwargs=engine_kwargs)
    return ce, RolloutConfig(name="hal-interop", checkpoint_engine=ce)


def own_device(device: str, worker: int) -> str:
    """Worker ``worker``'s device: on an accelerator kind its own index (one process here, and HCCL / NCCL
    refuse two ranks of one communicator on one device), the host kind as is."""
    return device if device == "cpu" else f"{device}:{worker}"


def trainer(device: str, rank: int):
    """verl's ActorRolloutRefWorker with what init_model sets for the actor role."""
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.engine_workers import ActorRolloutRefWorker

    ce, _ = configs(own_device(device, rank))
    worker = object.__new__(ActorRolloutRefWorker)
    worker.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": ce.backend}}})
    worker.actor = types.SimpleNamespace(engine=ShardedEngine(rank, TRAINERS))
    import_external_libs(ce.custom_backend_module)
    worker.checkpoint_engine = CheckpointEngineRegistry.new(
        ce.backend, is_master=rank == 0, bucket_size=ce.update_weights_bucket_megabytes << 20,
        **ce.engine_kwargs[ce.backend])
    return worker


class Group:
    """Stands in for a ``RayWorkerGroup``: ``execute_checkpoint_engine`` dispatches per rank as DP_COMPUTE does
    (the i-th entry of every list to worker i), each call in its own thread (a future); ``update_weights``
    returns one coroutine per worker."""

    pool = concurrent.futures.ThreadPoolExecutor(8)

    def __init__(self, workers) -> None:
        self.workers, self.world_size = list(workers), len(workers)

    def execute_checkpoint_engine(self, method, **kwargs):
        def call(i, w):
            return getattr(w.checkpoint_engine, method[i])(**{k: v[i] for k, v in kwargs.items()})
        return [self.pool.submit(call, i, w) for i, w in enumerate(self.workers)]

    def update_weights(self, **kwargs):
        return [w.update_weights(**kwargs) for w in self.workers]


def ray_get(items):
    """``ray.get`` for :class:`Group`'s futures (at most 120 s each) and coroutines (run concurrently on a
    fresh loop in a thread: the manager's own loop is running)."""
    if any(isinstance(i, concurrent.futures.Future) for i in items):
        return [i.result(timeout=120) for i in items]
    coros = [i for i in items if asyncio.iscoroutine(i)]
    if not coros:
        return items

    async def gather():
        return await asyncio.gather(*coros)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result(timeout=120)


def manager_multi_sender(rank: int, world_size: int, device: str, updates: int):
    """verl's real ``CheckpointEngineManager.update_weights`` over hal-collective with ``multi_sender``; per
    update: the topology each worker got and what each rollout serves (step, byte-exact tensors)."""
    import verl.checkpoint_engine.base as verl_base
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker

    import ckpt
    from ckpt.testing import same_bytes

    verl_base.ray.get = ray_get
    verl_base.RayWorkerGroup = lambda worker_handles, ray_cls_with_init: Group(worker_handles)
    ce, _ = configs(device)
    trainers = [trainer(device, r) for r in range(TRAINERS)]
    rollouts = [CheckpointEngineWorker(configs(own_device(device, TRAINERS + i))[1], None,
                                       ckpt.InMemoryRolloutAdapter(weights(0))) for i in range(2)]
    manager = CheckpointEngineManager(ce, Group(trainers), [Replica([w]) for w in rollouts])
    reports = []
    for step in range(1, updates + 1):
        for t in trainers:
            t.actor.engine.step = step
        manager.update_weights(global_steps=step)
        reports.append({
            "update": step,
            "topology": [w.checkpoint_engine.topology for w in trainers + rollouts],
            "served": [w.server_adapter.served_step for w in rollouts],
            "devices": sorted({t.device.type for w in rollouts for t in w.server_adapter.state_dict().values()}),
            "exact": [sum(same_bytes(w.server_adapter.state_dict()[n].cpu(), t) for n, t in weights(step).items())
                      for w in rollouts]})
    for w in trainers + rollouts:
        w.checkpoint_engine.close()
    return reports
