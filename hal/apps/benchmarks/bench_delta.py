"""Delta weight sync vs full updates, side by side in one run, through the collective engine.

Two processes (1 trainer, 1 rollout) on one device kind (gloo on ``cpu``). The trainer publishes bf16
views into one flat buffer, each at a 64-byte aligned offset (as ``hal sync``'s trainer does; sizes from
:func:`hal.apps.benchmarks.bench_ckpt.tensor_sizes`); the rollout holds its own tensors. After the trainer
flips one bit of a given fraction of the values (0.5%, 2%, 10%, 50% by default) the same tensors are
published both ways:

* ``full``: ``send_weights`` of every tensor; the rollout copies each into its own tensor (``copy_``);
* ``delta``: :func:`ckpt.delta.delta_send` (diff against the host snapshot, verl ``delta_flush``
  flushes) and :func:`ckpt.delta.receive_delta` applying them in place, verified by per-tensor checksums.

Each timing runs from a barrier to a barrier (publish to applied on the rollout). Per fraction, ``rounds``
rounds each change the values then time delta and full once; the table gives medians and the median of
the per-round delta/full ratios. Also per round, on the trainer alone: ``read``, one pass comparing the
published buffer with a copy of it (``torch.ne`` on 64-bit words: one read of the weights and one of a
snapshot, the least any diff costs), the floor under the delta's time on this machine. The rollout's
tensors are checked against the trainer's at the end.

    hal bench --only delta --quick                    # 64 MiB
    hal bench --only delta --size-mb 1024
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

import hal
from hal.apps.benchmarks import timed_once
from hal.apps.benchmarks.ranks import free_ports, run_ranks

FRACTIONS = (0.005, 0.02, 0.1, 0.5)


def flat_views(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A zeroed flat uint8 buffer and ``("layer{i}.weight", bf16 view)`` pairs into it, the i-th of ``sizes[i]``
    bytes (even) at the next 64-byte aligned offset (``ckpt.layout``'s alignment, as ``hal sync`` publishes)."""
    from ckpt.layout import align

    offsets, end = [], 0
    for s in sizes:
        offsets.append(end)
        end = align(end + s)
    flat = torch.zeros(end, dtype=torch.uint8, device=device)
    return flat, [(f"layer{i}.weight", flat[o:o + s].view(torch.bfloat16)) for i, (o, s) in enumerate(zip(offsets, sizes))]


def change_fraction(flat: torch.Tensor, views: list[tuple[str, torch.Tensor]], fraction: float,
                    gen: torch.Generator) -> None:
    """Flip the lowest bit of ``fraction`` of each view's values, at random positions (in place)."""
    for _, t in views:
        bits = t.view(torch.int16)
        n = max(1, round(fraction * bits.numel()))
        idx = torch.randperm(bits.numel(), generator=gen)[:n].to(bits.device)
        bits[idx] ^= 1


def _rank(rank: int, world_size: int, ports: list[int], size_mb: int, fractions: list[float], device: str,
          rounds: int, bucket: int) -> dict:
    import zlib

    import ckpt
    from ckpt.delta import DeltaReceiver, DeltaSender, delta_send, receive_delta
    from hal.apps.benchmarks.bench_ckpt import tensor_sizes

    torch.set_num_threads(1)  # two ranks on one host: one core each
    dev = hal.bind_local_device(device)
    store = hal.connect_store("127.0.0.1", ports[0], rank, world_size, timeout=120)
    group = hal.new_group_from_store(store, rank, world_size, device=device, timeout=120, prefix="bench-delta")
    engine = ckpt.get_checkpoint_engine("collective", rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                        master_port=ports[1], bucket_size=bucket, device=device, timeout=300)
    flat, views = flat_views(tensor_sizes(size_mb << 20), dev)
    if rank == 0:
        gen = torch.Generator().manual_seed(0)
        for _, t in views:
            t.copy_(torch.randn(t.numel(), generator=gen).to(torch.bfloat16))
        params = dict(views)
        copy = torch.empty_like(flat)  # the read floor's "snapshot"
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

    engine.init_process_group()
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
    return {"rows": rows, "crc": crc, "snapshot_bytes": sender.snapshot_bytes, "n_tensors": len(views),
            "backend": hal.get_dist_backend(device)}


