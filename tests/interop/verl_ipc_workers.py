"""Rank functions for verl's same-host hand-over against hal's ipc engine: rank 0 the trainer, rank 1 the rollout,
each its own process with the simulated npu registered before verl is imported (so verl sees Ascend, and, at the
sim's reported CANN 8.2, takes its shared-memory path: ``is_support_ipc()`` is false)."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib

import torch

from ckpt.ipc import rollout_endpoint
from tests.ckpt.ipc_workers import digest, engine, meet, segment_exists, trainer_done


def verl_transfer():
    """verl's ``bucketed_weight_transfer`` module, loaded from its file: its package's ``__init__`` imports vLLM
    (absent from this environment), the module itself does not ("Not recommended depending on vllm for this
    file", its docstring). The simulated npu is registered first (hal first, then verl: verl then sees Ascend)."""
    import hal

    hal.resolve_device("npu-sim")
    root = pathlib.Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    path = root / "workers" / "rollout" / "vllm_rollout" / "bucketed_weight_transfer.py"
    spec = importlib.util.spec_from_file_location("verl_bucketed_weight_transfer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(step: int, device: str = "cpu"):
    """Every dtype (verl's sender aligns each by its element size), each under verl's 1 MiB bucket, odd sizes."""
    g = torch.Generator().manual_seed(step)
    out = [("embed.weight", torch.randn(300, 64, generator=g).to(torch.bfloat16)),
           ("norm.weight", torch.randn(7, generator=g)),
           ("layers.0.mlp.weight", torch.randn(33, 17, generator=g).to(torch.float16)),
           ("position_ids", torch.arange(13, dtype=torch.int64) * step),
           ("mask", torch.rand(9, generator=g) > 0.5),
           ("scalar", torch.tensor(float(step))),
           ("lm_head.weight", torch.randn(1000, 200, generator=g))]  # 800 kB: most of a 1 MiB bucket alone
    return [(n, t.to(device)) for n, t in out]


STEPS = (1, 2)


def hal_sends_verl_receives(rank, world_size, bucket_size):
    endpoint, pids = meet(rank, world_size)
    if rank == 0:
        eng = engine(0, 2, endpoint, pids, "npu-sim", bucket_size)
        sent = []
        for step in STEPS:
            update = weights(step, "npu:0")
            asyncio.run(eng.send_weights(update, step))
            sent.append(digest(update))
        name = eng.segment_name
        eng.close()
        trainer_done(rank)
        return {"sent": sent, "transport": eng.transport, "segment_left": segment_exists(name)}
    receiver_cls = verl_transfer().BucketedWeightReceiver
    out = []
    for _ in STEPS:
        got, lasts = [], []

        def on_bucket(items, is_last, got=got, lasts=lasts):
            got.extend((name, t.clone()) for name, t in items)
            lasts.append(is_last)
        receiver_cls(rollout_endpoint(endpoint, 1), torch.device("npu", 1), use_shm=True).receive_weights(on_bucket)
        out.append({"digest": digest(got), "lasts": lasts, "devices": sorted({str(t.device) for _, t in got})})
    trainer_done(rank)
    return out



def verl_sends_hal_receives(rank, world_size):
    endpoint, pids = meet(rank, world_size)
    if rank == 0:
        sender_cls = verl_transfer().BucketedWeightSender
        sent = []
        for step in STEPS:
            update = weights(step, "npu:0")
            sender = sender_cls(rollout_endpoint(endpoint, 1), bucket_size_mb=1, use_shm=True)
            asyncio.run(sender.async_send_weights(iter(update)))
            sent.append(digest(update))
        return {"sent": sent}
    eng = engine(1, 2, endpoint, pids, "npu-sim", 1 << 20)
    out = []

    async def receive():
        return [(n, t.clone()) async for n, t in eng.receive_weights(None)]
    for _ in STEPS:
        got = asyncio.run(receive())
        out.append({"digest": digest(got), "step": eng.received_global_steps,
                    "devices": sorted({str(t.device) for _, t in got})})
    eng.close()
    return out

