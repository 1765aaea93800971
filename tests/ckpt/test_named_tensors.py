"""ckpt.base.named_tensors: the one check every engine reads its weights through."""

import asyncio

import pytest
import torch

import ckpt
from ckpt.base import named_tensors
from ckpt.errors import CheckpointConfigError


def test_a_name_twice_is_refused_only_where_names_key_the_update():
    pairs = [("a", torch.ones(1)), ("a", torch.zeros(1))]
    assert [n for n, _ in named_tensors(pairs)] == ["a", "a"]
    with pytest.raises(CheckpointConfigError, match="tensor name 'a' appears twice in one update"):
        list(named_tensors(pairs, unique=True))


def test_the_file_engine_refuses_a_name_twice_and_publishes_nothing(tmp_path):
    engine = ckpt.get_checkpoint_engine("file", root=tmp_path / "root")
    with pytest.raises(CheckpointConfigError, match="tensor name 'a' appears twice in one update"):
        asyncio.run(engine.send_weights([("a", torch.ones(2)), ("a", torch.ones(2))], 1))
    assert not any(p.name.startswith("step-") for p in (tmp_path / "root").iterdir())


def test_the_delta_sender_refuses_a_name_twice():
    from ckpt.delta import DeltaSender

    sender = DeltaSender(flush_bytes=1 << 20, device="cpu")
    with pytest.raises(CheckpointConfigError, match="tensor name 'a' appears twice in one update"):
        list(sender.flushes([("a", torch.ones(2, dtype=torch.bfloat16)), ("a", torch.ones(2, dtype=torch.bfloat16))], 1))
