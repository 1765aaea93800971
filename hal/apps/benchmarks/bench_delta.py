"""Delta weight sync vs full updates, side by side in one run, through the collective engine.

Two processes (1 trainer, 1 rollout). The trainer publishes bf16 views into one flat, 64-byte aligned buffer;
after it flips one bit of a fraction of the values (0.5%, 2%, 10%, 50%) the same tensors go both ways: ``full``
(``send_weights``, the rollout copies each tensor) and ``delta`` (:func:`ckpt.delta.delta_send` and
:func:`ckpt.delta.receive_delta`, checksummed). Timings run barrier to barrier; medians over ``rounds``. Also
on the trainer: ``read`` (one compare pass over the buffer, the floor under the delta) and the diff pass alone
against a memcpy of the same bytes. ``link_gbit`` runs the two ranks in network namespaces joined by emulated
links (:mod:`hal.apps.links`; root), as links between nodes are about 100x slower than device memory.

    hal bench --only delta --quick                               # 64 MiB over loopback
    hal bench --only delta --link-gbit 1 --size-mb 256           # over emulated 1 Gbit/s links
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

import hal
from hal.apps.benchmarks import timed_once
from ckpt.manager import join_engine
from hal.apps.benchmarks.ranks import launcher_store, run_ranks
from hal.apps.links import MAX_LINK_GBIT

FRACTIONS = (0.005, 0.02, 0.1, 0.5)
# diff passes timed per fraction (at least): medians of per-pass ratios, and the fastest of each (timeit)
DIFF_REPEATS = 7
# the ranks' store's port on the trainer's emulated address (private namespaces: no clash)
STORE_PORT = 29541


def flat_views(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A zeroed flat uint8 buffer and ``("layer{i}.weight", bf16 view)`` pairs into it, 64-byte aligned."""
    from ckpt.layout import align

    offsets, end = [], 0
    for s in sizes:
        offsets.append(end)
        end = align(end + s)
    flat = torch.zeros(end, dtype=torch.uint8, device=device)
    return flat, [(f"layer{i}.weight", flat[o:o + s].view(torch.bfloat16)) for i, (o, s) in enumerate(zip(offsets, sizes))]


def pick_positions(views: list[tuple[str, torch.Tensor]], fraction: float, gen: torch.Generator) -> list[torch.Tensor]:
    """For each view, ``fraction`` of its value positions (at least one), distinct, drawn at random."""
    picked = []
    for _, t in views:
        n = max(1, round(fraction * t.numel()))
        picked.append(torch.randperm(t.numel(), generator=gen)[:n].to(t.device))
    return picked


def flip(views: list[tuple[str, torch.Tensor]], positions: list[torch.Tensor]) -> None:
    """Flip the lowest bit of each view's values at ``positions`` in place (twice restores them)."""
    for (_, t), idx in zip(views, positions):
        bits = t.view(torch.int16)
        bits[idx] ^= 1


def change_fraction(flat: torch.Tensor, views: list[tuple[str, torch.Tensor]], fraction: float,
                    gen: torch.Generator) -> None:
    """Flip the lowest bit of ``fraction`` of each view's values, at random positions (in place)."""
    flip(views, pick_positions(views, fraction, gen))


def _rank(rank: int, world_size: int, size_mb: int, fractions: list[float], device: str, rounds: int,
          bucket: int) -> dict:
    """A loopback rank: :func:`_measure` on 127.0.0.1, through the launcher's store."""
    return _measure(rank, world_size, "127.0.0.1", launcher_store(), size_mb, fractions, device, rounds, bucket,
                    300.0)


def _link_rank(rank: int, world_size: int, net, endpoints: list[str], plan: dict) -> dict:
    """A rank in its own network namespace (entered before any socket), then :func:`_measure`."""
    net.enter(endpoints[rank])
    addr = net.address(endpoints[0])
    store = hal.connect_store(addr, STORE_PORT, rank, world_size, timeout=120)
    return _measure(rank, world_size, addr, store, plan["size_mb"], plan["fractions"], plan["device"],
                    plan["rounds"], plan["bucket"], plan["timeout_s"])


