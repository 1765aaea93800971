"""Offload + onload bandwidth of an engine, as a ratio of a plain single-buffer copy of the same bytes.

One run measures, side by side on the same machine and device kind:

* ``plain``: one contiguous device buffer of the model's size copied to one pinned (where supported),
  already-touched host buffer and back with ``copy_``: the best a transfer of those bytes can do;
* ``plain cold``: what a user's first ``.to("cpu")`` of that buffer and ``.to(<device>)`` back cost: fresh
  pageable host memory (first-touch page faults paid by the copy) and device memory from the caching
  allocator (what the engine's onload gets too, since its offload emptied the cache); measured once;
* ``engine cold``: the first ``TorchEngine.to("cpu")`` + ``to(<device>)``, which allocates the host buffers;
* ``engine warm``: later round trips, which reuse them (the steady state of RL post-training), each timed
  right before a plain round trip so that both see the same load on a shared machine;
* ``host alloc``: allocating the engine's host slabs for the same tensors on their own
  (:meth:`engines.host_buffers.HostBufferPool.reserve`), no copy. A first offload must allocate them, so
  ``host alloc + plain round trip`` is the floor of any cold round trip that allocates its host memory at
  first use; ``cold_floor_ratio`` is the best ``cold_ratio`` that floor allows on this machine.

The model is a stack of transformer-like blocks (hundreds of fp32 tensors from a few KiB to several MiB)
sized to about ``size_mb``. Peak host RSS is the process's ``ru_maxrss``.

    hal bench --only offload --device npu-sim                # 1024 MiB
    hal bench --only offload --device npu-sim --quick        # 64 MiB, for smoke tests
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
    """This process's minor page faults so far (``ru_minflt``): each one a host page made resident (4 KiB, or
    2 MiB where the memory is backed by huge pages), which a copy into memory already touched never pays."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Callable[[], Any], spec: Any) -> float:
    """Wall seconds of ``fn()``, the device synchronized before and after."""
    hal.synchronize(spec)
    start = time.perf_counter()
    fn()
    hal.synchronize(spec)
    return time.perf_counter() - start


def run(size_mb: int, device: str | None = None, rounds: int = 3, threads: int | None = 1) -> dict:
    """Measure offload + onload of a ``size_mb`` MiB model on ``device`` against plain copies of its bytes.

    Args:
        size_mb: model size in MiB (fp32).
        device: device kind; ``None`` resolves through ``hal``.
        rounds: timed repetitions per figure (median taken).
        threads: torch intra-op threads during the run (restored after); 1 by default, since a
            host-side copy split over busy shared cores waits for its slowest thread; ``None`` keeps them.

    Returns:
        A dict with ``device``, ``tensors``, ``bytes``, ``pinned``, ``moves`` and GB/s figures (bytes over
        wall seconds; round trips count 2 x bytes): ``plain_d2h_gbps`` / ``plain_h2d_gbps`` (one contiguous
        buffer, ``copy_`` into existing memory), ``plain_h2d_fresh_gbps`` (``.to(device)`` into new device
        memory, which every onload must do after an offload freed it), ``plain_gbps`` (round trip),
        ``offload_gbps`` / ``onload_gbps`` (warm engine), ``cold_gbps`` / ``warm_gbps`` (engine round trip,
        first one allocating the host buffers), ``cold_ratio`` / ``warm_ratio`` (engine / plain round
        trip), ``plain_cold_gbps`` (plain ``.to("cpu")`` into fresh host memory and ``.to(device)`` back),
        ``cold_vs_plain_cold`` (engine cold / plain cold round trip), ``host_alloc_gbps`` (allocating the
        engine's host slabs for the same tensors, no copy; median of ``rounds`` fresh allocations),
        ``cold_floor_ratio`` (plain round trip / (host alloc + plain round trip): the best ``cold_ratio``
        an offload that allocates its host memory at first use can reach here), ``cold_vs_floor`` (that
        floor's time / engine cold), ``rss_peak_bytes`` (``ru_maxrss``), ``host_buffer_bytes``, and
        ``warm_faults_per_mib`` / ``plain_faults_per_mib`` (the process's minor page faults over one warm engine
        round trip / one plain round trip, median, per MiB of ``bytes``: host pages the move had to make
        resident, 0 for copies between memory already touched). Each warm engine round trip is timed right
        before a plain one, so both sides of a ratio see the same load. On a host-memory kind (cpu) nothing
        moves: ``moves`` is False and every rate and fault figure is 0.

    Raises:
        ValueError: ``size_mb`` or ``rounds`` below 1.
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
    """What :func:`run` measured, in seconds; the ``d2h``/``h2d``/``h2d_fresh``/``host_alloc`` figures are
    already medians over the rounds."""

    cold_s: float
    """The first ``to("cpu")`` + ``to(device)`` round trip (allocates the engine's host buffers)."""
    warm_s: list[tuple[float, float]]
    """Each later round trip as its ``(offload, onload)`` seconds."""
    d2h_s: float
    """Plain device-to-host ``copy_`` of all the bytes into a touched host buffer."""
    h2d_s: float
    """Plain host-to-device ``copy_`` into an existing device buffer."""
    cold_d2h_s: float
    """Plain ``.to("cpu")`` into fresh pageable host memory (once)."""
    cold_h2d_s: float
    """Plain ``.to(device)`` of that copy back (once)."""
    h2d_fresh_s: float
    """Plain ``.to(device)`` into fresh device memory."""
    host_alloc_s: float
    """Allocating the engine's host slabs for the same tensors, no copy."""


def figures(nbytes: int, t: Timings) -> dict[str, float]:
    """The rates (GB/s: 1e9 bytes/s; a round trip moves ``2 * nbytes``) and ratios of :func:`run` from
    ``t``. The warm figures are those of the median warm round trip (by its total), so offload and onload
    are the two halves of one round trip, not medians taken apart.
    """
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

