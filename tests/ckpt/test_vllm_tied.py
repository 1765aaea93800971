"""The tied ``lm_head`` after a vLLM reload: tied again, and vLLM's warning about it kept out of the log
and a rotary embedding's cache (every verified update logged ``ParallelLMHead: Failed to load weights``); other
layers' warnings pass."""

import logging

import torch

from ckpt.vllm_transfer import LAYERWISE_LOGGER, reload_checkpoint_format


class ParallelLMHead(torch.nn.Module):  # the class name vLLM's warning carries
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class RotaryEmbedding(torch.nn.Module):  # a cache computed from the configuration: no checkpoint tensor
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.lm_head = ParallelLMHead(self.embed_tokens.weight)
        self.rotary = RotaryEmbedding()
        self.norm = torch.nn.LayerNorm(4)


def test_the_tied_head_is_tied_again_and_only_its_warning_is_kept_out():
    model = TinyLM()
    layerwise = logging.getLogger(LAYERWISE_LOGGER)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    layerwise.addHandler(handler)

    def reload():  # what vLLM 0.32's layerwise reload does to a tied head: loads the owner, puts old tensors back
        model.embed_tokens.weight = torch.nn.Parameter(torch.full((8, 4), 2.0))
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(8, 4))
        for layer in ("ParallelLMHead", "RotaryEmbedding", "LayerNorm"):
            layerwise.warning("%s: Failed to load weights", layer)

    try:
        reload_checkpoint_format(model, reload)
    finally:
        layerwise.removeHandler(handler)
    assert model.lm_head.weight is model.embed_tokens.weight and float(model.lm_head.weight[0, 0]) == 2.0
    assert seen == ["LayerNorm: Failed to load weights"]
    assert layerwise.filters == []  # removed after the reload
