"""A stand-in trainer for the vLLM tests: transformers' Qwen2 (hal's ``qwen2.5-tiny`` preset) whose every
weight moves each step, published through hal's collective engine with the checksums ``hal sync`` announces."""

from __future__ import annotations

import torch

from ckpt.vllm_transfer import crc32_hex
from hal.apps.weightsync.models import causal_lm, greedy_decode, prompt_ids

PRESET = "qwen2.5-tiny"
"""hidden 128, 4 heads: head_dim 32, a head size vLLM's cpu attention backend accepts."""


class Trainer:
    """fp32 master weights; ``step(s)`` moves every floating-point weight by a seeded normal(0, 0.02)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.model = causal_lm(PRESET, torch.float32, seed=0)
        self.dtype = dtype
        self.prompt = prompt_ids(PRESET, length=8)

    def save(self, path) -> str:
        """The current weights as a Hugging Face directory (``config.json`` + safetensors), in ``self.dtype``."""
        self.model.to(self.dtype).save_pretrained(path)
        self.model.to(torch.float32)
        return str(path)

    @torch.no_grad()
    def step(self, global_steps: int) -> None:
        g = torch.Generator().manual_seed(1000 + global_steps)
        for _, p in self.model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)

    def published(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the published dtype, in ``named_parameters`` order (tied weights once)."""
        return [(n, p.detach().to(self.dtype).contiguous()) for n, p in self.model.named_parameters()]

    def checksums(self) -> dict[str, str]:
        return {n: crc32_hex(t) for n, t in self.published()}

    def reference_tokens(self, new_tokens: int) -> list[int]:
        """Greedy tokens of transformers' model on the published weights (in the published dtype)."""
        served = causal_lm(PRESET, self.dtype, seed=None)
        served.load_state_dict(dict(self.published()), strict=False)
        if served.config.tie_word_embeddings:
            served.lm_head.weight = served.model.embed_tokens.weight
        return greedy_decode(served, self.prompt, new_tokens)[0]
