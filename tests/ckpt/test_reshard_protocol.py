"""The resharding protocol (ckpt.reshard.transfer) in one process over an in-process channel with gloo's
matching rules (tests/ckpt/reshard_fake.py): odd shapes and buckets, and failure paths."""

import asyncio
import random
import time

import pytest
import torch

import ckpt
from ckpt.reshard import Region, RolloutLayout, Slice, chunk_range, held_parts
from ckpt.reshard.transfer import receive_update, send_update
from tests.ckpt.reshard_fake import FakeChannel, Hub


def _random_model(rng: random.Random) -> dict[str, torch.Tensor]:
    shapes = [(), (1,), (7,), (13, 3), (5, 1), (1, 9), (17, 5), (3, 4, 5), (0, 4), (4, 0), (2, 33)]
    out = {}
    for i, shape in enumerate(rng.sample(shapes, k=rng.randint(3, len(shapes)))):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float16])
        out[f"t{i}"] = (torch.randn(shape) * 100).to(dtype)
    return out


def _sender_parts(model, senders: int, rank: int, noncontig: bool) -> list:
    out = []
    for name, t in model.items():
        if t.dim() == 0:
            if rank == 0:
                out.append((name, t))
            continue
        a, b = ckpt.dim0_rows(t.shape[0], senders, rank)
        local = t[a:b].clone()
        if noncontig and local.dim() == 2 and local.shape[0] > 1 and local.shape[1] > 1:
            local = local.t().contiguous().t()  # same values, column-major
        out.append((name, ckpt.RowShard(local, a, tuple(t.shape))))
    return out


def _tp_layout(model, tp: int, rank: int, rng: random.Random, fuse: bool) -> RolloutLayout:
    """Each tensor split along a random dim (uneven chunks), some of the 2-d ones fused by rows into one target."""
    slices, fused, at = [], [], 0
    for name, t in model.items():
        full = tuple(t.shape)
        offsets, sizes = [0] * len(full), list(full)
        if full and rng.random() < 0.8:
            dim = rng.randrange(len(full))
            a, b = chunk_range(full[dim], tp, rank)
            offsets[dim], sizes[dim] = a, b - a
        region = Region(tuple(offsets), tuple(sizes))
        if fuse and len(full) == 2 and full[1] == 3 and t.dtype == torch.float32:
            fused.append((name, full, region))
            continue
        slices.append(Slice(name, full, region, name, tuple(sizes), (0,) * len(full), t.dtype))
    if fused:
        width = fused[0][2].sizes[1]
        fused = [f for f in fused if f[2].sizes[1] == width]
        rows = sum(r.sizes[0] for _, _, r in fused)
        for name, full, region in fused:
            slices.append(Slice(name, full, region, "fused", (rows, width), (at, 0), torch.float32))
            at += region.sizes[0]
    return RolloutLayout(slices)


def _expected(model, layout: RolloutLayout) -> dict[str, torch.Tensor]:
    out = {t: torch.zeros(shape, dtype=dtype) for t, (shape, dtype) in layout.targets.items()}
    for s in layout.slices:
        out[s.target][s.dest.index()] = model[s.name][s.region.index()]
    return out


async def _one_update(hub, channels, senders, layouts, model, step, bucket, noncontig=False, asked=None):
    async def send(rank):
        parts = held_parts(_sender_parts(model, senders, rank, noncontig))
        await send_update(channels[rank], rank, layouts, parts, step, bucket)

    async def recv(rank):
        got = {}
        async for name, t in receive_update(channels[rank], rank, list(range(senders)), layouts[rank],
                                            step if asked is None else asked, None):
            got[name] = t.clone()
        return got

    results = await asyncio.gather(*[send(r) for r in range(senders)], *[recv(r) for r in layouts],
                                   return_exceptions=True)
    return dict(zip(list(range(senders)) + list(layouts), results))


