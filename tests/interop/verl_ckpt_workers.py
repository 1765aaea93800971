"""Process bodies of the verl interop tests: verl 0.9.1's own worker classes drive hal's engines.

One process per worker, as under Ray. Rank 0 is the trainer: verl's ``ActorRolloutRefWorker`` (its real
``update_weights``; the instance is assembled with the attributes ``init_model`` sets, since building the
HF model and FSDP engine of ``init_model`` is out of reach here: its trainer engine is a hal ``TorchEngine``).
Ranks 1..R are rollouts: verl's ``CheckpointEngineWorker``, built by its real ``__init__`` (its registry
lookup through ``custom_backend_module``, its default process group) with hal's ``InMemoryRolloutAdapter``
as the server adapter. In one process (:func:`manager_colocated`) verl's real ``CheckpointEngineManager``
runs the updates, Ray replaced where it reaches it. Across processes rank 0 plays the manager: per update it gathers
every worker's ``prepare()`` (through a store, where the manager uses ``ray.get``), calls
``build_topology`` on the class the registry returns, hands each rank its entries for
``execute_checkpoint_engine("init_process_group", ...)``, runs the updates concurrently, then finalize.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import types

import torch

BUCKET_MB = 1


def weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step`` (seeded by it): fp32, bf16 and int64 tensors, one above a 1 MiB bucket."""
    g = torch.Generator().manual_seed(100 + step)
    return {"embed.weight": torch.randn(64, 32, generator=g), "layer.0.weight": torch.randn(32, 32, generator=g),
            "layer.0.bias": torch.randn(32, generator=g).to(torch.bfloat16),
            "big.weight": torch.randn(600, 512, generator=g),  # 1.2 MB: larger than the 1 MiB bucket
            "step": torch.tensor([step], dtype=torch.int64)}


def _module(step: int) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, t in weights(step).items():
        parent = module
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_buffer(leaf, t.clone())
    return module


def _configs(backend: str, device: str):
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    engine_kwargs = {"hal-collective": {"device": device, "timeout": 60}, "hal-colocated": {"channel": "interop",
                                                                                             "timeout": 60}}
    ce = CheckpointEngineConfig(backend=backend, custom_backend_module="ckpt.verl_plugin",
                                update_weights_bucket_megabytes=BUCKET_MB, engine_kwargs=engine_kwargs)
    return ce, RolloutConfig(name="hal-interop", checkpoint_engine=ce)


def _trainer(backend: str, device: str, is_master: bool):
    """verl's ActorRolloutRefWorker with what init_model sets for the actor role (step 4 verbatim)."""
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from engines.torch_engine import TorchEngine

    ce, _ = _configs(backend, device)
    worker = object.__new__(ActorRolloutRefWorker)
    worker.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": backend}}})
    worker.actor = types.SimpleNamespace(engine=TorchEngine(_module(0), None, device=device))
    import_external_libs(ce.custom_backend_module or None)
    worker.checkpoint_engine = CheckpointEngineRegistry.new(
        backend, is_master=is_master, bucket_size=ce.update_weights_bucket_megabytes << 20,
        **ce.engine_kwargs.get(backend, {}))
    return worker


def _rollout(backend: str, device: str, expected: dict[str, torch.Tensor]):
    """verl's CheckpointEngineWorker built by its own __init__, hal's adapter as the server adapter."""
    import ckpt
    from verl.checkpoint_engine import CheckpointEngineWorker

    _, rollout_config = _configs(backend, device)
    return CheckpointEngineWorker(rollout_config, None, ckpt.InMemoryRolloutAdapter(expected))


def _set_weights(trainer, step: int) -> None:
    for name, t in weights(step).items():
        trainer.actor.engine.module.get_buffer(name).copy_(t)


def _exchange(store, key: str, rank: int, world: int, value):
    store.set(f"{key}/{rank}", pickle.dumps(value))
    return [pickle.loads(store.get(f"{key}/{r}")) for r in range(world)]


