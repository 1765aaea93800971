"""LoRA updates into hal's rollout adapter (issue 48): the base once, then the adapter alone, applied by peft
unmerged, so the rollout computes exactly what the trainer's model does; an adapter that does not fit is refused
naming what, with the previous adapter in service; verl's two-call shape and hal's one-update shape both work."""

from __future__ import annotations

import asyncio

import pytest
import torch

import ckpt
from ckpt.lora import LoraRolloutAdapter, TensorHolder, is_adapter_tensor, plain_peft_config
from ckpt.testing import same_bytes

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from hal.apps.weightsync import models  # noqa: E402 - after the skips: it needs transformers

PRESET = "qwen2.5-tiny"
DTYPE = torch.bfloat16


class Trainer:
    """A peft LoRA model (rank ``r``) on the tiny preset in bf16; ``step()`` moves every adapter weight."""

    def __init__(self, r: int = 8, targets="all-linear") -> None:
        base = models.causal_lm(PRESET, DTYPE, seed=0)
        self.base = [(n, t.detach().clone()) for n, t in ckpt.serving.named_weights(base)]
        self.model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=16, target_modules=targets),
                                         autocast_adapter_dtype=False)
        self.peft_config = plain_peft_config(self.model.peft_config["default"])
        self.generator = torch.Generator().manual_seed(5)
        self.prompt = models.prompt_ids(PRESET)

    @torch.no_grad()
    def step(self) -> None:
        for name, p in self.model.named_parameters():
            if is_adapter_tensor(name):
                p.add_(torch.randn(p.shape, generator=self.generator).to(p.dtype) * 0.2)

    def adapter(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.detach().clone()) for n, t in peft.get_peft_model_state_dict(self.model).items()]

    def decode(self):
        return models.greedy_decode(self.model.get_base_model(), self.prompt, 4)


def served() -> LoraRolloutAdapter:
    return LoraRolloutAdapter(models.causal_lm(PRESET, DTYPE, seed=None))


def publish(adapter, weights, step, peft_config, base_sync_done):
    async def go():
        async def stream():
            for item in weights:
                yield item
        await adapter.update_weights(stream(), step, peft_config=peft_config, base_sync_done=base_sync_done)
    asyncio.run(go())


def decode(adapter: LoraRolloutAdapter, prompt):
    return models.greedy_decode(adapter.module, prompt, 4)


def test_the_base_once_then_adapters_alone_serve_the_trainers_model_exactly():
    trainer, rollout = Trainer(), served()
    assert rollout.needs_base and rollout.served_step is None
    trainer.step()
    publish(rollout, trainer.base + trainer.adapter(), 1, trainer.peft_config, False)  # hal's shape: one update
    assert not rollout.needs_base and rollout.served_step == 1
    for step in (2, 3):
        trainer.step()
        publish(rollout, trainer.adapter(), step, trainer.peft_config, True)
        assert rollout.served_step == step
        tokens, logits = decode(rollout, trainer.prompt)
        want_tokens, want_logits = trainer.decode()
        assert tokens == want_tokens and torch.equal(logits, want_logits)  # unmerged: exact
    # the adapter in service under peft's own names, byte for byte
    got = rollout.state_dict(with_base=False)
    want = peft.get_peft_model_state_dict(trainer.model)
    assert list(got) == list(want) and len(got) == 28
    assert all(same_bytes(got[n], t) for n, t in want.items())
    assert set(rollout.state_dict()) == set(got) | {n for n, _ in trainer.base}


def test_verls_two_call_shape_base_then_adapter_is_taken():
    trainer, rollout = Trainer(), served()
    trainer.step()
    publish(rollout, trainer.base, 1, trainer.peft_config, False)  # verl: base_sync_done=False, the base alone
    assert not rollout.needs_base and rollout.served_step is None  # no adapter yet
    publish(rollout, trainer.adapter(), 1, trainer.peft_config, True)
    assert rollout.served_step == 1 and decode(rollout, trainer.prompt)[0] == trainer.decode()[0]


