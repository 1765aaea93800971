"""Throughput of the transfer-library checkpoint engines (``nixl``, ``mooncake``, ``kimi``) against their own library.

One run, two processes (1 trainer, 1 rollout), for each engine, measured side by side in those processes:

* ``raw``: one transfer by the library of the same bytes, between one registered region holding the whole
  tensor mix on the trainer and one registered region of that size on the rollout (NIXL ``WRITE``; Mooncake
  ``transfer_sync_write``; for ``kimi``, which pulls, Mooncake ``transfer_sync_read`` by the rollout): the
  best the library does between these two processes;
* ``engine``: ``send_weights`` / ``receive_weights`` of the tensor mix (bf16 views into that region, sizes
  log-uniform 2 KiB .. 18 MiB as in :mod:`hal.apps.benchmarks.bench_ckpt`); the receiver iterates the yielded
  views without copying. Its peak memory on each side (host: ``VmHWM`` after a reset, minus the resident
  size before; the first transfer, buffers included) is reported against ``bucket_size``.

After a warm-up, every round times raw and engine once each (barrier to barrier; raw first in even rounds,
engine first in odd ones), so a noisy neighbour or a drift slows both alike; the ratio ``engine GB/s / raw
GB/s`` is taken per round, and medians are reported. Each engine update ends with ``finalize()``, as under
verl's manager, and the next one reuses the connections and registered buffers.

``hal bench --only sync`` runs it after the collective engine's figures, for each of these engines available
on the benchmarked kind (kimi runs on npu-sim, not cpu), at the smallest ``--bucket-mb``:

    hal bench --only sync --quick --device npu-sim
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import zlib
from typing import Any, Callable

import torch

import hal
from hal.apps.benchmarks import timed_once, transfer_once
from hal.apps.benchmarks.bench_ckpt import PeakMemory, tensor_sizes, tensor_views
from hal.apps.benchmarks.ranks import free_ports, run_ranks
from hal.apps.errors import mib_to_bytes

ENGINES = ("nixl", "mooncake", "kimi")
PULLS = ("kimi",)
"""Engines whose rollouts read from the trainer: their raw figure is a library read, not a write."""


def _raw_transport(name: str, rank: int):
    """The engine's own transport, on host memory, as a bare library handle."""
    if name == "nixl":
        from ckpt.nixl import HOST_MEMORY_TYPE, NixlTransport

        return NixlTransport(f"bench-raw-{rank}-{time.monotonic_ns()}", HOST_MEMORY_TYPE, ("UCX",))
    from ckpt.mooncake import HOST_PROTOCOL, MooncakeTransport

    return MooncakeTransport("127.0.0.1", HOST_PROTOCOL)


def _bench_rank(rank: int, world_size: int, ports: list[int], size_mb: int, bucket: int, device: str, rounds: int,
                engines: list[str]) -> dict:
    import ckpt

    torch.set_num_threads(1)
    dev = hal.bind_local_device(device)  # one device per rank (LOCAL_RANK's)
    sizes = tensor_sizes(size_mb << 20)
    total = sum(sizes)
    store = hal.connect_store("127.0.0.1", ports[0], rank, world_size, timeout=120)
    group = hal.new_group_from_store(store, rank, world_size, device="cpu", timeout=300, prefix="bench")
    host = torch.zeros(total, dtype=torch.uint8)  # the raw transfers' region (touched: no page faults later)
    if rank == 0:
        host.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    flat = host if dev.type == "cpu" else host.to(dev)
    views = tensor_views(flat, sizes)
    out = {"size_bytes": total, "n_tensors": len(sizes), "engines": {}}
    for name, port in zip(engines, ports[1:]):
        engine = ckpt.get_checkpoint_engine(name, rank=rank, world_size=2, master_addr="127.0.0.1",
                                            master_port=port, bucket_size=bucket, device=device, timeout=300)
        raw_once, raw = _raw_once(name, rank, store, host)
        out["engines"][name] = _measure(engine, raw_once, rank, group, views, rounds)
        engine.close()
        raw.close()
    out["crc32"] = zlib.crc32(host.numpy().data)  # the raw writes delivered these bytes to the rollout
    group.close()
    return out


def _raw_once(name: str, rank: int, store, host: torch.Tensor) -> tuple[Callable[[], None], Any]:
    """One raw transfer of all of ``host`` by ``name``'s library between the two ranks, as a call, and the
    transport to close after (the regions registered and the peer added here, once)."""
    raw = _raw_transport(name, rank)
    store.set(f"raw/{name}/{rank}", json.dumps(raw.register(host)))
    peer = json.loads(store.get(f"raw/{name}/{1 - rank}"))
    raw.add_peer(1 - rank, peer)
    total = host.numel()

    def once() -> None:
        if name in PULLS and rank == 1:
            rc = raw.engine.transfer_sync_read(peer["session"], host.data_ptr(), peer["addr"], total)
            if rc != 0:
                raise RuntimeError(f"Mooncake transfer_sync_read returned {rc}")
        elif name == "mooncake" and rank == 0:  # the library's synchronous write, as its users call it
            rc = raw.engine.transfer_sync_write(peer["session"], host.data_ptr(), peer["addr"], total)
            if rc != 0:
                raise RuntimeError(f"Mooncake transfer_sync_write returned {rc}")
        elif name not in PULLS and rank == 0:
            asyncio.run(raw.wait(raw.start_write(1, [(host.data_ptr(), 0, total)]), 300))

    return once, raw