@pytest.mark.parametrize("seed", range(40))
def test_random_shapes_splits_and_tiny_buckets_deliver_exact_bytes(seed):
    """Holds: uneven and empty shards, 0-d/1-d/3-d tensors, zero-size dims, mixed dtypes, column splits, fused
    targets, non-contiguous sources, buckets barely above a row, several updates on one channel set."""
    rng = random.Random(seed)
    senders, tp = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 4])
    hub = Hub()
    channels = {r: FakeChannel(hub, r) for r in range(senders + tp)}
    model: dict[str, torch.Tensor] = {}
    for step in (1, 2, 3):
        model = _random_model(random.Random(seed * 10 + step)) if step == 1 or rng.random() < 0.5 else model
        layouts = {senders + r: _tp_layout(model, tp, r, random.Random(seed + step), fuse=rng.random() < 0.5)
                   for r in range(tp)}
        bucket = rng.choice([64, 128, 200, 1 << 10, 1 << 20])
        row_max = max((t.numel() // max(1, t.shape[0]) if t.dim() else 1) * t.element_size()
                      for t in model.values())
        bucket = max(bucket * (senders + tp), row_max * tp)  # send_update divides it among the rollout ranks
        results = asyncio.run(_one_update(hub, channels, senders, layouts, model, step, bucket,
                                          noncontig=rng.random() < 0.5))
        for r in range(senders):
            assert results[r] is None, (seed, step, results[r])
        for r, lay in layouts.items():
            got = results[r]
            assert not isinstance(got, BaseException), (seed, step, r, got)
            want = _expected(model, lay)
            assert sorted(got) == sorted(want), (seed, step, r)
            for t in want:
                assert torch.equal(got[t], want[t]), (seed, step, r, t)
        # what crossed each pair is exactly what the rollout keeps (plus the small messages)
        for r, lay in layouts.items():
            data = sum(n for s, d, n in hub.log if d == r and n not in (16,) and n != 4096)
            assert data >= lay.nbytes
        hub.log.clear()


def _simple(senders=2, tp=2):
    model = {"a": torch.arange(24, dtype=torch.float32).reshape(6, 4), "b": torch.arange(5, dtype=torch.float32)}
    layouts = {senders + r: _tp_layout(model, tp, r, random.Random(0), fuse=False) for r in range(tp)}
    hub = Hub()
    return model, layouts, hub, {r: FakeChannel(hub, r, timeout=2.0) for r in range(senders + tp)}


def test_sender_whose_weights_raise_tells_the_rollouts_at_once():
    """A sender whose weights raise sends an aborting head: the rollouts raise TransferAbortedError at once, as
    on the broadcast path (they waited out the whole timeout before)."""
    model, layouts, hub, channels = _simple()

    def broken():
        yield "a", ckpt.RowShard(model["a"][:3].clone(), 0, (6, 4))
        raise RuntimeError("trainer's iterator broke")

    async def main():
        async def send0():  # what the engines do when their weights raise
            try:
                parts = held_parts(broken())
            except RuntimeError as exc:
                await send_update(channels[0], 0, layouts, [], 1, 1 << 16, abort=exc)
                raise
            await send_update(channels[0], 0, layouts, parts, 1, 1 << 16)

        async def send1():
            parts = held_parts(_sender_parts(model, 2, 1, False))
            await send_update(channels[1], 1, layouts, parts, 1, 1 << 16)

        async def recv(r):
            async for _ in receive_update(channels[r], r, [0, 1], layouts[r], 1, None):
                pass

        start = time.monotonic()
        out = await asyncio.gather(send0(), send1(), recv(2), recv(3), return_exceptions=True)
        return out, time.monotonic() - start

    (s0, s1, r2, r3), elapsed = asyncio.run(main())
    assert isinstance(s0, RuntimeError)
    assert isinstance(r2, ckpt.TransferAbortedError) and isinstance(r3, ckpt.TransferAbortedError), (r2, r3)
    assert elapsed < 1.0, elapsed


def test_early_aclose_drains_and_the_senders_finish():
    """aclose() after the first tensor drains the rest (the senders succeed)."""
    model, layouts, hub, channels = _simple()

    async def main():
        async def send(r):
            await send_update(channels[r], r, layouts, held_parts(_sender_parts(model, 2, r, False)), 1, 128 * 4)

        async def recv_early(r):
            stream = receive_update(channels[r], r, [0, 1], layouts[r], 1, None)
            async for _ in stream:
                break
            await stream.aclose()

        async def recv(r):
            async for _ in receive_update(channels[r], r, [0, 1], layouts[r], 1, None):
                pass

        return await asyncio.gather(send(0), send(1), recv_early(2), recv(3), return_exceptions=True)

    assert asyncio.run(main()) == [None, None, None, None]


def test_a_refusing_rollout_rank_and_an_accepting_one_see_the_same_update():
    """What the protocol does when one TP rank refuses (another step asked) and the other accepts: the accepting
    one receives the whole update and the senders raise for the refusing one. All-or-nothing across the server
    then rests on the adapter's ``agree`` hook alone (tests/ckpt/test_reshard_faults.py)."""
    model, layouts, hub, channels = _simple()

    async def main():
        async def send(r):
            await send_update(channels[r], r, layouts, held_parts(_sender_parts(model, 2, r, False)), 1, 1 << 12)

        async def recv(r, asked):
            got = {}
            async for n, t in receive_update(channels[r], r, [0, 1], layouts[r], asked, None):
                got[n] = t.clone()
            return got

        return await asyncio.gather(send(0), send(1), recv(2, 1), recv(3, 7), return_exceptions=True)

    s0, s1, r2, r3 = asyncio.run(main())
    assert isinstance(r3, ckpt.VersionMismatchError)
    assert isinstance(s0, ckpt.TransferError) and "rollout rank 3 refused" in str(s0)
    assert sorted(r2) == ["a", "b"]  # rank 2 got the whole update of a step rank 3 refused