def test_an_adapter_without_a_base_is_refused():
    trainer, rollout = Trainer(), served()
    with pytest.raises(ckpt.CheckpointConfigError, match=r"serves no base; refused: the base \(base_sync_done=False\)"):
        publish(rollout, trainer.adapter(), 1, trainer.peft_config, True)
    assert rollout.needs_base and rollout.served_step is None


@pytest.mark.parametrize("case", ["rank", "targets", "shape", "unknown tensor", "unknown target"])
def test_an_adapter_that_does_not_fit_is_refused_naming_it_and_the_previous_stays(case):
    trainer, rollout = Trainer(), served()
    trainer.step()
    publish(rollout, trainer.base + trainer.adapter(), 1, trainer.peft_config, False)
    before = decode(rollout, trainer.prompt)
    config, weights = dict(trainer.peft_config), trainer.adapter()
    if case == "rank":
        other = Trainer(r=4)
        config, weights = other.peft_config, other.adapter()
        match = r"the adapter does not fit the served one: r 4 \(serves 8\); refused, the adapter of step 1 stays"
    elif case == "targets":
        config["target_modules"] = ["q_proj"]
        match = r"target_modules \['q_proj'\] \(serves \[.*'model.layers.1.self_attn.v_proj'\]\)"
    elif case == "shape":
        name, t = weights[0]
        weights[0] = (name, torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype))
        match = (r"tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': received torch.bfloat16 "
                 r"\(8, 129\), the rollout serves torch.bfloat16 \(8, 128\)")
    elif case == "unknown tensor":
        weights.append(("base_model.model.model.layers.0.mlp.nope.lora_A.weight", torch.zeros(8, 128, dtype=DTYPE)))
        match = r"received tensor 'base_model.model.model.layers.0.mlp.nope.lora_A.weight' is not among the 28"
    else:  # a fresh rollout, the first adapter names a module the model lacks
        rollout = served()
        config["target_modules"] = ["nope_proj"]
        with pytest.raises(ckpt.WeightMismatchError, match=r"target_modules \['nope_proj'\] do not fit the served "
                                                           r"model: Target modules \{'nope_proj'\} not found"):
            publish(rollout, trainer.base + weights, 1, config, False)
        assert rollout.adapter is None and not any("lora" in n for n, _ in rollout.module.named_parameters())
        return
    with pytest.raises(ckpt.WeightMismatchError, match=match):
        publish(rollout, weights, 2, config, True)
    assert rollout.served_step == 1
    tokens, logits = decode(rollout, trainer.prompt)
    assert tokens == before[0] and torch.equal(logits, before[1])


def test_a_lora_update_through_the_workers_and_the_colocated_engine():
    """verl's worker keywords: TrainerWorker on a TorchEngine of a peft model, CheckpointEngineWorker passing
    ``peft_config`` and ``base_sync_done`` to the adapter."""
    from engines import TorchEngine

    trainer, rollout = Trainer(), served()
    trainer.step()
    publish(rollout, trainer.base + trainer.adapter(), 1, trainer.peft_config, False)
    engine = TorchEngine(trainer.model, None, device="cpu")
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    sender, receiver = ckpt.TrainerWorker(engine, channel), ckpt.CheckpointEngineWorker(channel, rollout)
    with pytest.raises(ckpt.CheckpointConfigError, match="returned a peft_config .*pass base_sync_done"):
        asyncio.run(sender.update_weights(2))
    trainer.step()

    async def go():
        return await asyncio.gather(sender.update_weights(2, base_sync_done=True),
                                    receiver.update_weights(2, peft_config=trainer.peft_config, base_sync_done=True))
    assert asyncio.run(go())[1] == 2 and sender.peft_config["r"] == 8
    assert rollout.served_step == 2 and decode(rollout, trainer.prompt)[0] == trainer.decode()[0]
    base, config = engine.get_per_tensor_param(base_sync_done=False)
    names = [n for n, _ in base]
    assert config["r"] == 8 and "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("lora" in n or "base_layer" in n for n in names)


def test_tensor_holder_holds_the_tensors_themselves():
    p, b = torch.nn.Parameter(torch.ones(2)), torch.zeros(3)
    holder = TensorHolder([("a.b.weight", p), ("c", b)])
    assert holder.a.b.weight is p and holder.c is b
