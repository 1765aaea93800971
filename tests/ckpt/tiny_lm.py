"""A tiny transformers ``Qwen2ForCausalLM`` for the rollout-adapter tests: ckpt's tests build their own model
instead of borrowing ``hal sync``'s presets (an application above ckpt)."""

from __future__ import annotations

import torch
from torch import nn

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=0,
              eos_token_id=0)
"""Tied embeddings (one tensor behind two names), grouped-query attention, biases on q/k/v: Qwen2's layout."""


def causal_lm(dtype: torch.dtype, seed: int | None = 0) -> nn.Module:
    """The tiny model with parameters of ``dtype`` on the host: seeded normal weights (norms 1), or zeros
    (``seed=None``: a rollout before its first update)."""
    import transformers

    config = transformers.Qwen2Config(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0 if seed is None else seed)
    module = transformers.Qwen2ForCausalLM(config).to(dtype)
    if seed is None:
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
    return module.eval()


def prompt_ids(length: int = 8) -> torch.Tensor:
    """A fixed prompt: (1, length) int64 token ids."""
    return torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1234))


@torch.no_grad()
def greedy_decode(module: nn.Module, new_tokens: int = 4) -> tuple[list[int], torch.Tensor]:
    """Greedy decode after :func:`prompt_ids`, recomputing the whole sequence each step (no cache):
    ``(tokens, logits (new_tokens, vocab) float32)``."""
    ids, chosen, rows = prompt_ids(), [], []
    for _ in range(new_tokens):
        last = module(input_ids=ids).logits[0, -1]
        chosen.append(int(last.argmax()))
        rows.append(last.float())
        ids = torch.cat([ids, torch.tensor([[chosen[-1]]])], dim=1)
    return chosen, torch.stack(rows)