def collective(rank: int, world_size: int, device: str, updates: int, mismatch_at: int | None):
    """1 trainer (rank 0) + ``world_size - 1`` rollouts over hal-collective; returns per-update reports."""
    import ckpt
    import hal
    from ckpt import checker
    from ckpt.testing import same_bytes
    from tests.ports import pick_port

    store = hal.launcher_store(timeout=60)
    if rank > 0:  # each rollout worker is its own replica: a one-process default group (hosting its own store), as under Ray
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_PORT=str(pick_port()))
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")
    backend = "hal-collective"
    import ckpt.collective as collective_module

    formed = []
    real_new_group = collective_module.hal.new_group_from_store

    def counting(*args, **kwargs):
        formed.append(args[2] if len(args) > 2 else kwargs.get("world_size"))
        return real_new_group(*args, **kwargs)
    collective_module.hal.new_group_from_store = counting
    worker = _trainer(backend, device, True) if rank == 0 else _rollout(backend, device, weights(0))
    engine = worker.checkpoint_engine

    def lifecycle(update: int):
        metadata = _exchange(store, f"prepare/{update}", rank, world_size, engine.prepare())
        if rank == 0:
            from verl.checkpoint_engine import CheckpointEngineRegistry

            backend_cls = CheckpointEngineRegistry.get(backend)
            trainer_kwargs, rollout_kwargs = backend_cls.build_topology(1, world_size - 1, metadata)
            per_rank = [{k: v[0] for k, v in trainer_kwargs.items()}] + [
                {k: v[i] for k, v in rollout_kwargs.items()} for i in range(world_size - 1)]
            store.set(f"topology/{update}", pickle.dumps(per_rank))
        kwargs = pickle.loads(store.get(f"topology/{update}"))[rank]
        if rank == 0:
            engine.init_process_group(**kwargs)  # the trainer's execute_checkpoint_engine is the same call
        else:
            worker.execute_checkpoint_engine("init_process_group", **kwargs)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    reports = []
    for update in range(1, updates + 1):
        lifecycle(update)
        step = update
        asked = step + 100 if update == mismatch_at and rank == world_size - 1 else step
        error = None
        if rank == 0:
            _set_weights(worker, step)
            asyncio.run(worker.update_weights(global_steps=step, mode=backend))
        else:
            try:
                asyncio.run(worker.update_weights(global_steps=asked))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                error = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            engine.finalize()
        else:
            worker.execute_checkpoint_engine("finalize")
        report = {"update": update, "fds": fds(), "groups": len(formed), "error": error}
        # the weight checker as a verl rollout worker calls it: the trainer's digests against its live tensors
        published = _exchange(store, f"digests/{update}", rank, world_size,
                              checker.digests(weights(step).items()) if rank == 0 else None)[0]
        if rank > 0:
            adapter = worker.server_adapter
            served = adapter.state_dict()
            try:
                checker.check(published, checker.served_digests(published, served), f"rollout rank {rank}")
                report["check"] = None
            except ckpt.WeightCheckError as exc:
                report["check"] = str(exc)
            report.update(served_step=adapter.served_step,
                          exact=sum(same_bytes(served[n], t) for n, t in weights(adapter.served_step or 0).items()),
                          devices=sorted({t.device.type for t in served.values()}))
        reports.append(report)
        _exchange(store, f"done/{update}", rank, world_size, True)
    return reports  # the harness hosts the store until every rank has ended: none waits for the others to leave


