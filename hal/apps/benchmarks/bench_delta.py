"""Delta weight sync vs full updates, side by side in one run, through the collective engine.

Two processes (1 trainer, 1 rollout) on one device kind (gloo on ``cpu``). The same bf16 tensors (the
log-uniform mix of :mod:`hal.apps.benchmarks.bench_ckpt`) are published both ways after the trainer flips
one bit of a given fraction of the values (0.5%, 2%, 10%, 50% by default):

* ``full``: ``send_weights`` of every tensor; the rollout copies each into its own tensor (``copy_``);
* ``delta``: :func:`ckpt.delta.delta_send` (diff against the host snapshot, verl ``delta_flush``
  flushes) and :func:`ckpt.delta.receive_delta` applying them in place with per-tensor checksums.

Each timing runs from a barrier to a barrier (publish to applied on the rollout). Per fraction, ``rounds``
rounds each change the values then time delta and full once; the table gives medians and the median of
the per-round delta/full ratios. The rollout's tensors are checked against the trainer's at the end.

    python -m hal.apps.benchmarks.bench_delta                          # 64 MiB, cpu (gloo)
    python -m hal.apps.benchmarks.bench_delta --size-mb 256 --device npu-sim
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics

import torch
import tyro

import hal
from hal.apps.benchmarks import emit, timed_once

FRACTIONS = (0.005, 0.02, 0.1, 0.5)


@dataclasses.dataclass
class Args:
    size_mb: int = 64
    """Total bytes of the bf16 tensor mix, in MiB."""
    fractions: list[float] = dataclasses.field(default_factory=lambda: list(FRACTIONS))
    """Fractions of the values changed per update (0 < f <= 1)."""
    device: str = "cpu"
    """Device kind (``cpu``/gloo, ``npu-sim``/sim hccl, ``cuda``/nccl, ``npu``/hccl)."""
    rounds: int = 3
    """Timed repetitions per fraction (median reported)."""
    bucket_mb: float = 16.0
    """The collective engine's bucket size, in MiB (delta flushes are closed at half of it)."""
    json: bool = False
    """Print the rows as JSON instead of a table."""


def change_fraction(tensors: list[tuple[str, torch.Tensor]], fraction: float, gen: torch.Generator) -> None:
    """Flip the lowest bit of ``fraction`` of each tensor's values, at random positions (in place)."""
    for _, t in tensors:
        flat = t.view(-1).view(torch.int16)
        n = max(1, round(fraction * flat.numel()))
        idx = torch.randperm(flat.numel(), generator=gen)[:n].to(flat.device)
        flat[idx] ^= 1


