"""The collective checkpoint engine's multi-sender path as a :class:`~hal.apps.benchmarks.bench_senders.SenderPath`,
so ``bench_senders`` measures the engine (``multi_sender=True``: a lane per sender, parts received through a
``placement``), not raw gloo sends.

When the path is built, every rank forms one engine group per sender count ``S = 1..trainers`` through the
engine's own ``build_topology`` / ``init_process_group`` (store port ``STORE_PORT + 1 + S``). A round with ``S``
senders is one ``send_weights`` per sender and one ``receive_weights(placement=...)`` per rollout.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import torch

BUCKET_SIZE = 4 << 20  # bytes per bucket of the measured engines
META_CAPACITY = 8 << 10  # bytes of the per-message metadata record


class _Placement:
    """Where a rollout wants each full tensor: its slice of the benchmark's flat buffer."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        t = self.full.get(name)
        return t if t is not None and t.dtype == dtype and t.shape == shape else None


class CkptMultiSenderPath:
    """See the module docstring; the master address is ``MASTER_ADDR`` (trainer rank 0's)."""

    def __init__(self, group: Any, rank: int, trainers: int, rollout_ranks: Sequence[int],
                 shapes: Sequence[tuple[int, ...]], timeout_s: float) -> None:
        from ckpt.collective import CollectiveCheckpointEngine
        from ckpt.manager import rank_kwargs
        from hal.apps.benchmarks.bench_senders import STORE_PORT

        self.rank, self.trainers, self.shapes = rank, trainers, [tuple(s) for s in shapes]
        self.rollouts = list(rollout_ranks)
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            raise RuntimeError("ckpt_multi_sender_path needs MASTER_ADDR (trainer rank 0's address)")
        self.engines: dict[int, Any] = {}
        self.steps: dict[int, int] = {}
        is_rollout = rank in self.rollouts
        counts = [s for s in range(1, trainers + 1) if is_rollout or rank < s]
        for s in counts:
            self.engines[s] = CollectiveCheckpointEngine(
                is_master=rank == 0, master_addr=addr, master_port=STORE_PORT + 1 + s, device="cpu",
                timeout=timeout_s, bucket_size=BUCKET_SIZE, meta_capacity=META_CAPACITY, multi_sender=True)
        if rank == 0:
            for s in counts:  # host every group's store before anyone dials it
                self.engines[s].prepare()
        for s in counts:
            master = {"is_master": True, "master_addr": addr, "master_port": STORE_PORT + 1 + s, "generation": 0,
                      "joined": None, "multi_sender": True}
            engine = self.engines[s]
            per_rank = rank_kwargs(type(engine), s, len(self.rollouts), [master] + [{}] * (s - 1 + len(self.rollouts)))
            engine.init_process_group(**per_rank[s + self.rollouts.index(rank) if is_rollout else rank])
            self.steps[s] = 0

    def _step(self, senders: int) -> int:
        self.steps[senders] += 1
        return self.steps[senders]

    def send(self, parts: Sequence[tuple[int, torch.Tensor]], senders: int) -> None:
        """Publish this sender's dim-0 shards as :class:`ckpt.RowShard` values on group ``senders``."""
        from ckpt import RowShard, dim0_rows

        weights = [(f"w{i}", RowShard(part.view((-1,) + self.shapes[i][1:]),  # the benchmark's parts are flat
                                      dim0_rows(self.shapes[i][0], senders, self.rank)[0], self.shapes[i]))
                   for i, part in parts]
        if senders == 1:  # the one-sender topology takes whole tensors
            weights = [(name, shard.local) for name, shard in weights]
        asyncio.run(self.engines[senders].send_weights(weights, self._step(senders)))

    def receive(self, views: Sequence[tuple[int, int, torch.Tensor]], senders: int) -> None:
        """Receive group ``senders``' update into the full tensors the ``views`` belong to (parts in place)."""
        from ckpt import dim0_rows

        full: dict[str, torch.Tensor] = {}
        for sender, index, view in views:
            shape = self.shapes[index]
            if f"w{index}" in full:
                continue
            row = torch.Size(shape[1:]).numel()
            start = view.storage_offset() - dim0_rows(shape[0], senders, sender)[0] * row
            full[f"w{index}"] = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage(), start, shape)

        async def main() -> int:
            count = 0
            async for name, tensor in self.engines[senders].receive_weights(self._step(senders),
                                                                             placement=_Placement(full)):
                if tensor.data_ptr() != full[name].data_ptr():
                    full[name].copy_(tensor)
                count += 1
            return count

        got = asyncio.run(main())
        if got != len(full):
            raise RuntimeError(f"rollout rank {self.rank} received {got} tensors of {len(full)}")

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def ckpt_multi_sender_path(group: Any, rank: int, trainers: int, rollout_ranks: Sequence[int],
                           shapes: Sequence[tuple[int, ...]], timeout_s: float) -> CkptMultiSenderPath:
    """The ``SenderPath`` factory of the collective engine's multi-sender path (see the module docstring)."""
    return CkptMultiSenderPath(group, rank, trainers, rollout_ranks, shapes, timeout_s)


ROTATING_PATH = "hal.apps.benchmarks.senders_ckpt:rotating_broadcast_path"


