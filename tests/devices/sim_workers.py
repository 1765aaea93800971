"""Rank functions of the npu-sim multi-process tests (module level, so spawned processes can import them).

Results go back as plain lists: tensors would travel through shared-memory handles that die with the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import hal


def store_group_collectives(rank: int, world_size: int) -> dict:
    """hccl through ``hal.new_group_from_store``: broadcast, all_reduce and barrier of npu tensors."""
    hal.set_device("npu-sim")  # one device per rank, or the communicator refuses the pair
    store = hal.launcher_store(timeout=30)
    group = hal.new_group_from_store(store, rank, world_size, device="npu-sim", timeout=30)
    src = torch.arange(6, dtype=torch.float32, device="npu").reshape(2, 3) * 1.5 if rank == 0 else \
        torch.zeros(2, 3, device="npu")
    group.broadcast(src, 0)
    summed = torch.full((5,), float(rank + 1), dtype=torch.float64, device="npu")
    group.all_reduce(summed)
    group.barrier()
    group.close()
    return {"broadcast": src.cpu().tolist(), "all_reduce": summed.cpu().tolist(), "device": str(summed.device)}


def default_group_collectives(rank: int, world_size: int) -> dict:
    """hccl as the default group: all_gather, reduce_scatter, all_reduce (AVG), all_to_all and a DDP backward."""
    backend = hal.init_process_group("npu-sim", timeout=30)
    device = hal.get_device("npu-sim")
    gathered = torch.empty(world_size * 3, device=device)
    dist.all_gather_single(gathered, torch.full((3,), float(rank), device=device))
    scattered = torch.empty(2, device=device)
    dist.reduce_scatter_single(scattered, torch.arange(2.0 * world_size, device=device) * (rank + 1))
    averaged = torch.full((2,), float(rank), device=device)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    exchanged = torch.empty(2 * world_size, device=device)  # rank r sends its chunk s (2 values) to rank s
    dist.all_to_all_single(exchanged, torch.arange(2.0 * world_size, device=device) + 10 * rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.full((4, 3), float(rank), device=device)).sum().backward()
    out = {"backend": backend, "backend_of_group": dist.get_backend(), "device": str(device),
           "gathered": gathered.cpu().tolist(), "scattered": scattered.cpu().tolist(), "averaged": averaged.cpu().tolist(),
           "exchanged": exchanged.cpu().tolist(),
           "grad": model.weight.grad.cpu().tolist()}
    dist.destroy_process_group()
    return out


def twin_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(reference, model)``: two equal small MLPs on the host (seed 0), one to shard, one to compare with."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(reference.state_dict())
    return reference, model


def train_side_by_side(model, reference, rank: int, world_size: int, steps: int, device) -> None:
    """``steps`` AdamW steps of the sharded ``model`` on this rank's part of each batch and of the unsharded
    ``reference`` on the whole batch (same seeds: equal results up to the reduction order)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = torch.randn(steps, 2 * world_size, 8)
    for batch in batches:
        model(batch[2 * rank:2 * rank + 2].to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        reference(batch).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()


def fsdp2_training(rank: int, world_size: int, steps: int) -> dict:
    """FSDP2 (``fully_shard``) on an npu device mesh over hccl vs the same model unsharded on cpu."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hal.init_process_group("npu-sim", timeout=30)
    device = hal.get_device("npu-sim")
    reference, model = twin_models()
    mesh = init_device_mesh("npu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train_side_by_side(model, reference, rank, world_size, steps, device)
    local_device = str(next(iter(model.parameters())).to_local().device)
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    dist.destroy_process_group()
    return {"max_abs_diff": diff, "local_device": local_device}


def fsdp1_training(rank: int, world_size: int, steps: int) -> dict:
    """FSDP1 (``FullyShardedDataParallel``, which frees its flat parameter's storage with ``resize_(0)`` and
    re-points it with ``set_``) on npu over hccl vs the same model unsharded on cpu."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    hal.init_process_group("npu-sim", timeout=30)
    device = hal.get_device("npu-sim")
    reference, model = twin_models()
    model = FullyShardedDataParallel(model, device_id=device, use_orig_params=True)
    sharded_numel = sum(p.numel() for p in model.parameters())
    train_side_by_side(model, reference, rank, world_size, steps, device)
    with FullyShardedDataParallel.summon_full_params(model):
        full = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    dist.destroy_process_group()
    return {"max_abs_diff": diff, "sharded_numel": sharded_numel,
            "total_numel": sum(v.numel() for v in reference.parameters())}


def missing_peer(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 1 never joins the all_reduce: rank 0 must get a DistributedTimeoutError after about timeout_s."""
    import time

    store = hal.launcher_store(timeout=30)
    group = hal.new_group_from_store(store, rank, world_size, device="npu-sim", timeout=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 4)
        return {}
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4, device="npu"))
    except hal.DistributedTimeoutError as exc:
        return {"error": type(exc).__name__, "elapsed": time.monotonic() - start, "text": str(exc)}
    return {"error": None, "elapsed": time.monotonic() - start}
