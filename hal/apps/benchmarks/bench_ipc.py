"""The ipc checkpoint engine (same host, separate processes) against one memcpy and the collective engine.

Side by side, the same bytes (bf16, log-uniform 2 KiB to 18 MiB, seeded): ``memcpy`` (one ``copy_`` into a
touched buffer, the unit), ``ipc`` into 1 and 2 rollout processes that copy into their own tensors,
``ipc in place`` (staged in the engine's ``publish_buffer``, so the trainer copies nothing) and ``collective``
(same bucket). Barrier to barrier, rounds interleaved, ratios as medians of per-round ratios; every engine's
first update is checked byte for byte (``verified``).

    hal bench --only ipc --quick --device npu-sim
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import torch

import hal
from hal.apps.benchmarks import timed_once
from hal.apps.benchmarks.bench_ckpt import tensor_sizes
from ckpt.manager import join_engine
from hal.apps.benchmarks.ranks import launcher_store, run_ranks


class _Targets:
    """A rollout's own tensors, as the engines' ``placement`` (``target(name, dtype, shape)``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        return self.tensors.get(name)


def _weights(sizes: list[int], device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(sizes):
        t = torch.randint(-(1 << 15), 1 << 15, (s // 2,), dtype=torch.int16, generator=g).view(torch.bfloat16)
        out.append((f"layer{i}.weight", t.to(device)))
    return out


def _staged(engine: Any, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``weights`` copied into views of ``engine.publish_buffer`` (64-byte aligned, back to back)."""
    from ckpt.layout import byte_view
    from ckpt.layout import align

    offsets, end = [], 0
    for _, t in weights:
        offsets.append(align(end))
        end = offsets[-1] + t.numel() * t.element_size()
    buffer = engine.publish_buffer(end)
    out = []
    for (name, t), offset in zip(weights, offsets):
        out.append((name, byte_view(buffer, offset, t.dtype, t.shape).copy_(t)))
    return out


def _rank(rank: int, world_size: int, endpoint: str, size_mb: int, bucket: int, device: str,
          rounds: int, collective: bool) -> dict[str, Any]:
    import ckpt

    torch.set_num_threads(1)
    dev = hal.set_device(device)
    sizes = tensor_sizes(size_mb << 20)
    total = sum(sizes)
    store = launcher_store()
    group = hal.new_group_from_store(store, rank, world_size, device="cpu", timeout=600, prefix="bench-ipc")
    pids = [0] * world_size
    store.set(f"pid/{rank}", str(__import__("os").getpid()))
    for r in range(world_size):
        pids[r] = int(store.get(f"pid/{r}"))
    if rank == 0:
        weights = _weights(sizes, dev, seed=1)
        staged = None
        flat_src = torch.zeros(total, dtype=torch.uint8, device=dev)
        flat_dst = torch.zeros(total, dtype=torch.uint8, device=dev)  # touched: no page faults in the timing
        placement = None
    else:
        expected = _weights(sizes, torch.device("cpu"), seed=1)
        mine = {n: torch.zeros_like(t, device=dev) for n, t in expected}
        placement = _Targets(mine)
    engines = {"ipc": ckpt.get_checkpoint_engine(
        "ipc", rank=rank, world_size=world_size, endpoint=endpoint, bucket_size=bucket, device=device, timeout=300,
        peer_pids=pids[1:] if rank == 0 else [pids[0]])}
    if collective:
        engines["ipc_in_place"] = ckpt.get_checkpoint_engine(
            "ipc", rank=rank, world_size=world_size, endpoint=f"{endpoint}-in-place", bucket_size=bucket,
            device=device, timeout=300, peer_pids=pids[1:] if rank == 0 else [pids[0]])
        if rank == 0:  # staged once, as a trainer's cast would write it: not part of the transfer
            staged = _staged(engines["ipc_in_place"], weights)
        engines["collective"] = ckpt.get_checkpoint_engine(
            "collective", is_master=rank == 0, master_addr="127.0.0.1", bucket_size=bucket, device=device,
            timeout=300)
        join_engine(engines["collective"], rank, world_size, store, "collective")
    step = [0]
    verified: dict[str, bool] = {}

    def update(name: str) -> None:
        step[0] += 1
        engine = engines[name]

        async def go() -> None:
            if rank == 0:
                await engine.send_weights(staged if name == "ipc_in_place" else weights, step[0])
            else:
                async for n, t in engine.receive_weights(step[0], placement=placement):
                    if t is not mine[n]:  # the engine could not use the target: the rollout copies
                        mine[n].copy_(t)
        asyncio.run(go())

    def memcpy() -> None:
        if rank == 0:
            flat_dst.copy_(flat_src)

    for name in engines:  # warm-up, and the check that the bytes arrived
        if rank != 0:
            for t in mine.values():
                t.zero_()
        timed_once(group, lambda n=name: update(n))
        if rank != 0:
            verified[name] = all(torch.equal(mine[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in expected)
    timed_once(group, memcpy)
    times: dict[str, list[float]] = {"memcpy": [], **{name: [] for name in engines}}
    for _ in range(rounds):
        times["memcpy"].append(timed_once(group, memcpy))
        for name in engines:
            times[name].append(timed_once(group, lambda n=name: update(n)))
    for engine in engines.values():
        engine.close()
    group.close()
    return {"times": times, "size_bytes": total, "n_tensors": len(sizes), "verified": verified,
            "transport": engines["ipc"].transport}


def run(size_mb: int, device: str, rounds: int = 3, bucket_mb: float = 64.0) -> dict[str, Any]:
    """Measure in 2 processes (trainer, 1 rollout), then 3 (2 rollouts); returns GB/s (1e9 bytes/s) of the
    medians, ``*_vs_*`` ratios (medians of per-round ratios; above 1: the first faster) and ``verified``."""
    from ckpt.ipc import default_endpoint

    if size_mb < 1 or rounds < 1 or not bucket_mb > 0:
        raise ValueError(f"size_mb and rounds must be >= 1 and bucket_mb > 0, got {size_mb}, {rounds}, {bucket_mb}")
    bucket = int(bucket_mb * (1 << 20))
    timeout = max(180.0, size_mb * 0.2 * (rounds + 2) * 4)
    one = run_ranks(_rank, 2, default_endpoint(), size_mb, bucket, device, rounds, True,
                    timeout=timeout)
    two = run_ranks(_rank, 3, default_endpoint(), size_mb, bucket, device, rounds, False,
                    timeout=timeout)
    med = statistics.median
    total = one[0]["size_bytes"]
    t1, t2 = one[0]["times"], two[0]["times"]

    def gbps(seconds: list[float]) -> float:
        return total / med(seconds) / 1e9

    return {"device": device, "transport": one[0]["transport"], "size_bytes": total, "n_tensors": one[0]["n_tensors"],
            "bucket_bytes": bucket, "rounds": rounds,
            "memcpy_gbps": gbps(t1["memcpy"]), "ipc_gbps": gbps(t1["ipc"]), "ipc2_gbps": gbps(t2["ipc"]),
            "collective_gbps": gbps(t1["collective"]), "ipc_in_place_gbps": gbps(t1["ipc_in_place"]),
            "ipc_vs_memcpy": med(m / i for m, i in zip(t1["memcpy"], t1["ipc"])),
            "ipc_vs_collective": med(c / i for c, i in zip(t1["collective"], t1["ipc"])),
            "ipc2_vs_memcpy": med(m / i for m, i in zip(t2["memcpy"], t2["ipc"])),
            "ipc_in_place_vs_memcpy": med(m / i for m, i in zip(t1["memcpy"], t1["ipc_in_place"])),
            "ipc_in_place_vs_collective": med(c / i for c, i in zip(t1["collective"], t1["ipc_in_place"])),
            "verified": all(v for res in (one, two) for r, fig in res.items() if r for v in fig["verified"].values()),
            "verified_by_engine": {f"{len(res) - 1} rollout(s) {name}": v for res in (one, two) for r, fig in res.items() if r
                                   for name, v in fig["verified"].items()}}


def print_table(result: dict[str, Any]) -> None:
    """The figures of :func:`run` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = Table(title=f"ipc checkpoint engine ({result['transport']}), {result['device']}, {result['n_tensors']} "
                        f"bf16 tensors, {result['size_bytes'] / mib:.0f} MiB, bucket {result['bucket_bytes'] / mib:g} "
                        f"MiB; byte-exact: {'yes' if result['verified'] else 'NO'}",
                  caption="GB/s = 10^9 bytes/s; ratios: medians of per-round throughput ratios, measured in one run")
    for col in ("what", "GB/s", "x memcpy", "x collective"):
        table.add_column(col, justify="right")
    table.add_row("one memcpy (buffer touched)", f"{result['memcpy_gbps']:.2f}", "1.00", "")
    table.add_row("ipc engine, 1 rollout", f"{result['ipc_gbps']:.2f}", f"{result['ipc_vs_memcpy']:.2f}",
                  f"{result['ipc_vs_collective']:.2f}")
    table.add_row("ipc engine in place (staged in its publish buffer), 1 rollout", f"{result['ipc_in_place_gbps']:.2f}",
                  f"{result['ipc_in_place_vs_memcpy']:.2f}", f"{result['ipc_in_place_vs_collective']:.2f}")
    table.add_row("ipc engine, 2 rollouts", f"{result['ipc2_gbps']:.2f}", f"{result['ipc2_vs_memcpy']:.2f}", "")
    table.add_row("collective engine, 1 rollout", f"{result['collective_gbps']:.2f}", "", "1.00")
    Console(width=150).print(table)


__all__ = ["print_table", "run"]