def compare(size_mb: int = 32, rate_mbit: float = 100.0, rounds: int = 2, rollouts: int = 2,
            senders: Sequence[int] = (1, 2, 4), rotating: bool = False) -> dict[str, dict]:
    """Run :func:`~hal.apps.benchmarks.bench_senders.bench_senders` with the gloo path, then the engine's (and with
    ``rotating`` the rotating-source one), same sizes and links; returns each result by path name."""
    from hal.apps.benchmarks.bench_senders import CKPT_PATH, DEFAULT_PATH, bench_senders

    paths = [("gloo-p2p", DEFAULT_PATH), ("ckpt-multi-sender", CKPT_PATH)]
    if rotating:
        paths.append(("rotating-broadcast", ROTATING_PATH))
    return {label: bench_senders(size_mb, rate_mbit, rollouts=rollouts, senders=senders, rounds=rounds, path=path)
            for label, path in paths}


if __name__ == "__main__":
    import json
    import sys

    from hal.apps.benchmarks.bench_senders import print_table

    out = compare(*(int(a) for a in sys.argv[1:] if a.isdigit()), rotating="--rotating" in sys.argv)
    for label, result in out.items():
        print(label)
        print_table(result)
    print(json.dumps({label: [{k: r[k] for k in ("what", "s", "gbps", "ratio", "vs")} for r in res["rows"]]
                      for label, res in out.items()}))


class RotatingBroadcastPath:
    """One gloo group per sender count holding the senders and every rollout, the source rotating per bucket
    (``j mod S``), two broadcasts in flight; senders also receive the others' buckets, which the figures show."""

    def __init__(self, group: Any, rank: int, trainers: int, rollout_ranks: Sequence[int],
                 shapes: Sequence[tuple[int, ...]], timeout_s: float) -> None:
        import hal
        from hal.apps.benchmarks.bench_senders import STORE_PORT

        self.rank, self.shapes, self.rollouts = rank, [tuple(s) for s in shapes], list(rollout_ranks)
        addr = os.environ["MASTER_ADDR"]
        self.groups: dict[int, Any] = {}
        self.stores: list[Any] = []
        is_rollout = rank in self.rollouts
        for s in range(1, trainers + 1):
            if not (is_rollout or rank < s):
                continue
            world = s + len(self.rollouts)
            me = self.rollouts.index(rank) + s if is_rollout else rank
            store = hal.connect_store(addr, STORE_PORT + 20 + s, me, world, timeout_s)
            self.stores.append(store)
            self.groups[s] = (hal.new_group_from_store(store, me, world, "cpu", timeout_s, f"rotating{s}"), me)

    def _schedule(self, senders: int) -> list[tuple[int, int]]:
        """``(source, bytes)`` of every broadcast, in the order every member issues them."""
        from hal.apps.benchmarks.bench_senders import shard_ranges

        pieces = []
        for s in range(senders):
            total = 2 * sum(b - a for _, a, b in shard_ranges(self.shapes, senders, s))
            pieces.append([min(BUCKET_SIZE, total - o) for o in range(0, total, BUCKET_SIZE)])
        out, j = [], 0
        while any(pieces):
            s = j % senders
            if pieces[s]:
                out.append((s, pieces[s].pop(0)))
            j += 1
        return out

    def _run(self, senders: int, mine: torch.Tensor | None, land: torch.Tensor | None) -> None:
        group, me = self.groups[senders]
        scratch = [torch.empty(BUCKET_SIZE, dtype=torch.uint8) for _ in range(2)]
        offsets = [0] * senders
        pending: list[Any] = []
        for j, (src, nbytes) in enumerate(self._schedule(senders)):
            if len(pending) == 2:
                work, after = pending.pop(0)
                work.wait()
                after()
            start = offsets[src]
            offsets[src] += nbytes
            if src == me:
                buf = mine[start:start + nbytes]
                after = lambda: None  # noqa: E731 - a no-op callback, chosen per message beside the others
            else:
                buf = scratch[j % 2][:nbytes]
                if land is not None:
                    dest = land[src][start:start + nbytes]
                    after = lambda dest=dest, buf=buf: dest.copy_(buf)  # noqa: E731 - binds this message's buffers now
                else:
                    after = lambda: None  # noqa: E731 - a no-op callback, chosen per message beside the others
            pending.append((group.broadcast(buf, src, async_op=True), after))
        for work, after in pending:
            work.wait()
            after()

    def send(self, parts: Sequence[tuple[int, torch.Tensor]], senders: int) -> None:
        mine = torch.cat([p.reshape(-1) for _, p in parts]).view(torch.uint8) if parts else torch.empty(0, dtype=torch.uint8)
        self._run(senders, mine, None)

    def receive(self, views: Sequence[tuple[int, int, torch.Tensor]], senders: int) -> None:
        staged = {s: torch.cat([v.reshape(-1) for src, _, v in views if src == s]).view(torch.uint8)
                  for s in range(senders)}
        self._run(senders, None, staged)
        for s in range(senders):  # back into the views, in the same order they were concatenated
            flat, at = staged[s], 0
            for src, _, v in views:
                if src == s:
                    v.reshape(-1).view(torch.uint8).copy_(flat[at:at + v.numel() * 2])
                    at += v.numel() * 2

    def close(self) -> None:
        for group, _ in self.groups.values():
            group.close()


def rotating_broadcast_path(group: Any, rank: int, trainers: int, rollout_ranks: Sequence[int],
                            shapes: Sequence[tuple[int, ...]], timeout_s: float) -> RotatingBroadcastPath:
    """The ``SenderPath`` factory of :class:`RotatingBroadcastPath` (the measured alternative)."""
    return RotatingBroadcastPath(group, rank, trainers, rollout_ranks, shapes, timeout_s)