def run(size_mb: int = 64, device: str = "cpu", rounds: int = 3, bucket_mb: float = 16.0,
        fractions: tuple[float, ...] | list[float] = FRACTIONS) -> list[dict]:
    """Delta vs full at each changed fraction, in two spawned processes; returns one row per fraction.

    Each row: ``fraction`` (asked), ``changed`` (measured fraction of values changed), ``dense_bytes`` (a
    full update's bytes), ``sent_bytes`` (the delta's bytes on the wire: positions, values, specs),
    ``bytes_ratio`` (sent / dense), ``full_s``, ``delta_s`` (median seconds, publish to applied) and
    ``read_s`` (one read of the weights and of a snapshot, on the trainer), ``time_ratio`` and
    ``read_ratio`` (medians of the per-round delta/full and read/full ratios; < 1: faster than full), plus
    ``device``, ``backend``, ``size_bytes``, ``n_tensors``, ``snapshot_bytes`` (the trainer's snapshot).

    Raises:
        ValueError: a fraction outside (0, 1], or ``size_mb`` / ``rounds`` below 1.
        UsageError: a bucket size that is not positive (names ``--bucket-mb``).
        RuntimeError: the rollout's tensors differ from the trainer's at the end.
        ChildFailedError: a rank failed or passed its deadline (see :func:`hal.apps.benchmarks.ranks.run_ranks`).
    """
    from hal.apps.errors import mib_to_bytes

    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"fractions must be in (0, 1], got {list(fractions)}")
    if size_mb < 1 or rounds < 1:
        raise ValueError(f"size_mb and rounds must be >= 1, got size_mb={size_mb}, rounds={rounds}")
    bucket = mib_to_bytes(bucket_mb, "--bucket-mb")
    results = run_ranks(_rank, 2, free_ports(2), size_mb, list(fractions), device, rounds, bucket,
                        timeout=max(180.0, size_mb * 0.5 * rounds * len(fractions)), name="delta")
    send, recv = results[0], results[1]
    if send["crc"] != recv["crc"]:
        raise RuntimeError(f"the rollout's tensors differ from the trainer's after the run (CRC-32 "
                           f"{recv['crc']:#x} vs {send['crc']:#x})")
    med = statistics.median
    rows = []
    for row in send["rows"]:
        t = row["times"]
        rows.append({"device": device, "backend": send["backend"], "size_bytes": row["dense_bytes"],
                     "n_tensors": send["n_tensors"], "snapshot_bytes": send["snapshot_bytes"],
                     "fraction": row["fraction"], "changed": row["changed"], "dense_bytes": row["dense_bytes"],
                     "sent_bytes": row["sent_bytes"], "bytes_ratio": row["sent_bytes"] / row["dense_bytes"],
                     "full_s": med(t["full"]), "delta_s": med(t["delta"]), "read_s": med(t["read"]),
                     "time_ratio": med(d / f for d, f in zip(t["delta"], t["full"])),
                     "read_ratio": med(r / f for r, f in zip(t["read"], t["full"]))})
    return rows


def print_table(rows: list[dict]) -> None:
    """The rows of :func:`run` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    first = rows[0]
    table = Table(title=f"delta vs full, collective engine, {first['device']} ({first['backend']}), "
                        f"{first['n_tensors']} bf16 tensors, {first['size_bytes'] / mib:.0f} MiB "
                        f"(snapshot {first['snapshot_bytes'] / mib:.0f} MiB host)")
    for col in ("changed", "full MiB", "delta MiB", "bytes delta/full", "full ms", "delta ms", "time delta/full",
                "read ms", "read/full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['changed'] * 100:.2f}%", f"{r['dense_bytes'] / mib:.1f}", f"{r['sent_bytes'] / mib:.2f}",
                      f"{r['bytes_ratio']:.3f}", f"{r['full_s'] * 1e3:.0f}", f"{r['delta_s'] * 1e3:.0f}",
                      f"{r['time_ratio']:.2f}", f"{r['read_s'] * 1e3:.0f}", f"{r['read_ratio']:.2f}")
    Console(width=150).print(table)
    print("read: one pass comparing the published buffer with a snapshot (one read of each), on the trainer: "
          "the least a diff costs")
