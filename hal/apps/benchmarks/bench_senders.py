"""An update's bandwidth with 1, 2 and 4 senders over emulated per-rank links (issue 22).

Each trainer rank and rollout runs in its own network namespace (:mod:`hal.apps.links`): trainer links at
``R``, rollout links at ``rollout_factor * R``. Every sender holds ``1/S`` of each tensor's rows (FSDP2's dim-0
shard) and sends it to every rollout, which receives each part into its slice of one flat bf16 buffer and
checks it byte for byte. One run measures S = 1, 2, 4 side by side, then the largest S with rollout links at
``R`` (the receivers then limit). Throughput: the update's bytes over barrier-to-barrier seconds. Needs root
and iproute2.

What moves the bytes is a :class:`SenderPath` named by ``path`` (``"module:factory"``): :class:`GlooP2PPath`
by default, :data:`CKPT_PATH` the collective engine's; the layout, timing, links and check stay here.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any, Protocol, Sequence

import torch


STORE_PORT = 29531  # on trainer rank 0's emulated address
DEFAULT_PATH = "hal.apps.benchmarks.bench_senders:GlooP2PPath"
CKPT_PATH = "hal.apps.benchmarks.senders_ckpt:ckpt_multi_sender_path"


# -- layout ---------------------------------------------------------------------------------------------------

def model_shapes(size_bytes: int) -> list[tuple[int, ...]]:
    """Shapes of a bf16 model of about ``size_bytes`` bytes (>= 1 MiB): 2-D weights of 1024 columns with row
    counts not multiples of 4 (uneven shards) and small 1-D vectors."""
    if size_bytes < 1 << 20:
        raise ValueError(f"size_bytes must be at least 1 MiB, got {size_bytes}")
    cols, weights = 1024, (4, 3, 2, 2, 1, 1, 1, 1)  # relative sizes, as attention / MLP projections
    rows_total = size_bytes // 2 // cols - 8
    shapes: list[tuple[int, ...]] = []
    for i, w in enumerate(weights):
        rows = max(5, rows_total * w // sum(weights) - (i % 3) - 1)
        shapes.append((rows, cols))
        if i % 2:
            shapes.append((1027 + i,))
    return shapes


def shard_rows(rows: int, senders: int, sender: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row tensor that sender ``sender`` of ``senders`` holds (``torch.chunk``)."""
    chunk = -(-rows // senders)
    start = min(rows, sender * chunk)
    return start, min(rows, start + chunk)


def shard_ranges(shapes: Sequence[tuple[int, ...]], senders: int, sender: int) -> list[tuple[int, int, int]]:
    """``(tensor index, start, stop)`` element ranges in the model's flat buffer of ``sender``'s non-empty shards."""
    out, offset = [], 0
    for i, shape in enumerate(shapes):
        row = 1
        for d in shape[1:]:
            row *= d
        r0, r1 = shard_rows(shape[0], senders, sender)
        if r1 > r0:
            out.append((i, offset + r0 * row, offset + r1 * row))
        offset += shape[0] * row
    return out


# -- the transfer: what an engine's multi-sender path replaces ------------------------------------------------

def _wait(work: Any, what: str, timeout_s: float) -> None:
    from hal import DistributedTimeoutError

    try:
        ok = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise DistributedTimeoutError(f"{what} failed or passed {timeout_s:g} s (a peer is dead or slow): {exc}") from exc
    if ok is False:
        raise DistributedTimeoutError(f"{what} did not complete within {timeout_s:g} s")


def send_shards(group: Any, parts: Sequence[tuple[int, torch.Tensor]], rollout_ranks: Sequence[int],
                timeout_s: float) -> None:
    """On a sender: send each ``(tensor index, shard)`` to every rollout, all posted at once; blocks until done
    (DistributedTimeoutError after ``timeout_s`` seconds)."""
    works = [(group.backend.send([part], dst, index), dst, index) for index, part in parts for dst in rollout_ranks]
    for work, dst, index in works:
        _wait(work, f"send of tensor {index} from rank {group.rank} to rollout rank {dst}", timeout_s)


def receive_shards(group: Any, views: Sequence[tuple[int, int, torch.Tensor]], timeout_s: float) -> None:
    """On a rollout: receive each ``(sender rank, tensor index, view)`` straight into ``view``, all posted at once;
    blocks until done (DistributedTimeoutError after ``timeout_s`` seconds)."""
    works = [(group.backend.recv([view], src, index), src, index) for src, index, view in views]
    for work, src, index in works:
        _wait(work, f"receive of tensor {index} on rank {group.rank} from sender rank {src}", timeout_s)


class SenderPath(Protocol):
    """What carries an update from S sender ranks to every rollout, built per rank by
    ``factory(group, rank, trainers, rollout_ranks, shapes, timeout_s)`` (``group``: a gloo ``hal.StoreGroup`` over
    every rank). Calls are made by every rank of a role between two timing barriers; one returns when its part is
    done and raises, naming the peer, rather than wait past ``timeout_s`` seconds.
    """

    def send(self, parts: Sequence[tuple[int, torch.Tensor]], senders: int) -> None:
        """On sender rank ``s``: publish ``(tensor index, shard)`` parts (rows ``shard_rows(rows, senders, s)``)."""

    def receive(self, views: Sequence[tuple[int, int, torch.Tensor]], senders: int) -> None:
        """On a rollout: land every ``(sender rank, tensor index, view)`` straight into ``view``."""

    def close(self) -> None:
        """Release what the path holds (after the last update)."""


class GlooP2PPath:
    """The default :class:`SenderPath`: gloo ``send``/``recv`` on the benchmark's group."""

    def __init__(self, group: Any, rank: int, trainers: int, rollout_ranks: Sequence[int],
                 shapes: Sequence[tuple[int, ...]], timeout_s: float) -> None:
        self.group, self.rollout_ranks, self.timeout_s = group, list(rollout_ranks), timeout_s

    def send(self, parts: Sequence[tuple[int, torch.Tensor]], senders: int) -> None:
        send_shards(self.group, parts, self.rollout_ranks, self.timeout_s)

    def receive(self, views: Sequence[tuple[int, int, torch.Tensor]], senders: int) -> None:
        receive_shards(self.group, views, self.timeout_s)

    def close(self) -> None:
        pass


def _load(path: str) -> Any:
    import importlib

    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"path must be 'module:factory', got {path!r}")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