def colocated(rank: int, world_size: int, device: str, updates: int):
    """1 trainer + 2 rollouts in one process over hal-colocated (a named channel); the manager's sequence."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from ckpt.testing import same_bytes

    backend = "hal-colocated"
    trainer = _trainer(backend, device, True)
    rollouts = [_rollout(backend, device, weights(0)) for _ in range(2)]
    engines = [trainer.checkpoint_engine] + [w.checkpoint_engine for w in rollouts]
    reports = []
    for step in range(1, updates + 1):
        metadata = [e.prepare() for e in engines]
        tkw, rkw = CheckpointEngineRegistry.get(backend).build_topology(1, 2, metadata)
        trainer.checkpoint_engine.init_process_group(**{k: v[0] for k, v in tkw.items()})
        for i, w in enumerate(rollouts):
            w.execute_checkpoint_engine("init_process_group", **{k: v[i] for k, v in rkw.items()})
        _set_weights(trainer, step)
        asked = [step, step + 100 if step == 2 else step]

        async def update(step: int, asked: list[int]):
            return await asyncio.gather(trainer.update_weights(global_steps=step, mode=backend),
                                        *(w.update_weights(global_steps=a) for w, a in zip(rollouts, asked)),
                                        return_exceptions=True)
        results = asyncio.run(update(step, asked))
        for e in engines:
            e.finalize()
        reports.append({"update": step, "errors": [type(r).__name__ if isinstance(r, BaseException) else None
                                                   for r in results],
                        "served": [w.server_adapter.served_step for w in rollouts],
                        "exact": [sum(same_bytes(w.server_adapter.state_dict()[n], t)
                                      for n, t in weights(w.server_adapter.served_step or 0).items())
                                  for w in rollouts],
                        "same_engine": all(e is engines[0] for e in engines)})
    return reports


class _Group:
    """Stands in for a ``RayWorkerGroup`` of in-process workers: ``execute_checkpoint_engine`` dispatches
    per rank as DP_COMPUTE does (the i-th entry of every list to worker i); ``update_weights`` returns one
    coroutine per worker, which the patched ``ray.get`` runs concurrently."""

    def __init__(self, workers, mode=None):
        self.workers, self.world_size, self.mode = list(workers), len(workers), mode

    def execute_checkpoint_engine(self, method, **kwargs):
        return [w.execute_checkpoint_engine(method[i], **{k: v[i] for k, v in kwargs.items()})
                if hasattr(w, "execute_checkpoint_engine")
                else getattr(w.checkpoint_engine, method[i])(**{k: v[i] for k, v in kwargs.items()})
                for i, w in enumerate(self.workers)]

    def update_weights(self, **kwargs):
        return [w.update_weights(**kwargs) for w in self.workers]


class Replica:
    """A rollout replica as verl's CheckpointEngineManager drives it, minus the server: the pause/resume calls
    around an update are no-ops; ``workers`` are the replica's CheckpointEngineWorkers."""

    def __init__(self, workers):
        self.workers = workers

    async def abort_all_requests(self, reject_request=False):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def resume_generation(self):
        pass


def manager_colocated(rank: int, world_size: int, device: str, updates: int):
    """verl's real ``CheckpointEngineManager.update_weights`` over hal-colocated: 1 trainer + 2 rollouts in
    this process. Ray is replaced where the manager reaches it: ``RayWorkerGroup`` by :class:`_Group`, and
    ``ray.get`` by a function that runs the workers' coroutines concurrently on one event loop."""
    import concurrent.futures

    import verl.checkpoint_engine.base as verl_base
    from verl.checkpoint_engine import CheckpointEngineManager

    from ckpt.testing import same_bytes

    def ray_get(items):
        coros = [i for i in items if asyncio.iscoroutine(i)]
        if not coros:
            return items

        async def gather():
            return await asyncio.gather(*coros)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the manager's own loop is running
            return pool.submit(asyncio.run, gather()).result()

    verl_base.ray.get = ray_get
    verl_base.RayWorkerGroup = lambda worker_handles, ray_cls_with_init: _Group(worker_handles)
    backend = "hal-colocated"
    ce, _ = _configs(backend, device)
    trainer = _trainer(backend, device, True)
    rollouts = [_rollout(backend, device, weights(0)) for _ in range(2)]
    manager = CheckpointEngineManager(ce, _Group([trainer]), [Replica([w]) for w in rollouts])
    reports = []
    for step in range(1, updates + 1):
        _set_weights(trainer, step)
        manager.update_weights(global_steps=step)
        reports.append({"update": step, "served": [w.server_adapter.served_step for w in rollouts],
                        "exact": [sum(same_bytes(w.server_adapter.state_dict()[n], t)
                                      for n, t in weights(w.server_adapter.served_step or 0).items())
                                  for w in rollouts]})
    return reports


def colocated_then_manager(rank: int, world_size: int, device: str, updates: int) -> dict:
    """:func:`colocated`, then :func:`manager_colocated`, in one process (one import of verl for both):
    ``{"colocated": its reports, "manager": its reports}``."""
    return {"colocated": colocated(rank, world_size, device, updates),
            "manager": manager_colocated(rank, world_size, device, updates)}
