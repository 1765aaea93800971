"""Throughput of the transfer-library checkpoint engines (``nixl``, ``mooncake``, ``kimi``) against their own library.

Two processes (1 trainer, 1 rollout) per engine, side by side: ``raw`` (one library transfer of the same bytes
between two registered regions: NIXL ``WRITE``, Mooncake ``transfer_sync_write``; kimi pulls, so a Mooncake
read) and ``engine`` (``send_weights`` / ``receive_weights`` of the bench_ckpt tensor mix, with each side's
peak memory against ``bucket_size``). Rounds alternate which goes first; ratios per round, medians. Run by
``hal bench --only sync`` for every such engine available on the kind, at the smallest ``--bucket-mb``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import uuid
import zlib
from typing import Any, Callable

import torch

import hal
from hal.apps.benchmarks import timed_once, transfer_once
from hal.apps.benchmarks.bench_ckpt import PeakMemory, tensor_sizes, tensor_views
from ckpt.manager import join_engine
from hal.apps.benchmarks.ranks import launcher_store, run_ranks
from hal.apps.errors import mib_to_bytes


def _bare_nixl(rank: int) -> Any:
    from ckpt.nixl import HOST_MEMORY_TYPE, NixlTransport

    return NixlTransport(f"bare-{rank}-{uuid.uuid4().hex[:12]}", HOST_MEMORY_TYPE, ("UCX",))


def _bare_mooncake(rank: int) -> Any:
    from ckpt.mooncake import HOST_PROTOCOL, MooncakeTransport

    return MooncakeTransport("127.0.0.1", HOST_PROTOCOL)


# An engine's library alone on host memory, its baseline: the engine's transport with no engine around it.
BARE_TRANSPORTS = {"nixl": _bare_nixl, "mooncake": _bare_mooncake, "kimi": _bare_mooncake}  # kimi pulls via Mooncake


def transfer_library_engines() -> list[str]:
    """The registered engines whose class says ``uses_transfer_library`` and whose library has a baseline here."""
    import ckpt

    return [e for e in ckpt.checkpoint_engines_where("uses_transfer_library") if e in BARE_TRANSPORTS]


def copy_sync(raw: Any, peer: int, nbytes: int, timeout: float, read: bool = False) -> None:
    """Copy the first ``nbytes`` of ``raw``'s registered region to ``peer``'s (``read``: from it), blocking.

    Mooncake: its own synchronous calls, as its users call them (bounded by Mooncake's transfer timeout, not
    ``timeout``); others: one write of the transport, waited for."""
    from ckpt.errors import TransferError
    from ckpt.mooncake import MooncakeTransport

    if isinstance(raw, MooncakeTransport):
        r = raw.remote[peer]
        name = "transfer_sync_read" if read else "transfer_sync_write"
        rc = getattr(raw.engine, name)(r["session"], raw.addr, r["addr"], nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake {name} of {nbytes} bytes with {r['session']} returned {rc}")
    elif read:
        raise NotImplementedError(f"{raw.library}: hal's transport only writes")
    else:
        asyncio.run(raw.wait(raw.start_write(peer, [(raw.addr, 0, nbytes)]), timeout))


def _bench_rank(rank: int, world_size: int, size_mb: int, bucket: int, device: str, rounds: int,
                engines: list[str]) -> dict:
    import ckpt

    torch.set_num_threads(1)
    dev = hal.set_device(device)  # one device per rank (LOCAL_RANK's)
    sizes = tensor_sizes(size_mb << 20)
    total = sum(sizes)
    store = launcher_store()
    group = hal.new_group_from_store(store, rank, world_size, device="cpu", timeout=300, prefix="bench")
    host = torch.zeros(total, dtype=torch.uint8)  # the raw transfers' region (touched: no page faults later)
    if rank == 0:
        host.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    flat = host.to(dev)  # host itself on a host kind
    views = tensor_views(flat, sizes)
    out = {"size_bytes": total, "n_tensors": len(sizes), "engines": {}}
    for name in engines:
        engine = ckpt.get_checkpoint_engine(name, is_master=rank == 0, master_addr="127.0.0.1", bucket_size=bucket,
                                            device=device, timeout=300)
        join_engine(engine, rank, world_size, store, name)
        raw_once, raw = _raw_once(name, rank, store, host)
        out["engines"][name] = _measure(engine, raw_once, rank, group, views, rounds)
        engine.close()
        raw.close()
    out["crc32"] = zlib.crc32(host.numpy().data)  # the raw writes delivered these bytes to the rollout
    group.close()
    return out


def _raw_once(name: str, rank: int, store, host: torch.Tensor) -> tuple[Callable[[], None], Any]:
    """One raw transfer of all of ``host`` by ``name``'s library between the two ranks, as a call, and the
    transport to close after; for an engine whose rollouts pull, the rollout reads."""
    import ckpt

    engine_class = ckpt.checkpoint_engine_factory(name)
    raw = BARE_TRANSPORTS[name](rank)
    store.set(f"raw/{name}/{rank}", json.dumps(raw.register(host)))
    raw.add_peer(1 - rank, json.loads(store.get(f"raw/{name}/{1 - rank}")))
    moves = 1 if engine_class.rollout_pulls else 0  # the rank that starts the transfer

    def once() -> None:
        if rank == moves:
            copy_sync(raw, 1 - rank, host.numel(), 300, read=engine_class.rollout_pulls)

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
        engines: list[str] | tuple[str, ...] | None = None) -> dict:
    """Measure in two spawned processes; ``bucket_mb``: the engines' bucket size in MiB (fractions allowed).

    Returns per engine ``raw_s``, ``s``, GB/s (1e9 bytes/s), ``ratio_vs_raw`` (median of per-round ``raw_s /
    engine_s``) and peak bytes per side.
    """
    bucket = mib_to_bytes(bucket_mb, "--bucket-mb")
    known = transfer_library_engines()
    engines = known if engines is None else engines
    bad = [e for e in engines if e not in known]
    if bad or not engines:
        raise ValueError(f"engines must be a non-empty subset of {known}, got {list(engines)}")
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got {size_mb}, {rounds}")
    results = run_ranks(_bench_rank, 2, size_mb, bucket, device, rounds, list(engines),
                        timeout=max(180.0, size_mb * 0.1 * (rounds + 2) * len(engines)))
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

