"""Rank functions of the resharding tests (tests/ckpt/test_reshard.py): trainer ranks holding dim-0 rows, rollout
ranks keeping tensor-parallel slices (a vocabulary split, q/k/v fused into one target, column splits)."""

from __future__ import annotations

import asyncio
import os
import sys

import torch

import ckpt
import hal
from ckpt.reshard import Region, RolloutLayout, Slice, chunk_range
from tests.ckpt.mp_workers import lifecycle

BUCKET = 64 << 10  # "big" spans several buckets per pair


def full_weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4700 + step)
    return {"embed": torch.randn(11, 6, generator=g), "q": torch.randn(8, 6, generator=g),
            "k": torch.randn(4, 6, generator=g), "v": torch.randn(4, 6, generator=g),
            "o": torch.randn(6, 8, generator=g), "norm": torch.randn(6, generator=g).to(torch.bfloat16),
            "big": torch.randn(301, 512, generator=g), "empty": torch.zeros(0, 4),
            "step": torch.tensor(step, dtype=torch.int64)}


WHOLE = ("norm", "step")  # published whole by trainer rank 0


def layout(rank: int, tp: int, q_rows: int = 8) -> RolloutLayout:
    """Tensor-parallel rank ``rank`` of ``tp``: embed rows, q/k/v rows fused into "qkv", o and big columns
    (``q_rows`` other than 8: a rollout built for another head count)."""
    shapes = {n: tuple(t.shape) for n, t in full_weights(0).items()}
    shapes["q"] = (q_rows, 6)
    slices = []

    def rows(name: str, target: str, at_row: int, target_rows: int) -> int:
        full = shapes[name]
        a, b = chunk_range(full[0], tp, rank)
        slices.append(Slice(name, full, Region((a, 0), (b - a, full[1])), target, (target_rows, full[1]),
                            (at_row, 0), torch.float32))
        return b - a

    def cols(name: str) -> None:
        full = shapes[name]
        a, b = chunk_range(full[1], tp, rank)
        slices.append(Slice(name, full, Region((0, a), (full[0], b - a)), name, (full[0], b - a), (0, 0),
                            torch.float32))

    emb = chunk_range(11, tp, rank)
    rows("embed", "embed", 0, emb[1] - emb[0])
    per = [chunk_range(shapes[n][0], tp, rank) for n in "qkv"]
    at = 0
    for name in "qkv":
        at += rows(name, "qkv", at, sum(b - a for a, b in per))
    cols("o")
    cols("big")
    for name in ("norm", "empty", "step"):
        full = shapes[name]
        dtype = full_weights(0)[name].dtype
        slices.append(Slice(name, full, Region.whole(full), name, full, (0,) * len(full), dtype))
    return RolloutLayout(slices)


def expected(step: int, lay: RolloutLayout) -> dict[str, torch.Tensor]:
    full = full_weights(step)
    out = {t: torch.zeros(shape, dtype=dtype) for t, (shape, dtype) in lay.targets.items()}
    for s in lay.slices:
        out[s.target][s.dest.index()] = full[s.name][s.region.index()]
    return out


def sender_parts(step: int, sender: int, senders: int, device: torch.device) -> list:
    out = []
    for name, full in full_weights(step).items():
        if name in WHOLE:
            if sender == 0:
                out.append((name, full.to(device)))
            continue
        a, b = ckpt.dim0_rows(full.shape[0], senders, sender)
        out.append((name, ckpt.RowShard(full[a:b].clone().to(device), a, tuple(full.shape))))
    return out