def _rank(rank: int, world_size: int, port: int, size_mb: int, fractions: list[float], device: str,
          rounds: int, bucket: int) -> dict:
    import zlib

    import ckpt
    from ckpt.delta import DeltaReceiver, DeltaSender, delta_send, receive_delta
    from hal.apps.benchmarks.bench_ckpt import tensor_sizes

    torch.set_num_threads(1)
    dev = hal.bind_local_device(device)
    store = hal.connect_store("127.0.0.1", port, rank, world_size, timeout=120)
    group = hal.new_group_from_store(store, rank, world_size, device=device, timeout=120, prefix="bench-delta")
    engine = ckpt.get_checkpoint_engine("collective", rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                        master_port=port + 1, bucket_size=bucket, device=device, timeout=300)
    gen = torch.Generator().manual_seed(0)
    tensors = [(f"layer{i}.weight", torch.randn(s // 2, generator=gen).to(torch.bfloat16).to(dev))
               for i, s in enumerate(tensor_sizes(size_mb << 20))]
    if rank:
        tensors = [(n, torch.zeros_like(t)) for n, t in tensors]
    params = dict(tensors)
    sender = DeltaSender(flush_bytes=max(1, bucket // 2), device=device)
    receiver = DeltaReceiver(params, atomic=False)
    step = [0]
    stats = []

    async def full_once():
        if rank == 0:
            await engine.send_weights(iter(tensors), step[0])
        else:
            async for name, t in engine.receive_weights(step[0]):
                params[name].copy_(t)

    async def delta_once():
        if rank == 0:
            stats.append(await delta_send(engine, tensors, step[0], sender))
        else:
            await receive_delta(engine, receiver, step[0])

    def run(fn):
        step[0] += 1
        return timed_once(group, lambda: asyncio.run(fn()))

    engine.init_process_group()
    run(full_once)   # warm-up: buffers and first transfers outside the timings
    run(delta_once)  # the seed
    rows = []
    change = torch.Generator().manual_seed(1)
    for fraction in fractions:
        times: dict[str, list[float]] = {"full": [], "delta": []}
        for _ in range(rounds):
            if rank == 0:
                change_fraction(tensors, fraction, change)
            times["delta"].append(run(delta_once))
            times["full"].append(run(full_once))
        row = {"fraction": fraction, "times": times}
        if rank == 0:
            last = stats[-rounds:]
            row.update(changed=statistics.median(s.changed_fraction for s in last),
                       dense_bytes=last[-1].dense_bytes, sent_bytes=int(statistics.median(s.sent_bytes for s in last)))
        rows.append(row)
    crc = zlib.crc32(b"".join(t.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes()
                              for _, t in sorted(params.items())))
    engine.close()
    group.close()
    return {"rows": rows, "crc": crc, "snapshot_bytes": sender.snapshot_bytes, "n_tensors": len(tensors),
            "backend": hal.get_dist_backend(device)}


def bench_delta(size_mb: int = 64, fractions: tuple[float, ...] | list[float] = FRACTIONS, device: str = "cpu",
                rounds: int = 3, bucket_mb: float = 16.0) -> list[dict]:
    """Delta vs full at each changed fraction, in two spawned processes; returns one row per fraction.

    Each row: ``fraction`` (asked), ``changed`` (measured fraction of values changed), ``dense_bytes`` (a
    full update's bytes), ``sent_bytes`` (the delta's bytes on the wire: positions, values, specs),
    ``bytes_ratio`` (sent / dense), ``full_s`` and ``delta_s`` (median seconds, publish to applied),
    ``time_ratio`` (median of the per-round delta/full time ratios; < 1: delta is faster), plus ``device``,
    ``backend``, ``size_bytes``, ``n_tensors``, ``snapshot_bytes`` (the trainer's snapshot, host memory).

    Raises:
        ValueError: a fraction outside (0, 1], or ``rounds`` < 1.
        RuntimeError: the rollout's tensors differ from the trainer's at the end.
        hal.testing.MultiprocessError: a rank failed.
    """
    from hal.apps.errors import mib_to_bytes
    from hal.testing import run_multiprocess

    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise ValueError(f"fractions must be in (0, 1], got {list(fractions)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    bucket = mib_to_bytes(bucket_mb, "--bucket-mb")
    results = run_multiprocess(_rank, 2, size_mb, list(fractions), device, rounds, bucket,
                               timeout=max(180.0, size_mb * 0.5 * rounds * len(fractions)))
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
                     "full_s": med(t["full"]), "delta_s": med(t["delta"]),
                     "time_ratio": med(d / f for d, f in zip(t["delta"], t["full"]))})
    return rows


def print_table(rows: list[dict]) -> None:
    """The rows of :func:`bench_delta` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    first = rows[0]
    table = Table(title=f"delta vs full, collective engine, {first['device']} ({first['backend']}), "
                        f"{first['n_tensors']} bf16 tensors, {first['size_bytes'] / mib:.0f} MiB "
                        f"(snapshot {first['snapshot_bytes'] / mib:.0f} MiB host)")
    for col in ("changed", "full MiB", "delta MiB", "bytes delta/full", "full ms", "delta ms", "time delta/full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['changed'] * 100:.2f}%", f"{r['dense_bytes'] / mib:.1f}", f"{r['sent_bytes'] / mib:.2f}",
                      f"{r['bytes_ratio']:.3f}", f"{r['full_s'] * 1e3:.0f}", f"{r['delta_s'] * 1e3:.0f}",
                      f"{r['time_ratio']:.2f}")
    Console(width=150).print(table)


def main(args: Args | None = None) -> list[dict]:
    args = args or tyro.cli(Args)
    rows = bench_delta(args.size_mb, args.fractions, args.device, args.rounds, args.bucket_mb)
    return emit(rows, args.json, print_table)


if __name__ == "__main__":
    main()
