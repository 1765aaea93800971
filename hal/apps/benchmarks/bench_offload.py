"""Offload + onload bandwidth of an engine, as a ratio of a plain single-buffer copy of the same bytes.

Measured side by side: ``plain`` (one buffer copied to an already touched pinned host buffer and back),
``plain cold`` (a first ``.to("cpu")`` and back, fresh memory), ``engine cold`` (the first
``TorchEngine.to`` round trip, which allocates the host buffers), ``engine warm`` (later round trips, each
timed right before a plain one), and ``host alloc`` (the engine's host slabs alone: with a plain round trip,
the floor of any cold round trip). The model is transformer-like blocks of about ``size_mb``.

    hal bench --only offload --device npu-sim --quick        # 64 MiB
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

import hal

LAYERS = 24
TENSORS_PER_LAYER = 12


class Block(nn.Module):
    """Attention-and-MLP shaped block: 12 tensors, ``12 * width**2 + 13 * width`` parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)


def make_model(size_mb: int) -> nn.Module:
    """``LAYERS`` blocks (288 tensors) whose fp32 parameters total about ``size_mb`` MiB."""
    width = max(16, int(math.sqrt(size_mb * 2**20 / 4 / LAYERS / 12)) // 16 * 16)
    with torch.device("meta"):
        model = nn.Sequential(*(Block(width) for _ in range(LAYERS)))
    return model.to_empty(device="cpu").requires_grad_(True)


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _minor_faults() -> int:
    """This process's minor page faults so far (``ru_minflt``): host pages made resident."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Callable[[], Any], spec: Any) -> float:
    """Wall seconds of ``fn()``, the device synchronized before and after."""
    hal.synchronize(spec)
    start = time.perf_counter()
    fn()
    hal.synchronize(spec)
    return time.perf_counter() - start


def run(size_mb: int, device: str | None = None, rounds: int = 3, threads: int | None = 1) -> dict:
    """Measure offload + onload of a ``size_mb`` MiB fp32 model on ``device`` against plain copies of its bytes.

    ``threads``: torch intra-op threads during the run (1: a split host copy waits for its slowest thread;
    ``None`` keeps them). Returns GB/s figures (round trips count 2 x bytes), ``cold_ratio`` / ``warm_ratio``
    (engine / plain round trip), ``cold_floor_ratio``, fault counts per MiB and ``rss_peak_bytes``; on a
    host-memory kind nothing moves (``moves`` False, every rate 0).
    """
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got size_mb={size_mb}, rounds={rounds}")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(size_mb, device, rounds)
    finally:
        torch.set_num_threads(saved_threads)


def _run(size_mb: int, device: str | None, rounds: int) -> dict:
    from engines import TorchEngine
    from engines.host_buffers import SLAB_BYTES, HostBufferPool

    spec = hal.resolve_device(device)
    engine = TorchEngine(make_model(size_mb), None, spec)
    tensors = list(engine.module.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = {"device": spec.kind, "tensors": len(tensors), "bytes": nbytes, "pinned": engine.host_buffers.pin,
           "moves": not spec.host_memory}
    rates = ("plain_d2h_gbps", "plain_h2d_gbps", "plain_h2d_fresh_gbps", "plain_gbps", "offload_gbps",
             "onload_gbps", "cold_gbps", "warm_gbps", "cold_ratio", "warm_ratio", "plain_cold_gbps",
             "cold_vs_plain_cold", "host_alloc_gbps", "cold_floor_ratio", "cold_vs_floor")
    if spec.host_memory:
        out.update(dict.fromkeys(rates, 0.0), rss_peak_bytes=_rss_peak_bytes(), host_buffer_bytes=0,
                   warm_faults_per_mib=0.0, plain_faults_per_mib=0.0)
        return out
    pin = engine.host_buffers.pin
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=engine.torch_device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host_buf.fill_(1)  # touch every page, as the engine's reused buffers are
    dev_buf.copy_(host_buf)

    def median(fn) -> float:
        return statistics.median(_timed(fn, spec) for _ in range(rounds))

    cold = _timed(lambda: (engine.to("cpu"), engine.to(spec)), spec)
    # Each warm round trip is followed by a plain one, so that both see the same load on a shared machine
    # (timed apart, a burst of another process's work lands on one side only and skews the ratio).
    warm, d2hs, h2ds, faults = [], [], [], {"warm": [], "plain": []}
    for _ in range(rounds):
        before = _minor_faults()
        warm.append((_timed(lambda: engine.to("cpu"), spec), _timed(lambda: engine.to(spec), spec)))
        between = _minor_faults()
        d2hs.append(_timed(lambda: host_buf.copy_(dev_buf, non_blocking=pin), spec))
        h2ds.append(_timed(lambda: dev_buf.copy_(host_buf, non_blocking=pin), spec))
        faults["warm"].append(between - before)
        faults["plain"].append(_minor_faults() - between)
    d2h, h2d = statistics.median(d2hs), statistics.median(h2ds)
    fresh: list[torch.Tensor] = []
    cold_d2h = _timed(lambda: fresh.append(dev_buf.to("cpu")), spec)  # fresh pageable host memory
    dev_buf = None  # its block goes back to the device cache, which the onload below draws from
    cold_h2d = _timed(lambda: fresh.append(fresh[0].to(engine.torch_device)), spec)
    fresh.clear()
    h2d_fresh = median(lambda: host_buf.to(engine.torch_device, non_blocking=pin))
    allocs = []
    for _ in range(rounds):  # what the cold offload allocated, on its own; freed (untimed) after each round
        slabs = HostBufferPool(pin)
        allocs.append(_timed(functools.partial(slabs.reserve, enumerate(tensors), SLAB_BYTES), spec))
        slabs.clear()
    timings = Timings(cold_s=cold, warm_s=warm, d2h_s=d2h, h2d_s=h2d, cold_d2h_s=cold_d2h, cold_h2d_s=cold_h2d,
                      h2d_fresh_s=h2d_fresh, host_alloc_s=statistics.median(allocs))
    out.update(figures(nbytes, timings), rss_peak_bytes=_rss_peak_bytes(),
               host_buffer_bytes=engine.host_buffers.nbytes,
               warm_faults_per_mib=statistics.median(faults["warm"]) / (nbytes / 2**20),
               plain_faults_per_mib=statistics.median(faults["plain"]) / (nbytes / 2**20))
    return out


@dataclasses.dataclass(frozen=True)
class Timings:
    """What :func:`run` measured, in seconds (``d2h``, ``h2d``, ``h2d_fresh``, ``host_alloc``: medians)."""

    cold_s: float  # first round trip: allocates the host buffers
    warm_s: list[tuple[float, float]]  # later round trips, (offload, onload)
    d2h_s: float  # plain copy_ into a touched host buffer
    h2d_s: float
    cold_d2h_s: float  # plain .to("cpu") into fresh host memory, once
    cold_h2d_s: float
    h2d_fresh_s: float
    host_alloc_s: float  # the engine's host slabs, no copy


def figures(nbytes: int, t: Timings) -> dict[str, float]:
    """The rates (GB/s; a round trip moves ``2 * nbytes``) and ratios of :func:`run` from ``t``, warm figures
    from the median warm round trip."""
    warm_total, offload, onload = sorted((a + b, a, b) for a, b in t.warm_s)[len(t.warm_s) // 2]
    plain = t.d2h_s + t.h2d_s
    plain_cold = t.cold_d2h_s + t.cold_h2d_s
    floor = t.host_alloc_s + plain

    def gbps(n: int, seconds: float) -> float:
        return n / seconds / 1e9

    return dict(plain_d2h_gbps=gbps(nbytes, t.d2h_s), plain_h2d_gbps=gbps(nbytes, t.h2d_s),
                plain_h2d_fresh_gbps=gbps(nbytes, t.h2d_fresh_s), plain_gbps=gbps(2 * nbytes, plain),
                offload_gbps=gbps(nbytes, offload), onload_gbps=gbps(nbytes, onload),
                cold_gbps=gbps(2 * nbytes, t.cold_s), warm_gbps=gbps(2 * nbytes, warm_total),
                cold_ratio=plain / t.cold_s, warm_ratio=plain / warm_total,
                plain_cold_gbps=gbps(2 * nbytes, plain_cold), cold_vs_plain_cold=plain_cold / t.cold_s,
                host_alloc_gbps=gbps(nbytes, t.host_alloc_s), cold_floor_ratio=plain / floor,
                cold_vs_floor=floor / t.cold_s)


def print_table(r: dict) -> None:
    """Print the result of :func:`run` as a rich table (GB/s and ratio to the plain copy) plus peak RSS."""
    from rich.console import Console
    from rich.table import Table

    title = (f"offload+onload on {r['device']}: {r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB, "
             f"pinned={r['pinned']}")
    table = Table(title=title)
    for col in ("what", "GB/s", "x plain"):
        table.add_column(col, justify="right" if col != "what" else "left")
    rows = [
        ("plain copy_ round trip (one buffer, D2H + H2D)", r["plain_gbps"], 1.0 if r["moves"] else 0.0),
        ("  plain D2H copy_ into touched host buffer", r["plain_d2h_gbps"], None),
        ("  plain H2D copy_ into existing device buffer", r["plain_h2d_gbps"], None),
        ("  plain H2D .to() into fresh device memory", r["plain_h2d_fresh_gbps"], None),
        ("plain .to('cpu') + .to(dev), cold (fresh host memory)", r["plain_cold_gbps"], None),
        ("engine to('cpu') + to(dev), cold (allocates host buffers)", r["cold_gbps"], r["cold_ratio"]),
        ("engine to('cpu') + to(dev), warm (reuses them)", r["warm_gbps"], r["warm_ratio"]),
        ("  engine offload, warm", r["offload_gbps"], r["offload_gbps"] / (r["plain_d2h_gbps"] or 1.0)),
        ("  engine onload, warm", r["onload_gbps"], r["onload_gbps"] / (r["plain_h2d_gbps"] or 1.0)),
        ("host slabs allocated alone (what a cold offload allocates)", r["host_alloc_gbps"], None),
        ("floor of a cold round trip: host alloc + plain round trip", 0.0 if not r["cold_floor_ratio"] else
         r["plain_gbps"] * r["cold_floor_ratio"], r["cold_floor_ratio"]),
    ]
    for what, rate, ratio in rows:
        table.add_row(what, f"{rate:.2f}", "" if ratio is None else f"{ratio:.2f}")
    console = Console()
    console.print(table)
    if r["moves"]:
        console.print(f"engine cold round trip = {r['cold_vs_plain_cold']:.2f}x the plain cold one, "
                      f"{r['cold_vs_floor']:.2f}x the floor (host alloc + plain round trip)")
    console.print(f"peak host RSS {r['rss_peak_bytes'] / 2**30:.2f} GiB; engine host buffers "
                  f"{r['host_buffer_bytes'] / 2**30:.2f} GiB")
    if r["moves"]:
        console.print(f"host page faults per MiB moved: warm round trip {r['warm_faults_per_mib']:.2f}, "
                      f"plain round trip {r['plain_faults_per_mib']:.2f}")
    if not r["moves"]:
        console.print(f"device kind {r['device']!r} keeps tensors in host memory: nothing moves "
                      "(use --device npu-sim, cuda or npu)")

