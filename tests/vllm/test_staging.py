"""Receive-verify before load (ckpt.vllm_transfer): what decides whether vLLM loads an update at all.

These need no vLLM (they run in both environments): a staged update is host copies with CRC-32s, and
verify_staged refuses anything incomplete, unexpected or corrupted.
"""

import asyncio
import zlib

import pytest
import torch

from ckpt.errors import WeightMismatchError
from ckpt.vllm_transfer import crc32_hex, stage_update, verify_staged

pytestmark = pytest.mark.timeout(60)


async def _stream(pairs, global_steps=None):
    for name, tensor in pairs:
        yield name, tensor


def _stage(pairs):
    return asyncio.run(asyncio.wait_for(stage_update(_stream(pairs), 7), 30))


def test_staged_update_is_host_copies_with_crc32_of_their_bytes():
    buffer = torch.arange(12, dtype=torch.float32)
    pairs = [("a", buffer[:6].view(2, 3)), ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
             ("c", torch.tensor(3, dtype=torch.int64)), ("empty", torch.empty(0, 4))]
    staged = _stage(pairs)
    buffer.zero_()  # the engine reuses its buffer after each item: the staged copies must not change
    assert [n for n, _ in staged.weights] == ["a", "b", "c", "empty"]
    assert staged.weights[0][1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert staged.global_steps == 7
    assert staged.nbytes == 6 * 4 + 2 * 2 + 8 + 0
    expected_a = f"{zlib.crc32(torch.arange(6, dtype=torch.float32).numpy().tobytes()) & 0xFFFFFFFF:08x}"
    assert staged.checksums["a"] == expected_a
    assert staged.checksums["b"] == crc32_hex(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert staged.checksums["empty"] == "00000000"


def test_a_name_twice_is_refused():
    with pytest.raises(WeightMismatchError, match="'a' arrived twice"):
        _stage([("a", torch.ones(2)), ("a", torch.ones(2))])


def test_verify_accepts_exactly_the_announced_update():
    staged = _stage([("a", torch.ones(3)), ("b", torch.zeros(2))])
    verify_staged(staged, dict(staged.checksums))
    verify_staged(staged, None)


@pytest.mark.parametrize("change, message", [
    (lambda e: e.update(a="deadbeef"), "'a': received checksum .* differs from the announced deadbeef"),
    (lambda e: e.update(c="00000000"), "lacks tensor 'c'"),
    (lambda e: e.pop("b"), "received tensor 'b' was not announced"),
])
def test_verify_refuses_a_corrupted_missing_or_unexpected_tensor(change, message):
    staged = _stage([("a", torch.ones(3)), ("b", torch.zeros(2))])
    expected = dict(staged.checksums)
    change(expected)
    with pytest.raises(WeightMismatchError, match=message):
        verify_staged(staged, expected)
