"""The bucket plan and wire format, simulated without a process group: whatever the mix of tensors, a
receiver that copies each segment into its buffer sees every tensor byte-exact."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.bucket import ALIGN, plan_messages
from ckpt.layout import byte_view
from ckpt.wire import WireMessage
from ckpt.testing import same_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8, torch.float64]


def simulate(weights, bucket_size, threshold, stable=False):
    """Run the sender's plan and a receiver's reassembly through byte copies; return what it yields.
    ``stable``: pass the list itself (runs may be sent from their storage), else an iterator."""
    recv_buf = torch.zeros(bucket_size, dtype=torch.uint8)
    meta_buf = torch.zeros(64 << 10, dtype=torch.uint8)
    out, big = [], None
    for msg in plan_messages(weights if stable or not isinstance(weights, list) else iter(weights), 4, bucket_size, 64 << 10, torch.device("cpu"),
                             threshold):
        msg.meta.write(meta_buf)
        meta = WireMessage.read(meta_buf.clone())
        assert meta == msg.meta and meta.step == 4 and meta.bucket_size == bucket_size
        if meta.end:
            break
        chunk = meta.chunk
        if chunk is not None and chunk.start == 0:
            big = torch.zeros(chunk.nbytes, dtype=torch.uint8)
        dest = recv_buf if chunk is None else big[chunk.start:]
        covered = []
        for o, n, src in msg.segment_bytes():
            assert 0 <= o and o + n <= dest.numel()
            dest[o:o + n].copy_(src)
            covered.append((o, o + n))
        covered.sort()
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), f"overlapping segments {covered}"
        if chunk is None:
            for e in meta.entries:
                assert e.offset % e.torch_dtype.itemsize == 0
                assert any(a <= e.offset and e.offset + e.nbytes <= b for a, b in covered) or e.nbytes == 0
                out.append((e.name, byte_view(recv_buf, e.offset, e.torch_dtype, e.shape).clone()))
        elif chunk.last:
            out.append((chunk.name, byte_view(big, 0, chunk.torch_dtype, chunk.shape).clone()))
    return out


@st.composite
def tensor_mixes(draw):
    flat = torch.randint(0, 2, (1 << 20,), dtype=torch.uint8)  # 0/1 bytes: valid bools too
    pos, weights = 0, []
    for i in range(draw(st.integers(0, 25))):
        dtype = draw(st.sampled_from(DTYPES))
        size = torch.empty((), dtype=dtype).element_size()
        numel = draw(st.sampled_from([0, 1, 3, 17, 100, 700, 3000]))
        kind = draw(st.sampled_from(["view", "view", "own", "transposed", "scalar"]))
        if kind == "view":  # into the flat buffer, adjacent to the previous view unless a gap is drawn
            pos = -(-(pos + draw(st.sampled_from([0, 0, 8, 24]))) // size) * size  # next aligned position
            t = flat[pos:pos + numel * size].view(dtype)
            pos += numel * size
        elif kind == "own":
            t = flat[:numel * size].clone().view(dtype)
        elif kind == "transposed":
            t = flat[:max(numel, 1) * 2 * size].clone().view(dtype).view(2, -1).t()
        else:
            t = flat[:size].clone().view(dtype).view(())
        weights.append((f"t{i}", t))
    return weights


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(weights=tensor_mixes(), bucket_size=st.sampled_from([256, 1000, 4096, 1 << 16]),
       threshold=st.sampled_from([0, 64, 1024]), stable=st.booleans())
def test_any_mix_round_trips_byte_exact_through_the_plan(weights, bucket_size, threshold, stable):
    got = simulate(weights, bucket_size, threshold, stable)
    assert [n for n, _ in got] == [n for n, _ in weights]
    for (name, a), (_, b) in zip(weights, got):
        assert same_bytes(a, b), name


def test_packed_tensors_share_one_segment_and_runs_fill_from_the_back():
    flat = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    big_run = [(f"v{i}", flat[i * 1024:(i + 1) * 1024].view(torch.float32)) for i in range(4)]  # 4 KiB run
    small = [(f"s{i}", torch.full((10,), float(i))) for i in range(3)]
    weights = [small[0], *big_run[:2], small[1], *big_run[2:], small[2]]
    (msg, _end) = list(plan_messages(weights, 1, 1 << 16, 64 << 10, torch.device("cpu"), 1024))
    segs = [(s.offset, s.nbytes) for s in msg.meta.segments]
    assert segs[0][0] == 0 and msg.sources[0] is None  # one packed segment for all three small tensors
    assert len(segs) == 3 and all(s is not None for s in msg.sources[1:])  # each 2 KiB run from its storage
    assert segs[1][0] + segs[1][1] <= 1 << 16 and segs[2][0] + segs[2][1] <= segs[1][0]
    assert segs[0][1] <= segs[2][0] and segs[0][1] < 3 * 40 + 3 * ALIGN


def _reusing_one_staging_buffer(values, numel):
    """A sender that writes every tensor into one staging buffer and yields a view of it (vLLM 43163)."""
    staging = torch.empty(numel)
    for i, value in enumerate(values):
        staging.fill_(value)
        yield f"w{i}", staging


@pytest.mark.parametrize("bucket_size, numel", [(4096, 16), (4096, 75), (300, 75), (300, 200), (1 << 16, 1000)])
@pytest.mark.parametrize("threshold", [0, 64])
def test_each_tensor_is_taken_when_it_is_yielded_from_a_reused_staging_buffer(bucket_size, numel, threshold):
    """Issue 20 (vLLM 43163/43464): without copying at yield time, a 4 KiB bucket delivered w0..w4 all equal
    to the last value, and tensors larger than a bucket (300 bytes) arrived shifted by one tensor."""
    values = [float(i + 1) for i in range(5)]
    got = simulate_stream(_reusing_one_staging_buffer(values, numel), bucket_size, threshold)
    assert [n for n, _ in got] == [f"w{i}" for i in range(5)]
    assert [t.unique().tolist() for _, t in got] == [[v] for v in values]


def simulate_stream(stream, bucket_size, threshold):
    """:func:`simulate` for a generator consumed as a sender consumes it: each message handled before the
    next tensor is asked for."""
    return simulate(_Once(stream), bucket_size, threshold)


class _Once:
    """An iterable that is not a collection (so nothing may be sent from the caller's memory later)."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        return self.stream
