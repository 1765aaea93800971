"""Rank functions of the device-binding tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import asyncio
import os

import torch

import hal
from ckpt.testing import standalone_engine


def sync_ranks_devices(rank: int, world_size: int, explicit: str | None) -> dict:
    """One trainer (rank 0) and rollouts over the collective engine on npu-sim, as ``hal sync`` runs them.

    Each rank binds through hal, builds what ``hal sync`` builds (the trainer a TorchEngine, every rank a
    collective checkpoint engine) and reports where each lives and which device holds its bytes.
    ``explicit``: a device string every rank passes instead of the kind (the shared-device bug).
    """
    from engines import TorchEngine

    device = explicit or "npu-sim"
    out: dict = {"bound": str(hal.set_device(device))}
    if rank == 0:
        model = torch.nn.Linear(16, 8)
        trainer = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device)
        out["trainer"] = str(trainer.torch_device)
    engine = standalone_engine("collective", rank, world_size, hal.launcher_store(timeout=60), bucket_size=1 << 16,
                               device=device, timeout=30)
    weights = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1)]

    async def main():
        if rank == 0:
            await engine.send_weights(iter([(n, t.to(out["trainer"])) for n, t in weights]), 1)
            return None
        return [(n, t.cpu().tolist(), str(t.device)) async for n, t in engine.receive_weights(1)]

    try:
        out["received"] = asyncio.run(main())
        out["buffers"] = str(engine.device)
        npu = hal.get_torch_device("npu-sim")
        out["allocated"] = [npu.memory_allocated(i) for i in range(world_size)]
    except Exception as exc:  # noqa: BLE001 - the refusal is the result under test
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.finalize()
    out["local_rank"] = os.environ["LOCAL_RANK"]
    return out


def shared_device_group(rank: int, world_size: int, visible: list[str] | None) -> str:
    """A hccl group where no rank binds a device (all on npu:0); ``visible``: per-rank
    ASCEND_RT_VISIBLE_DEVICES, so local index 0 is another physical device on each rank."""
    if visible is not None:
        os.environ["ASCEND_RT_VISIBLE_DEVICES"] = visible[rank]
    store = hal.launcher_store(timeout=30)
    group = hal.new_group_from_store(store, rank, world_size, device="npu-sim", timeout=30)
    t = torch.full((2,), float(rank + 1), device="npu:0")
    try:
        group.all_reduce(t)
        return f"ok {t.cpu().tolist()}"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result under test
        return f"{type(exc).__name__}: {exc}"
    finally:
        group.close()


def shared_device_full_tensor(rank: int, world_size: int) -> str:
    """The default hccl group with every rank on npu:0, whose first collective is one C++ starts: the
    all-gather of ``DTensor.full_tensor()`` (a functional collective, not a ``torch.distributed`` call)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    hal.get_torch_device("npu-sim")  # registers the sim's hccl; no device bound: every rank is on npu:0
    dist.init_process_group(hal.get_dist_backend("npu-sim"), init_method="env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("npu", (world_size,))
        local = distribute_tensor(torch.ones(world_size, 2, device="npu:0"), mesh, [Shard(0)], src_data_rank=None)
        return f"ok {local.full_tensor().cpu().tolist()}"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result under test
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


def unbound_rank_devices(rank: int, world_size: int) -> dict:
    """A launched rank (LOCAL_RANK set, as ``hal launch`` sets it) that binds nothing: where ``hal`` says its
    device is, where a TorchEngine puts the model, and a forward on an input made on ``hal.get_device()``."""
    from engines import TorchEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    expected = model(torch.arange(8, dtype=torch.float32).reshape(2, 4)).detach()
    engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.arange(8, dtype=torch.float32, device=hal.get_device()).reshape(2, 4)
    out = engine.module(x)
    return {"local_rank": os.environ["LOCAL_RANK"], "get_device": str(hal.get_device()),
            "get_device_id": hal.get_device_id(),
            "engine": str(engine.torch_device), "params": sorted({str(p.device) for p in model.parameters()}),
            "out_device": str(out.device), "out_equal": torch.equal(out.detach().cpu(), expected),
            "current": hal.get_torch_device().current_device()}