def _measure(rank: int, world_size: int, addr: str, store, size_mb: int, fractions: list[float],
             device: str, rounds: int, bucket: int, timeout_s: float) -> dict:
    import zlib

    import ckpt
    from ckpt.delta import DeltaReceiver, DeltaSender, delta_send, receive_delta
    from hal.apps.benchmarks.bench_ckpt import tensor_sizes

    torch.set_num_threads(1)  # two ranks on one host: one core each
    dev = hal.set_device(device)
    group = hal.new_group_from_store(store, rank, world_size, device=device, timeout=timeout_s, prefix="bench-delta")
    engine = ckpt.get_checkpoint_engine("collective", is_master=rank == 0, master_addr=addr, bucket_size=bucket,
                                        device=device, timeout=timeout_s)
    join_engine(engine, rank, world_size, store, "delta")
    flat, views = flat_views(tensor_sizes(size_mb << 20), dev)
    if rank == 0:
        gen = torch.Generator().manual_seed(0)
        for _, t in views:
            t.copy_(torch.randn(t.numel(), generator=gen).to(torch.bfloat16))
        params = dict(views)
        copy = torch.empty_like(flat)  # the read floor's "snapshot", the diff pass's memcpy target
    else:
        params = {n: torch.zeros_like(t) for n, t in views}
    sender = DeltaSender(flush_bytes=max(1, bucket // 2), device=device)
    receiver = DeltaReceiver(params, atomic=False)
    step = [0]
    stats = []

    async def full_once():
        if rank == 0:
            await engine.send_weights(iter(views), step[0])
        else:
            async for name, t in engine.receive_weights(step[0]):
                params[name].copy_(t)

    async def delta_once():
        if rank == 0:
            stats.append(await delta_send(engine, views, step[0], sender))
        else:
            await receive_delta(engine, receiver, step[0])

    def run(fn):
        step[0] += 1
        return timed_once(group, lambda: asyncio.run(fn()))

    def read_floor() -> float:
        copy.copy_(flat)
        t0 = time.perf_counter()
        torch.ne(flat.view(torch.int64), copy.view(torch.int64))
        hal.synchronize(device)
        return time.perf_counter() - t0

    run(full_once)   # warm-up: buffers and first transfers outside the timings
    run(delta_once)  # the seed
    rows = []
    change = torch.Generator().manual_seed(1)
    for fraction in fractions:
        times: dict[str, list[float]] = {"full": [], "delta": [], "read": []}
        for _ in range(rounds):
            if rank == 0:
                change_fraction(flat, views, fraction, change)
            times["delta"].append(run(delta_once))
            times["full"].append(run(full_once))
            times["read"].append(read_floor() if rank == 0 else 0.0)
        row = {"fraction": fraction, "times": times}
        if rank == 0:
            last = stats[-rounds:]
            row.update(changed=statistics.median(s.changed_fraction for s in last),
                       dense_bytes=last[-1].dense_bytes, sent_bytes=int(statistics.median(s.sent_bytes for s in last)))
        rows.append(row)
    crc = zlib.crc32(b"".join(params[n].detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes()
                              for n, _ in views))
    engine.close()
    group.close()
    if rank == 0:  # the diff pass alone, now that the rollout has been checked (the snapshot moves on)
        for row, fraction in zip(rows, fractions):
            positions = pick_positions(views, fraction, change)
            row["diff"] = [diff_pass(sender, views, positions, flat, copy, step, device)
                           for _ in range(max(rounds, DIFF_REPEATS))]
    return {"rows": rows, "crc": crc, "snapshot_bytes": sender.snapshot_bytes, "n_tensors": len(views),
            "backend": hal.get_dist_backend(device)}


def diff_pass(sender, views: list[tuple[str, torch.Tensor]], positions: list[torch.Tensor], flat: torch.Tensor,
              copy: torch.Tensor, step: list[int], device: str) -> tuple[float, ...]:
    """Flip the values at ``positions``, then time a memcpy of ``flat`` into ``copy``, the sender's whole pass
    (no transport) and another memcpy, by wall clock and thread CPU time.

    Returns ``(diff s, memcpy s (mean of two), diff CPU s, memcpy CPU s)``.
    """
    flip(views, positions)

    def timed(fn) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        hal.synchronize(device)
        return time.perf_counter() - t0, time.thread_time() - c0

    def memcpy() -> None:
        copy.copy_(flat)

    def sender_pass() -> None:
        step[0] += 1
        for _ in sender.flushes(views, step[0]):
            pass

    before = timed(memcpy)
    diff = timed(sender_pass)
    sender.commit()
    after = timed(memcpy)
    return diff[0], (before[0] + after[0]) / 2, diff[1], (before[1] + after[1]) / 2


def run(size_mb: int = 64, device: str = "cpu", rounds: int = 3, bucket_mb: float = 16.0,
        fractions: tuple[float, ...] | list[float] = FRACTIONS, link_gbit: float | None = None) -> list[dict]:
    """Delta vs full at each changed fraction, in two processes; returns one row per fraction.

    A row: ``fraction``, ``changed``, ``dense_bytes``, ``sent_bytes``, ``wire_fraction``, ``full_s``, ``delta_s``,
    ``read_s`` (median seconds), ``delta_vs_full`` and ``read_ratio`` (< 1: faster than full), ``diff_s``,
    ``memcpy_s``, ``diff_vs_memcpy`` (``_best``, ``_cpu``), and the run's facts. ``link_gbit``: over emulated
    links of that many Gbit/s, ``None``: loopback.
    """
    from hal.apps.errors import mib_to_bytes

    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"fractions must be in (0, 1], got {list(fractions)}")
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got size_mb={size_mb}, rounds={rounds}")
    if link_gbit is not None and not 0 < link_gbit <= MAX_LINK_GBIT:
        raise ValueError(f"link_gbit must be in (0, {MAX_LINK_GBIT:g}] Gbit/s, got {link_gbit!r}")
    bucket = mib_to_bytes(bucket_mb, "--bucket-mb")
    if link_gbit is None:
        results = run_ranks(_rank, 2, size_mb, list(fractions), device, rounds, bucket,
                            timeout=max(180.0, size_mb * 0.5 * rounds * len(fractions)))
    else:
        results = _over_links(size_mb, list(fractions), device, rounds, bucket, link_gbit)
    send, recv = results[0], results[1]
    if send["crc"] != recv["crc"]:
        raise RuntimeError(f"the rollout's tensors differ from the trainer's after the run (CRC-32 "
                           f"{recv['crc']:#x} vs {send['crc']:#x})")
    med = statistics.median
    rows = []
    for row in send["rows"]:
        t = row["times"]
        diff, memcpy, diff_cpu, memcpy_cpu = (list(col) for col in zip(*row["diff"]))
        rows.append({"device": device, "backend": send["backend"], "size_bytes": row["dense_bytes"],
                     "n_tensors": send["n_tensors"], "snapshot_bytes": send["snapshot_bytes"], "link_gbit": link_gbit,
                     "fraction": row["fraction"], "changed": row["changed"], "dense_bytes": row["dense_bytes"],
                     "sent_bytes": row["sent_bytes"], "wire_fraction": row["sent_bytes"] / row["dense_bytes"],
                     "full_s": med(t["full"]), "delta_s": med(t["delta"]), "read_s": med(t["read"]),
                     "delta_vs_full": med(d / f for d, f in zip(t["delta"], t["full"])),
                     "read_ratio": med(r / f for r, f in zip(t["read"], t["full"])),
                     "diff_s": med(diff), "memcpy_s": med(memcpy),
                     "diff_vs_memcpy": med(d / m for d, m in zip(diff, memcpy)),
                     "diff_vs_memcpy_best": min(diff) / min(memcpy),
                     "diff_vs_memcpy_cpu": med(d / m for d, m in zip(diff_cpu, memcpy_cpu))})
    return rows


def _over_links(size_mb: int, fractions: list[float], device: str, rounds: int, bucket: int,
                link_gbit: float) -> dict[int, dict]:
    """The two ranks in network namespaces joined by links of ``link_gbit`` Gbit/s; their results by rank."""
    from hal.apps.links import emulated_network, links_available
    from hal.apps.multiprocess import run_multiprocess

    ok, reason = links_available()
    if not ok:
        raise RuntimeError(f"the delta benchmark over --link-gbit needs emulated links: {reason}")
    rate = link_gbit * 1e9
    update_s = (size_mb << 20) * 8 / rate  # one full update on the link
    updates = 2 + 2 * rounds * len(fractions)  # the warm-up and the seed, then full and delta per round
    plan = {"size_mb": size_mb, "fractions": fractions, "device": device, "rounds": rounds, "bucket": bucket,
            "timeout_s": max(60.0, 4 * update_s + 30)}
    endpoints = ["trainer", "rollout"]
    with emulated_network({e: rate for e in endpoints}) as net:
        return run_multiprocess(_link_rank, len(endpoints), net, endpoints, plan,
                                timeout=180 + 3 * updates * update_s + size_mb * 0.5 * rounds * len(fractions))


def print_table(rows: list[dict]) -> None:
    """The rows of :func:`run` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    first = rows[0]
    wire = "loopback" if first.get("link_gbit") is None else f"emulated {first['link_gbit']:g} Gbit/s links"
    table = Table(title=f"delta vs full, collective engine over {wire}, {first['device']} ({first['backend']}), "
                        f"{first['n_tensors']} bf16 tensors, {first['size_bytes'] / mib:.0f} MiB "
                        f"(snapshot {first['snapshot_bytes'] / mib:.0f} MiB host)")
    for col in ("changed", "full MiB", "delta MiB", "wire fraction", "full ms", "delta ms", "delta/full",
                "read ms", "read/full", "diff ms", "memcpy ms", "diff/memcpy", "(fastest)", "(CPU time)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['changed'] * 100:.2f}%", f"{r['dense_bytes'] / mib:.1f}", f"{r['sent_bytes'] / mib:.2f}",
                      f"{r['wire_fraction']:.3f}", f"{r['full_s'] * 1e3:.0f}", f"{r['delta_s'] * 1e3:.0f}",
                      f"{r['delta_vs_full']:.2f}", f"{r['read_s'] * 1e3:.0f}", f"{r['read_ratio']:.2f}",
                      f"{r['diff_s'] * 1e3:.0f}", f"{r['memcpy_s'] * 1e3:.0f}", f"{r['diff_vs_memcpy']:.2f}",
                      f"{r['diff_vs_memcpy_best']:.2f}", f"{r['diff_vs_memcpy_cpu']:.2f}")
    Console(width=170).print(table)
    print("read: one pass comparing the published buffer with a snapshot (one read of each), on the trainer: "
          "the least a diff costs; diff: the sender's whole pass over an update (diff, snapshot, checksums, "
          "flushes; no transport) against one memcpy of the same bytes, on the trainer, one thread")
