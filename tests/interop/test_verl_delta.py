"""verl 0.9.1's own rollout-side decoder of ``delta_flush`` applies hal's flushes (issue 21, interop lane).

``verl.workers.rollout.sglang_rollout.delta_loader.apply_delta(model, named_tensors)`` (plain torch, the
loader verl registers into SGLang) receives what ``ckpt.delta.DeltaSender`` produces, carried through hal's
file engine and regrouped by ``receive_delta_flushes``, and must leave the model byte-exact with the
trainer's published bf16 tensors, NaN and -0.0 included, over a seed and the deltas that follow. hal's
per-tensor checksums ride in the spec under ``"hal"``, a key verl's decoder does not read.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import ckpt
from ckpt.delta import DeltaSender, delta_send, receive_delta_flushes
from ckpt.delta.wire import decode_spec
from tests.ckpt import delta_workers as w

delta_loader = pytest.importorskip("verl.workers.rollout.sglang_rollout.delta_loader",
                                   reason="verl 0.9.1 is not installed (the verl extra)")
verl_encode = pytest.importorskip("verl.checkpoint_engine.delta_sync.encode", reason="verl 0.9.1 is not installed")

pytestmark = pytest.mark.interop


class SGLangLikeModel(torch.nn.Module):
    """The rollout model verl's loader expects: SGLang's ``load_weights(weights)``, ending in ``param.copy_``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(tensors)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(t.clone(), requires_grad=False)
                                               for t in tensors.values()])

    def load_weights(self, weights) -> None:
        params = dict(zip(self.names, self.weights))
        with torch.no_grad():
            for name, loaded in weights:
                params[name].copy_(loaded)

    def served(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.names, self.weights)}


def test_verls_apply_delta_applies_hals_flushes_byte_exact(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=2)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=10)

    async def main():
        model, opt = w.make_trainer(0)
        sender = DeltaSender(flush_bytes=16 << 10, device="cpu")
        rollout = SGLangLikeModel(w.fresh_rollout("cpu"))
        seen = {"dense": 0, "indices": 0}
        fractions = []
        for step in range(1, 9):
            if step > 1:
                w.train_step(model, opt, step)
            weights = w.published(model, step)
            stats = await delta_send(writer, weights.items(), step, sender)
            fractions.append(stats.changed_fraction)
            async for named, _is_last in receive_delta_flushes(reader, step):
                spec = decode_spec(dict(named)["__delta_spec__"])
                seen[spec["encoding"]] += 1
                tensors = dict(named)
                assert verl_encode.checksum(tensors.get("__positions__", torch.empty(0, dtype=torch.uint8)),
                                            tensors["__values__"]) == spec["checksum"]
                delta_loader.apply_delta(rollout, named)
            served = rollout.served()
            bad = [n for n in weights if not torch.equal(weights[n].view(torch.int16), served[n].view(torch.int16))]
            assert not bad, f"step {step}: verl's decoder left {bad} different from the published bytes"
        return seen, fractions

    seen, fractions = asyncio.run(main())
    assert seen["dense"] >= 2 and seen["indices"] >= 7  # the seed and the NaN tensors dense, the rest sparse
    assert fractions[0] == 1.0 and all(0 < f < 0.2 for f in fractions[1:])


def test_verls_apply_delta_refuses_a_flipped_byte_too():
    weights = {"w": torch.randn(512).to(torch.bfloat16)}
    sender = DeltaSender(device="cpu")
    rollout = SGLangLikeModel({"w": torch.zeros(512, dtype=torch.bfloat16)})
    for named, _ in sender.flushes(weights.items(), 1):
        delta_loader.apply_delta(rollout, named)
    sender.commit()
    weights["w"][:10] += 1
    (named, _), = list(sender.flushes(weights.items(), 2))
    corrupted = [(n.rsplit("/", 1)[1], t) for n, t in
                 w.flip_one_byte([(f"__delta_flush__/0/{k}", t) for k, t in named])]
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        delta_loader.apply_delta(rollout, corrupted)