class FlatModule(torch.nn.Module):
    """Buffers named as given: a model made of the checkpoint's tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for n, t in tensors.items():
            self.register_buffer(n, t.clone())


def resharded(rank, world_size, device, trainers, updates, kill=None, whole=(), bad=None, agree=False,
              engine_name="collective"):
    """``trainers`` senders and ``world_size - trainers`` rollout ranks (TP ranks of one layout; rollout
    ranks in ``whole`` keep the whole model, no layout; ``bad=(update, rank)``: that rank declares a layout
    for 16 q rows in that update; ``agree``: the rollout ranks are one tensor-parallel server, applying an update only
    if all received it). The first rollout serves through an atomic
    ModelRolloutAdapter (received in place), the others through InMemoryRolloutAdapter. ``kill=(update,
    rank)``: that rank exits in that update (a rollout after its plan exchange, a trainer mid-send).
    Per update: ``error``, and on a rollout ``served_step``, ``exact`` (tensors equal to the step's slices),
    ``total``, ``buffer_bytes``; rank 0 also reports the model's bytes."""
    dev = hal.get_device(device)
    rollouts = world_size - trainers
    store = hal.launcher_store(timeout=60)
    index = rank - trainers
    lay = None
    if rank >= trainers and index not in whole:
        lay = layout(index, rollouts)
    kwargs = {"master_addr": "127.0.0.1"} if engine_name == "collective" else {}
    engine = ckpt.get_checkpoint_engine(engine_name, is_master=rank == 0, device=device, timeout=8 if kill else 30,
                                        bucket_size=BUCKET, multi_sender=True, rollout_layout=lay, **kwargs)
    if rank >= trainers:
        start = {n: t.to(dev) for n, t in expected(0, lay).items()} if lay else \
            {n: t.to(dev) for n, t in full_weights(0).items()}
        agreement = {}
        if agree:
            import torch.distributed as dist

            from hal.apps.weightsync.tp import agreement as tp_agreement

            hal.init_process_group(device, store=dist.PrefixStore("tp", store), rank=index, world_size=rollouts,
                                   timeout=8)
            agreement = {"agree": tp_agreement(dev)}
        if index == 0 or agree:
            model = ckpt.ModelRolloutAdapter(FlatModule(start), atomic=True, **agreement)
        else:
            model = ckpt.InMemoryRolloutAdapter(start)
        worker = ckpt.CheckpointEngineWorker(engine, model)
    reports = []
    for update in range(1, updates + 1):
        if bad is not None and rank == bad[1]:
            engine.rollout_layout = layout(index, rollouts, 16) if update == bad[0] else lay
        kwargs = lifecycle(engine, store, f"u{update}", rank, trainers, rollouts)
        error = None
        try:
            if rank < trainers:
                parts = sender_parts(update, rank, trainers, dev)
                if kill == (update, rank):
                    os._exit(0)
                asyncio.run(engine.send_weights(parts if update % 2 else iter(parts), update))
            else:
                if kill == (update, rank):
                    sys.stdout.flush()
                    os._exit(0)
                asyncio.run(worker.update_weights(update))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        report = {"update": update, "error": error, "kwargs_keys": sorted(kwargs)}
        if rank >= trainers:
            served = model.state_dict() if isinstance(model, ckpt.InMemoryRolloutAdapter) else \
                dict(model.module.named_buffers())
            step = model.served_step
            want = expected(step or 0, lay) if lay else full_weights(step or 0)
            report.update(served_step=step, total=len(want), buffer_bytes=getattr(engine, "buffer_bytes", None),
                          exact=sum(torch.equal(served[n].cpu(), t) for n, t in want.items()),
                          devices=sorted({t.device.type for t in served.values()}),
                          received=lay.nbytes if lay else None)
        if rank == 0:
            report["model_bytes"] = sum(t.numel() * t.element_size() for t in full_weights(0).values())
        engine.finalize()
        reports.append(report)
        store.set(f"done/{update}/{rank}", b"1")
        survivors = [r for r in range(world_size) if not (kill and kill[0] <= update and r == kill[1])]
        store.wait([f"done/{update}/{r}" for r in survivors])
    engine.close()
    store.set(f"left/{rank}", b"1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size) if not (kill and r == kill[1])])
    return reports


def shared_pairs(rank, world_size, device, trainers, token, updates=2):
    """The resharding protocol over :class:`ckpt.reshard.shared.SharedChannel` (one host, the device kind's IPC
    transport): ``trainers`` senders, the rest tensor-parallel ranks of one layout. Returns per update the rank's
    error and, on a rollout, how many of its targets equal the step's slices and the slots' bytes held."""
    import pickle

    from ckpt.reshard import held_parts
    from ckpt.reshard.shared import SharedChannel
    from ckpt.reshard.transfer import receive_update, send_update

    dev = hal.get_device(device)
    spec = hal.resolve_device(device)
    store = hal.launcher_store(timeout=60)
    store.set(f"pid/{rank}", str(os.getpid()))
    pids = {r: int(store.get(f"pid/{r}")) for r in range(world_size)}
    endpoints = {r: f"ipc://@hal-test-{token}-{r}" for r in range(world_size)}
    channel = SharedChannel(rank, endpoints, dev, spec, spec.ipc_transport(), 30.0, pids)
    rollouts = world_size - trainers
    layouts = {trainers + i: layout(i, rollouts) for i in range(rollouts)}
    reports = []
    for update in range(1, updates + 1):
        error, exact = None, None
        try:
            if rank < trainers:
                parts = held_parts(sender_parts(update, rank, trainers, dev))
                asyncio.run(send_update(channel, rank, layouts, parts, update, BUCKET))
            else:
                async def main(update=update):
                    got = {}
                    async for name, t in receive_update(channel, rank, list(range(trainers)), layouts[rank], update,
                                                        None):
                        got[name] = t.clone()
                    return got
                got = asyncio.run(main())
                want = expected(update, layouts[rank])
                exact = sum(torch.equal(got[n].cpu(), t) for n, t in want.items() if n in got)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        reports.append({"error": error, "exact": exact, "slot_bytes": channel.nbytes})
        store.set(f"done/{update}/{rank}", b"1")
        store.wait([f"done/{update}/{r}" for r in range(world_size)])
    channel.close()
    store.set(f"left/{rank}", b"1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size)])
    return pickle.loads(pickle.dumps(reports))