# -- ranks ----------------------------------------------------------------------------------------------------

def _rank(rank: int, world_size: int, net: Any, endpoints: list[str], plan: dict) -> dict:
    import os

    import hal
    net.enter(endpoints[rank])  # before any socket or thread of this process
    os.environ["MASTER_ADDR"] = net.address(endpoints[0])  # where a path's own rendezvous (trainer rank 0) is
    trainers, rollouts = plan["trainers"], list(range(plan["trainers"], world_size))
    timeout_s = plan["timeout_s"]
    store = hal.connect_store(net.address(endpoints[0]), STORE_PORT, rank, world_size, timeout=timeout_s)
    group = hal.new_group_from_store(store, rank, world_size, device="cpu", timeout=timeout_s, prefix="senders")
    shapes = [tuple(s) for s in plan["shapes"]]
    numel = sum(torch.Size(s).numel() for s in shapes)
    full = torch.randn(numel, generator=torch.Generator().manual_seed(22), dtype=torch.float32).to(torch.bfloat16)
    is_rollout = rank in rollouts
    buffer = torch.empty_like(full) if is_rollout else None

    path = _load(plan["path"])(group, rank, trainers, rollouts, shapes, timeout_s)

    def transfer(senders: int) -> None:
        if is_rollout:
            views = [(s, i, buffer[a:b]) for s in range(senders) for i, a, b in shard_ranges(shapes, senders, s)]
            path.receive(views, senders)
        elif rank < senders:
            path.send(held, senders)

    times: dict[str, list[float]] = {}
    bad = torch.zeros(1)
    for phase in plan["phases"]:
        label, senders = phase["label"], phase["senders"]
        if phase.get("rollout_rate") is not None:
            group.barrier()
            if rank == 0:
                for r in rollouts:
                    net.set_rate(endpoints[r], phase["rollout_rate"])
            group.barrier()
        # the sender's own shards, as FSDP2 holds them (copies: no rank reads another's memory)
        held = [(i, full[a:b].clone()) for i, a, b in shard_ranges(shapes, senders, rank)] \
            if rank < senders and not is_rollout else []
        if is_rollout:
            buffer.zero_()
        group.barrier()
        t0 = time.perf_counter()
        transfer(senders)
        group.barrier()
        times.setdefault(label, []).append(time.perf_counter() - t0)
        if is_rollout and not torch.equal(buffer.view(torch.int16), full.view(torch.int16)):
            wrong = int((buffer.view(torch.int16) != full.view(torch.int16)).sum())
            bad[0] = 1
            print(f"rollout rank {rank}: {wrong} of {numel} elements differ after {label}", flush=True)
        group.all_reduce(bad)
        if bad.item():
            raise RuntimeError(f"a rollout received wrong bytes in {label} (see its line above)")
    path.close()
    group.close()
    return {"times": times, "bytes": numel * 2}


def _sender_label(senders: int) -> str:
    return f"{senders} sender" + ("s" if senders > 1 else "")