def _measure(engine, raw_once: Callable[[], None], rank: int, group, views, rounds: int) -> dict:
    """``{"times": {"raw": [s, ...], "engine": [...]}, "peak": bytes}`` of one engine against its library."""
    step = [0]

    def engine_once() -> None:
        step[0] += 1
        transfer_once(engine, rank, views, step[0])
        engine.finalize()  # as verl's manager ends every update: the engine keeps its connections

    peak = PeakMemory("cpu")
    peak.start()
    timed_once(group, engine_once)  # warm-up, buffers and connections included
    engine_peak = peak.stop()
    timed_once(group, raw_once)
    times: dict[str, list[float]] = {"raw": [], "engine": []}
    for r in range(rounds):  # ABBA: each kind goes first in every other round, so a drift hits both
        for kind in (("raw", "engine") if r % 2 == 0 else ("engine", "raw")):
            times[kind].append(timed_once(group, raw_once if kind == "raw" else engine_once))
    return {"times": times, "peak": engine_peak}


def run(size_mb: int = 256, bucket_mb: float = 64.0, device: str = "cpu", rounds: int = 5,
        engines: list[str] | tuple[str, ...] = ENGINES) -> dict:
    """Measure in two spawned processes; ``bucket_mb``: the engines' bucket size in MiB (fractions allowed).

    Returns:
        ``{"device", "size_bytes", "n_tensors", "bucket_bytes", "rounds", "engines": [{"engine", "raw_s",
        "raw_gbps", "s", "gbps", "ratio_vs_raw", "send_peak_bytes", "recv_peak_bytes", "send_peak_buckets",
        "recv_peak_buckets", "round_ratios"}]}``; times are medians, ``ratio_vs_raw`` the median of per-round
        ``raw_s / engine_s`` (1.0: as fast as one raw write, for kimi one raw read, of the same bytes).
        GB/s = 1e9 bytes/s.

    Raises:
        ValueError: an unknown engine name, ``size_mb`` or ``rounds`` below 1, or ``bucket_mb`` not positive
            (a :class:`hal.apps.errors.UsageError` naming ``--bucket-mb``).
        ChildFailedError: a rank failed (e.g. the library is not installed) or passed its deadline.
    """
    bucket = mib_to_bytes(bucket_mb, "--bucket-mb")
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise ValueError(f"engines must be a non-empty subset of {ENGINES}, got {list(engines)}")
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got {size_mb}, {rounds}")
    results = run_ranks(_bench_rank, 2, free_ports(1 + len(engines)), size_mb, bucket, device, rounds, list(engines),
                        timeout=max(180.0, size_mb * 0.1 * (rounds + 2) * len(engines)), name="p2p")
    send, recv = results[0], results[1]
    if recv["crc32"] != send["crc32"]:
        raise RuntimeError("the raw library writes delivered other bytes than the trainer holds")
    total = send["size_bytes"]
    med = statistics.median
    out = {"device": device, "size_bytes": total, "n_tensors": send["n_tensors"], "bucket_bytes": bucket,
           "rounds": rounds, "engines": []}
    for name in engines:
        t = send["engines"][name]["times"]
        raw_s, s = med(t["raw"]), med(t["engine"])
        sp, rp = send["engines"][name]["peak"], recv["engines"][name]["peak"]
        out["engines"].append({
            "engine": name, "raw_s": raw_s, "raw_gbps": total / raw_s / 1e9, "s": s, "gbps": total / s / 1e9,
            "ratio_vs_raw": med(a / b for a, b in zip(t["raw"], t["engine"])),
            "round_ratios": [round(a / b, 3) for a, b in zip(t["raw"], t["engine"])],
            "send_peak_bytes": sp, "recv_peak_bytes": rp, "send_peak_buckets": sp / bucket,
            "recv_peak_buckets": rp / bucket})
    return out


def print_table(result: dict) -> None:
    """The figures of :func:`run` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = Table(title=f"transfer-library engines, {result['device']}, {result['n_tensors']} bf16 tensors, "
                        f"{result['size_bytes'] / mib:.0f} MiB, bucket {result['bucket_bytes'] / mib:g} MiB")
    for col in ("engine", "raw GB/s (kimi: read)", "engine GB/s", "engine / raw", "send peak MiB (buckets)",
                "recv peak MiB (buckets)"):
        table.add_column(col, justify="right")
    for r in result["engines"]:
        table.add_row(r["engine"], f"{r['raw_gbps']:.2f}", f"{r['gbps']:.2f}", f"{r['ratio_vs_raw']:.2f}",
                      f"{r['send_peak_bytes'] / mib:.0f} ({r['send_peak_buckets']:.2f})",
                      f"{r['recv_peak_bytes'] / mib:.0f} ({r['recv_peak_buckets']:.2f})")
    Console(width=150).print(table)

