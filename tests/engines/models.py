"""Small deterministic models and losses shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH = 32, 16


class TiedLM(nn.Module):
    """Embedding tied to the output head, a LayerNorm, a buffer: every kind of tensor an offload must move."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.norm(h + self.mlp(h) * self.scale)
        return self.head(h)


def make_model(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 8), generator=g)
    targets = torch.randint(0, VOCAB, (4, 8), generator=g)
    return tokens.to(device), targets.to(device)


def loss_for(step: int, device: torch.device):
    tokens, targets = batch(step, device)

    def loss_fn(module: nn.Module) -> torch.Tensor:
        logits = module(tokens)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return loss_fn


def host_copy(named) -> dict[str, torch.Tensor]:
    """``{name: cpu clone}`` of ``(name, tensor)`` pairs, for bit comparisons."""
    return {n: t.detach().to("cpu").clone() for n, t in named}
