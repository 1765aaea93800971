"""The delta engine's one-pass C loops (ckpt.delta.kernel, issue 31) give the bits of the torch path.

The sender's diff on host memory (positions, values, dense decisions, NaN rule, checksums, snapshot) is
compared, region by region and flush by flush, with :func:`ckpt.delta.diff.diff_segment_torch` (the diff as
it was before the C loop) on random cases: NaN payloads, -0.0, bf16 / fp16 / fp32 / fp64 / float8 / int /
bool tensors, tensors whose bytes are no multiple of 8, views of one flat buffer with padding that changes,
views starting mid-word, tensors that turn dense on count, on NaN, after a sample that misjudged them. The
running checksums updated from the changed positions equal a full recomputation; verl's flush hash computed
on integer views equals ``torch.hash_tensor``; the rollout's sparse apply matches the torch path and
refuses a position outside the tensor the same way.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from ckpt.delta import DeltaChecksumError, DeltaReceiver, DeltaSender, kernel
from ckpt.delta.checksum import tensor_parts
from ckpt.delta.diff import Segment, bits, diff_segment_kernel, diff_segment_torch, seed_segment, segments
from ckpt.delta.wire import decode_spec, flush_checksum, value_hash

AVAILABLE, REASON = kernel.status()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"the delta C loops are not built here: {REASON}")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


def random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``n`` values of ``dtype`` with random bits (NaN payloads, subnormals, infinities and signed zeros
    included), plus some -0.0 and +0.0 planted for the floating ones."""
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool)
    t = raw.view(dtype)
    if dtype.is_floating_point and n > 4:
        t[: n // 4] = (torch.randn(n // 4, generator=gen) * 3).to(dtype)  # ordinary values too
        t[1], t[2] = -0.0, 0.0
    return t


def perturb(flat: torch.Tensor, fraction: float, gen: torch.Generator, nan: bool) -> None:
    """Change about ``fraction`` of ``flat``'s bytes (a byte may change to itself), and, with ``nan``, plant
    NaN payloads, a sign flip of a zero, and a whole-word change."""
    raw = flat.view(torch.uint8).view(-1)
    k = int(fraction * raw.numel())
    if k:
        idx = torch.randint(0, raw.numel(), (k,), generator=gen)
        raw[idx] = torch.randint(0, 256, (k,), dtype=torch.uint8, generator=gen)
    if nan and raw.numel() >= 16:
        i = int(torch.randint(0, raw.numel() - 8, (1,), generator=gen))
        raw[i:i + 8] = torch.tensor([0xFF, 0x7F, 0xC1, 0xFF, 0x00, 0x80, 0x81, 0x7F], dtype=torch.uint8)


def layout(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat buffer holding 64-byte aligned views of odd lengths (one region, padding between them),
    views starting mid-word, and standalone tensors whose bytes are no multiple of 8, a large one (the
    sampled path of the C loop) among them."""
    es = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, 3, 7, 1000, 37, 9000]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = (end + n * es + 63) // 64 * 64
    flat = torch.zeros(end + 64, dtype=torch.uint8)
    flat.copy_(random_bits(flat.numel(), torch.uint8, gen))
    views = {f"aligned{i}": flat[o:o + n * es].view(dtype) for i, (o, n) in enumerate(zip(offsets, sizes))}
    odd = random_bits(5003, dtype, gen)
    views["mid_word0"], views["mid_word1"] = odd[1:1001], odd[1001:5003]
    for n in (1, 5, 1003, 40_003):
        views[f"own{n}"] = random_bits(n, dtype, gen)
    return flat, views


def same_diffs(a, b, where: str) -> None:
    assert len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{where}, tensor {i}: {x} vs {y}"
            continue
        assert (x.changed, x.dense, x.parts) == (y.changed, y.dense, y.parts), f"{where}, tensor {i}"
        if not x.dense:
            assert torch.equal(x.positions, y.positions.to(torch.int32)), f"{where}, tensor {i}: positions"
            assert torch.equal(bits(x.values), bits(y.values)), f"{where}, tensor {i}: values"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_one_pass_diff_equals_the_torch_diff_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(31)
    flat, views = layout(dtype, gen)
    segs = segments(list(views.items()))
    assert any(len(s.names) > 1 for s in segs)  # the flat buffer's views are one region
    snap_k = [torch.empty_like(s.words) for s in segs]
    snap_t = [torch.empty_like(s.words) for s in segs]
    parts_k = [seed_segment(s, snap) for s, snap in zip(segs, snap_k)]
    parts_t = [seed_segment_torch(s, snap) for s, snap in zip(segs, snap_t)]
    assert parts_k == parts_t
    for step, (fraction, nan) in enumerate([(0.0, False), (0.001, False), (0.01, True), (0.05, True),
                                            (0.2, False), (0.6, True), (1.0, False), (0.003, True)]):
        for t in [flat, *(v for n, v in views.items() if not n.startswith("aligned"))]:
            perturb(t, fraction, gen, nan)
        segs = segments(list(views.items()))  # standalone odd-sized tensors are re-padded copies each time
        for i, seg in enumerate(segs):
            got = diff_segment_kernel(kernel.library(), seg, snap_k[i], parts_k[i])
            want = diff_segment_torch(seg, snap_t[i], parts_t[i], pin=False)
            same_diffs(got, want, f"step {step}, region {seg.names}")
            assert torch.equal(snap_k[i], snap_t[i]) and torch.equal(snap_k[i], seg.words), f"step {step}"
            for j, (d, t) in enumerate(zip(got, seg.tensors)):
                if d is not None:
                    parts_k[i][j] = parts_t[i][j] = d.parts
                # the running checksum, updated from the changed positions only, is the full recomputation
                assert parts_k[i][j] == torch_parts(t), f"step {step}, {seg.names[j]}"


@contextlib.contextmanager
def torch_path():
    """The torch/numpy paths for the duration (``HAL_DELTA_KERNEL=off``)."""
    old = os.environ.get(kernel.ENV)
    os.environ[kernel.ENV] = "off"
    try:
        yield
    finally:
        if old is None:
            del os.environ[kernel.ENV]
        else:
            os.environ[kernel.ENV] = old


def seed_segment_torch(seg: Segment, snapshot: torch.Tensor) -> list[tuple[int, int]]:
    with torch_path():
        return seed_segment(seg, snapshot)


def torch_parts(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's checksum parts by the torch path (blocked reductions), read whole."""
    with torch_path():
        return tensor_parts(t)


def test_a_sample_that_misjudges_a_large_tensor_changes_nothing():
    """The C loop samples 64 evenly spaced words of a large tensor: changes only there make it count first
    and still send sparse; changes everywhere but there make it start sparse and turn dense mid-way."""
    n = 4 * 65_536  # bf16: 32768 words, a sample every 512 words
    base = (torch.randn(n) * 3).to(torch.bfloat16)
    for case in ("only at the samples", "everywhere but the samples"):
        t = base.clone()
        snap_k, snap_t = torch.empty(n // 4, dtype=torch.int64), torch.empty(n // 4, dtype=torch.int64)
        seg = segments([("w", t)])[0]
        parts = seed_segment(seg, snap_k)
        seed_segment_torch(seg, snap_t)
        w = bits(t).view(-1, 4)  # one row per 64-bit word
        sampled = torch.zeros(n // 4, dtype=torch.bool)
        sampled[torch.arange(64) * (n // 4 // 64)] = True
        if case == "only at the samples":
            w[sampled] ^= 1  # all 4 lanes of 64 words: the sample says "all changed"
        else:
            w[~sampled] ^= 1  # the sample sees nothing
        got = diff_segment_kernel(kernel.library(), seg, snap_k, parts)
        want = diff_segment_torch(seg, snap_t, parts, pin=False)
        same_diffs(got, want, case)
        assert got[0].dense == (case != "only at the samples") and torch.equal(snap_k, snap_t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.uint8], ids=str)
def test_senders_with_and_without_the_c_loops_send_the_same_flushes(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    flat, views = layout(dtype, gen)
    fast, slow = DeltaSender(device="cpu", flush_bytes=8 << 10), DeltaSender(device="cpu", flush_bytes=8 << 10)
    served = {n: torch.zeros_like(t) for n, t in views.items()}
    receiver = DeltaReceiver(served, atomic=False)
    for step in range(1, 7):
        if step > 1:
            for t in [flat, *(v for n, v in views.items() if not n.startswith("aligned"))]:
                perturb(t, (0.002, 0.02, 0.3, 0.01, 0.9)[step - 2], gen, nan=step % 2 == 0)
        monkeypatch.delenv(kernel.ENV, raising=False)
        got = list(fast.flushes(views.items(), step))
        fast.commit()
        monkeypatch.setenv(kernel.ENV, "off")
        want = list(slow.flushes(views.items(), step))
        slow.commit()
        monkeypatch.delenv(kernel.ENV)
        assert len(got) == len(want), step
        for (g, g_last), (w, w_last) in zip(got, want):
            assert g_last == w_last and [k for k, _ in g] == [k for k, _ in w]
            assert decode_spec(g[0][1]) == decode_spec(w[0][1]), step  # params, checksums, verl's flush hash
            for (key, a), (_, b) in zip(g[1:], w[1:]):
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (step, key)
            receiver.apply_flush(g, g_last)
        assert receiver.served_step == step
        assert all(torch.equal(served[n].view(torch.uint8), t.contiguous().view(torch.uint8))
                   for n, t in views.items()), step


HASH_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
               torch.int64, torch.uint8, torch.bool]  # bool: handed to torch (a byte other than 0/1 hashes as 1)


@pytest.mark.parametrize("dtype", HASH_DTYPES, ids=str)
def test_verls_flush_hash_on_integer_views_equals_torch_hash_tensor(dtype):
    """value_hash (no float64 upcast) equals torch.hash_tensor (the upcast verl's decoders compute) on random
    bits: NaN payloads and subnormals (handed to torch), infinities, signed zeros, odd and even counts."""
    gen = torch.Generator().manual_seed(11)
    for n in list(range(1, 20)) + [1000, 4097]:
        for _ in range(3):
            t = random_bits(n, dtype, gen)
            assert value_hash(t) == int(torch.hash_tensor(t).item()) & (2**64 - 1), (dtype, n)
        if dtype.is_floating_point:
            normal = (torch.randn(n, generator=gen) * 100).to(dtype)
            normal[: n // 3] = 0.0
            assert value_hash(normal) == int(torch.hash_tensor(normal).item()), (dtype, n)
    if dtype in (torch.bfloat16, torch.float16, torch.float32):  # more NaN payloads than are picked out one by one
        many = (torch.randn(3 * kernel.ODD_CAP, generator=gen) * 100).to(dtype)
        raw = many.view({2: torch.int16, 4: torch.int32}[many.element_size()])
        raw[::2] |= {torch.bfloat16: 0x7F81, torch.float16: 0x7C01, torch.float32: 0x7F800001}[dtype]
        assert value_hash(many) == int(torch.hash_tensor(many).item())
    positions = torch.randint(0, 256, (4 * 999,), dtype=torch.uint8, generator=gen)
    values = random_bits(999, dtype, gen)
    verl_like = int(torch.hash_tensor(positions).item()) ^ (int(torch.hash_tensor(values).item()) << 1)
    assert flush_checksum(positions, values) == verl_like


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64], ids=str)
def test_the_rollouts_one_pass_apply_equals_the_torch_path(dtype, atomic, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    weights = {"a": random_bits(4099, dtype, gen), "b": random_bits(17, dtype, gen)}
    sender = DeltaSender(device="cpu")
    served = {mode: {n: torch.zeros_like(t) for n, t in weights.items()} for mode in ("c", "torch")}
    receivers = {mode: DeltaReceiver(served[mode], atomic=atomic) for mode in served}
    for step in range(1, 6):
        if step > 1:
            for t in weights.values():
                perturb(t, 0.01 * step, gen, nan=False)
        flushes = list(sender.flushes(weights.items(), step))
        sender.commit()
        for mode, receiver in receivers.items():
            if mode == "torch":
                monkeypatch.setenv(kernel.ENV, "off")
            for named, last in flushes:
                receiver.apply_flush(named, last)
            monkeypatch.delenv(kernel.ENV, raising=False)
            assert receiver.served_step == step
            assert all(torch.equal(bits(served[mode][n]), bits(t)) for n, t in weights.items()), (mode, step)
        assert receivers["c"]._parts == receivers["torch"]._parts
        assert receivers["c"]._parts["a"] == torch_parts(weights["a"])


def test_a_position_outside_the_tensor_is_refused_before_anything_is_written():
    weights = {"w": torch.randn(64).to(torch.bfloat16)}
    sender = DeltaSender(device="cpu")
    served = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(served, atomic=False)
    for named, last in sender.flushes(weights.items(), 1):
        receiver.apply_flush(named, last)
    sender.commit()
    weights["w"][[3, 9]] += 1
    (named, last), = list(sender.flushes(weights.items(), 2))
    named = dict(named)
    spec = decode_spec(named["__delta_spec__"])
    assert spec["encoding"] == "indices"
    positions = named["__positions__"].clone()
    positions.view(torch.int32)[1] = 64  # one past the end
    spec["checksum"] = flush_checksum(positions, named["__values__"])  # verl's hash agrees: the layout is bad
    forged = [("__delta_spec__", torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)),
              ("__positions__", positions), ("__values__", named["__values__"])]
    before = served["w"].clone()
    with pytest.raises(DeltaChecksumError, match="positions outside its 64 values"):
        receiver.apply_flush(forged, last)
    assert torch.equal(bits(served["w"]), bits(before)) and receiver.needs_seed