def bench_senders(size_mb: int = 32, rate_mbit: float = 100.0, rollout_factor: float = 4.0, rollouts: int = 2,
                  senders: Sequence[int] = (1, 2, 4), rounds: int = 2, rollout_limited: bool = True,
                  path: str = DEFAULT_PATH) -> dict:
    """Measure the update's throughput with each count in ``senders`` over emulated links (trainer links
    ``rate_mbit``, rollout links ``rollout_factor`` times that), plus the rollout-limited row.

    Returns ``{"path", "bytes", ..., "rows": [{"what", "senders", "s", "gbps", "ratio", "vs", ...}]}``: ``s`` the
    median seconds, ``ratio`` against 1 sender (rollout-limited row: against the link's rate).
    """
    from hal.apps.links import emulated_network, links_available
    from hal.apps.multiprocess import run_multiprocess

    senders = sorted(set(int(s) for s in senders))
    if not senders or senders[0] != 1 or senders[-1] > 64:
        raise ValueError(f"senders must include 1 and be counts in 1..64, got {senders}")
    if rollouts < 1 or rounds < 1 or not rate_mbit > 0 or not rollout_factor > 0:
        raise ValueError(f"need rollouts >= 1, rounds >= 1, rate_mbit > 0, rollout_factor > 0; got {rollouts}, "
                         f"{rounds}, {rate_mbit}, {rollout_factor}")
    _load(path)  # a bad name fails here, before any namespace or process
    ok, reason = links_available()
    if not ok:
        raise RuntimeError(f"bench_senders needs emulated links: {reason}")
    rate = rate_mbit * 1e6
    trainers = senders[-1]
    shapes = model_shapes(size_mb << 20)
    nbytes = 2 * sum(torch.Size(s).numel() for s in shapes)
    phases = []
    for r in range(rounds):
        for s in (senders if r % 2 == 0 else senders[::-1]):
            phases.append({"label": _sender_label(s), "senders": s})
    if rollout_limited:
        phases.append({"label": "rollout-limited", "senders": trainers, "rollout_rate": rate})
        phases += [{"label": "rollout-limited", "senders": trainers} for _ in range(rounds - 1)]
    # seconds the links allow: a sender's link carries its shard per rollout, a rollout's the whole update
    expect = sum(max(nbytes * 8 * rollouts / (rate * p["senders"]),
                     nbytes * 8 / (rate * (1 if p["label"] == "rollout-limited" else rollout_factor)))
                 for p in phases)
    plan = {"path": path, "trainers": trainers, "shapes": shapes, "phases": phases,
            "timeout_s": max(30.0, 4 * expect / len(phases))}
    endpoints = [f"t{i}" for i in range(trainers)] + [f"r{i}" for i in range(rollouts)]
    rates = {e: rate if e.startswith("t") else rate * rollout_factor for e in endpoints}
    with emulated_network(rates) as net:
        results = run_multiprocess(_rank, len(endpoints), net, endpoints, plan, timeout=120 + 3 * expect)
    times = results[0]["times"]
    med = statistics.median
    rows = []
    for s in senders:
        t = times[_sender_label(s)]
        rows.append({"what": _sender_label(s), "senders": s, "rollout_rate_bps": rate * rollout_factor,
                     "bytes": nbytes, "s": med(t), "gbps": nbytes / med(t) / 1e9,
                     "ratio": med(a / b for a, b in zip(times[_sender_label(1)], t)), "vs": "1 sender"})
    if rollout_limited:
        t = times["rollout-limited"]
        rows.append({"what": f"{_sender_label(trainers)}, rollout links R", "senders": trainers,
                     "rollout_rate_bps": rate, "bytes": nbytes, "s": med(t), "gbps": nbytes / med(t) / 1e9,
                     "ratio": nbytes / med(t) / (rate / 8), "vs": "R"})
    return {"path": path, "bytes": nbytes, "rate_bps": rate, "rollout_rate_bps": rate * rollout_factor,
            "rollouts": rollouts, "rounds": rounds, "rows": rows, "seconds": times}


def print_table(result: dict) -> None:
    """The figures of :func:`bench_senders` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"update over emulated links: {result['bytes'] / (1 << 20):.0f} MiB bf16 to "
                        f"{result['rollouts']} rollouts, trainer links R = {result['rate_bps'] / 1e6:g} Mbit/s, "
                        f"rollout links {result['rollout_rate_bps'] / 1e6:g} Mbit/s unless said")
    for col in ("what", "bytes", "time s", "GB/s", "Mbit/s", "ratio", "vs"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(row["what"], str(row["bytes"]), f"{row['s']:.2f}", f"{row['gbps']:.4f}",
                      f"{row['gbps'] * 8e3:.0f}", f"{row['ratio']:.2f}", row["vs"])
    Console(width=150).print(table)
