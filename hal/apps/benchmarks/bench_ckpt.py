"""Throughput of the collective checkpoint engine, as a ratio of plain broadcasts of the same bytes.

Two processes (1 trainer, 1 rollout) measure side by side: ``single`` (one broadcast of all the bytes),
``per-tensor`` (one broadcast per tensor) and ``engine`` (``send_weights`` / ``receive_weights`` per bucket
size, with each side's peak memory against ``bucket_size``). The tensors are bf16, log-uniform between 2 KiB
and 18 MiB, seeded. Timings run barrier to barrier; rounds interleave every measurement; medians.

    hal bench --only sync --quick --device npu-sim          # 64 MiB, buckets 4 and 16 MiB
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from pathlib import Path

import torch

import hal
from hal.apps.benchmarks import timed_once, transfer_once
from ckpt.manager import join_engine
from hal.apps.benchmarks.ranks import launcher_store, run_ranks
from hal.apps.errors import mib_to_bytes


LAYOUTS = ("separate", "flat")


def tensor_sizes(total_bytes: int, seed: int = 0, low: int = 2 << 10, high: int = 18 << 20) -> list[int]:
    """Byte sizes (even, for bf16) log-uniform in [low, high], summing to ``total_bytes``."""
    g = torch.Generator().manual_seed(seed)
    sizes, acc = [], 0
    while acc < total_bytes:
        u = float(torch.rand((), generator=g))
        s = int(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))) // 2 * 2
        s = min(s, total_bytes - acc) or 2
        sizes.append(s)
        acc += s
    return sizes


def tensor_views(flat: torch.Tensor, sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """``("layer{i}.weight", view)`` pairs: bf16 views laid end to end in the uint8 buffer ``flat`` (as FSDP1 or
    Megatron flat parameters)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < sum(sizes):
        raise ValueError(f"flat must be a 1-d uint8 tensor of >= {sum(sizes)} bytes, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    views, offset = [], 0
    for i, s in enumerate(sizes):
        views.append((f"layer{i}.weight", flat[offset:offset + s].view(torch.bfloat16)))
        offset += s
    return views


def proc_status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ...) in bytes (Linux)."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class PeakMemory:
    """Peak bytes added between ``start()`` and ``stop()``: the host's VmHWM (Linux), or the device allocator's."""

    def __init__(self, device: str) -> None:
        self.spec = hal.resolve_device(device)
        self.module = hal.get_torch_device(device)

    def start(self) -> None:
        if self.spec.host_memory:
            self.base = proc_status_bytes("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        else:
            self.module.reset_peak_memory_stats()
            self.base = self.module.memory_allocated()

    def stop(self) -> int:
        if self.spec.host_memory:
            return proc_status_bytes("VmHWM") - self.base
        return self.module.max_memory_allocated() - self.base


def _bench_rank(rank: int, world_size: int, size_mb: int, bucket_sizes: list[int], device: str,
                rounds: int, direct_threshold: int | None, layouts: list[str]) -> dict:
    import ckpt

    torch.set_num_threads(1)
    dev = hal.set_device(device)  # one device per rank (LOCAL_RANK's), as a communicator requires
    sizes = tensor_sizes(size_mb << 20)
    total = sum(sizes)
    store = launcher_store()
    group = hal.new_group_from_store(store, rank, world_size, device=device, timeout=120, prefix="bench")
    flat = torch.zeros(total, dtype=torch.uint8, device=dev)  # touched: no page faults in the timings
    if rank == 0:
        block = torch.randint(0, 256, (min(total, 64 << 20),), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(1))
        for i in range(0, total, block.numel()):
            n = min(block.numel(), total - i)
            flat[i:i + n].copy_(block[:n])
    views = tensor_views(flat, sizes)
    models = {"flat": views,  # separate: one allocation per tensor (as FSDP2 full_tensor() gathers give)
              "separate": [(n, t.clone()) for n, t in views] if rank == 0 else views}
    tensors = views

    def single():
        group.broadcast(flat, 0)

    def per_tensor():
        works = [group.broadcast(t, 0, async_op=True) for _, t in tensors]
        for w in works:
            w.wait()

    peak = PeakMemory(device)
    engines, peaks, moved = [], [], []
    step = [0]

    def transfer(engine, layout):
        step[0] += 1
        moved.append(transfer_once(engine, rank, models[layout], step[0]))

    for i, bucket in enumerate(bucket_sizes):
        engine = ckpt.get_checkpoint_engine("collective", is_master=rank == 0, master_addr="127.0.0.1",
                                            bucket_size=bucket, device=device, timeout=120,
                                            direct_threshold=direct_threshold)
        peak.start()  # the first (warm-up) transfer, buffers included
        join_engine(engine, rank, world_size, store, f"collective/{i}")
        timed_once(group, functools.partial(transfer, engine, layouts[0]))
        peaks.append(peak.stop())
        for layout in layouts[1:]:
            timed_once(group, functools.partial(transfer, engine, layout))
        engines.append(engine)
    timed_once(group, single)
    timed_once(group, per_tensor)
    times: dict[str, list[float]] = {"single": [], "per_tensor": []}
    for _ in range(rounds):
        times["single"].append(timed_once(group, single))
        times["per_tensor"].append(timed_once(group, per_tensor))
        for engine in engines:
            for layout in layouts:
                times.setdefault(f"{layout}:{engine.bucket_size}", []).append(
                    timed_once(group, functools.partial(transfer, engine, layout)))
    for engine in engines:
        engine.close()
    group.close()
    return {"device": device, "backend": hal.get_dist_backend(device), "size_bytes": total, "n_tensors": len(sizes),
            "rounds": rounds, "times": times, "peaks": peaks, "moved_bytes": sorted(set(moved)),
            "direct_threshold": engines[0].direct_threshold if engines else None}


def run(size_mb: int, bucket_sizes_mb: list[float], device: str, rounds: int = 3,
        direct_threshold: int | None = None, layouts: tuple[str, ...] | list[str] = LAYOUTS) -> dict:
    """Measure in two spawned processes; returns the figures (seconds, bytes, GB/s = 1e9 bytes/s, ratios).

    ``layouts``: ``"separate"`` (one allocation per tensor) and/or ``"flat"`` (views into one buffer).
    ``direct_threshold`` in bytes (``None``: the engine's default). Times are medians; ratios are medians of
    per-round ratios (1.0: as fast as one single-tensor broadcast).
    """
    buckets = [mib_to_bytes(b, "--bucket-mb") for b in bucket_sizes_mb]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {list(layouts)}")
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got size_mb={size_mb}, rounds={rounds}")
    layouts = list(layouts)
    timeout = max(120.0, size_mb * 0.3 * (rounds + 1) * (2 + len(buckets) * len(layouts)))
    results = run_ranks(_bench_rank, 2, size_mb, buckets, device, rounds,
                        direct_threshold, layouts, timeout=timeout)
    return figures(results[0], results[1], buckets, layouts)


def figures(send: dict, recv: dict, buckets: list[int], layouts: list[str]) -> dict:
    """The figures of :func:`run` from what each rank measured (``times`` per round, ``peaks`` per bucket); a
    ratio is the median of per-round ratios."""
    total, times = send["size_bytes"], send["times"]
    med = statistics.median

    def gbps(seconds: float) -> float:
        return total / seconds / 1e9

    single, per_tensor = med(times["single"]), med(times["per_tensor"])
    out = {k: send[k] for k in ("device", "backend", "size_bytes", "n_tensors", "rounds")}
    out["moved_bytes"] = recv["moved_bytes"]
    out.update(single_s=single, single_gbps=gbps(single), per_tensor_s=per_tensor, per_tensor_gbps=gbps(per_tensor),
               per_tensor_ratio=med(a / b for a, b in zip(times["single"], times["per_tensor"])), buckets=[])
    for layout in layouts:
        for i, bucket in enumerate(buckets):
            t = times[f"{layout}:{bucket}"]
            out["buckets"].append({
                "layout": layout, "bucket_bytes": bucket, "s": med(t), "gbps": gbps(med(t)),
                "ratio_vs_single": med(a / b for a, b in zip(times["single"], t)),
                "ratio_vs_per_tensor": med(a / b for a, b in zip(times["per_tensor"], t)),
                "send_peak_bytes": send["peaks"][i], "recv_peak_bytes": recv["peaks"][i],
                "send_peak_buckets": send["peaks"][i] / bucket, "recv_peak_buckets": recv["peaks"][i] / bucket})
    return out


def print_table(result: dict) -> None:
    """The figures of :func:`run` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = Table(title=f"collective checkpoint engine, {result['device']} ({result['backend']}), "
                        f"{result['n_tensors']} bf16 tensors, {result['size_bytes'] / mib:.0f} MiB")
    for col in ("what", "time ms", "GB/s", "vs single", "vs per-tensor", "send peak MiB (buckets)",
                "recv peak MiB (buckets)"):
        table.add_column(col, justify="right")
    table.add_row("one single-tensor broadcast", f"{result['single_s'] * 1e3:.0f}", f"{result['single_gbps']:.2f}",
                  "1.00", "", "", "")
    table.add_row("tensor by tensor", f"{result['per_tensor_s'] * 1e3:.0f}", f"{result['per_tensor_gbps']:.2f}",
                  f"{result['per_tensor_ratio']:.2f}", "1.00", "", "")
    for b in result["buckets"]:
        table.add_row(f"engine, {b['layout']}, bucket {b['bucket_bytes'] / mib:g} MiB", f"{b['s'] * 1e3:.0f}",
                      f"{b['gbps']:.2f}",
                      f"{b['ratio_vs_single']:.2f}", f"{b['ratio_vs_per_tensor']:.2f}",
                      f"{b['send_peak_bytes'] / mib:.0f} ({b['send_peak_buckets']:.2f})",
                      f"{b['recv_peak_bytes'] / mib:.0f} ({b['recv_peak_buckets']:.2f})")
    Console(width=150).print(table)

