"""LoRA in the weight-sync job (``hal sync --lora-rank R``): the trainer's publisher and the base re-send policy.

The trainer trains a peft LoRA adapter on the frozen base (fp32 master weights, AdamW over the adapter alone).
``--lora-publish adapter``: a publish carries the base then the adapter (``base_sync_done=False``) whenever a
rollout may lack the base (the first publish, a replaced rollout, a failed update, a rollout reporting
``needs_base``), else the adapter alone; ``peft_config`` and ``base_sync_done`` reach the rollouts as keywords
of their ``update_weights`` (:mod:`ckpt.lora`). The trainer decodes with its own served copy: the base cast once
into a bank of its own, the adapter bound to each publish. ``merged``: every publish carries ``W + scale B A``,
cast, under the base's names, for rollouts that cannot serve adapters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ckpt.layout import WeightLayout, named_weights
from ckpt.lora import ADAPTER_NAME, TensorHolder, inject_lora, plain_peft_config
from hal.apps.weightsync.options import JobOptions

PUBLISH_MODES = ("adapter", "merged")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes (MaxLoRARanks)


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that serves rank ``rank`` (ValueError above them all)."""
    for allowed in MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {MAX_LORA_RANKS[-1]}, got rank {rank}")


class LoraPublisher:
    """The trainer's LoRA side: the peft model over ``module`` (frozen) and what each publish carries, in
    ``dtype``; with ``skeleton`` (a preset's published-dtype model on ``device``) the trainer's served copy."""

    def __init__(self, module: torch.nn.Module, options: JobOptions, dtype: torch.dtype,
                 skeleton: torch.nn.Module | None = None) -> None:
        import peft

        self.base_pairs = list(named_weights(module))  # the base's own tensors under their plain names
        config = peft.LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, lora_dropout=0.0,
                                 target_modules=list(options.lora_targets) or "all-linear")
        self.model = peft.get_peft_model(module, config, adapter_name=ADAPTER_NAME)  # freezes the base
        self.peft_config = plain_peft_config(self.model.peft_config[ADAPTER_NAME])
        self.merged = options.lora_publish == "merged"
        self.layers = {f"{name}.weight": layer for name, layer in self.model.get_base_model().named_modules()
                       if isinstance(layer, peft.tuners.lora.LoraLayer)}  # {base weight name: its LoRA layer}
        adapter = self.adapter_pairs()
        self.base_layout = WeightLayout(self.base_pairs, dtype=dtype)
        self.adapter_layout = WeightLayout(adapter, dtype=dtype)
        self.with_base_layout = WeightLayout(self.base_pairs + adapter, dtype=dtype)  # base_layout, then the adapter
        self.base_due: str | None = "the first publish"  # why the next publish carries the base (None: it does not)
        self.with_base = False  # the staged publish carries the base
        self.skeleton, self.base_bank, self.adapter_holder = skeleton, None, None
        if skeleton is not None and not self.merged:
            base_holder = TensorHolder(named_weights(skeleton))
            self.base_bank = self.base_layout.allocate(next(skeleton.parameters()).device)
            self.base_layout.fill(self.base_bank, self.base_pairs)
            self.base_layout.bind(base_holder, self.base_bank)
            self.adapter_holder = TensorHolder(inject_lora(skeleton, self.peft_config))

    def adapter_pairs(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter's tensors under peft's ``get_peft_model_state_dict`` names."""
        from peft import get_peft_model_state_dict

        return list(get_peft_model_state_dict(self.model, adapter_name=ADAPTER_NAME).items())

    def merged_pairs(self):
        """The base's tensors with each LoRA layer's ``scale B A`` added (fp32 temporaries, one at a time)."""
        for name, tensor in self.base_pairs:
            layer = self.layers.get(name)
            yield name, tensor if layer is None else tensor + layer.get_delta_weight(ADAPTER_NAME)

    def stage(self, engine: Any, device: torch.device) -> tuple[torch.Tensor, WeightLayout]:
        """Cast the next publish into the engine's ``publish_buffer``; returns ``(buffer, its layout)``."""
        if self.merged:
            bank = engine.publish_buffer(self.base_layout.nbytes, device)
            self.base_layout.fill(bank, self.merged_pairs())
            return bank, self.base_layout
        self.with_base, self.base_due = self.base_due is not None, None
        layout = self.with_base_layout if self.with_base else self.adapter_layout
        bank = engine.publish_buffer(layout.nbytes, device)
        if self.with_base and self.base_bank is not None:
            bank[:self.base_layout.nbytes].copy_(self.base_bank)
        elif self.with_base:
            self.base_layout.fill(bank, self.base_pairs)
        layout.fill(bank, self.adapter_pairs())
        if self.adapter_holder is not None:
            layout.bind(self.adapter_holder, bank)
        return bank, layout

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """Run the block with the served copy's adapter switched off (what the base alone computes)."""
        import peft

        layers = [m for m in self.skeleton.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def unbind(self) -> None:
        """Let go of the publish buffer (the served copy's adapter points at nothing until the next stage)."""
        if self.adapter_holder is not None:
            self.adapter_layout.bind(self.adapter_holder, None)

    def update_kwargs(self) -> dict[str, Any]:
        """The rollouts' ``update_weights`` keywords for the staged publish (merged: none)."""
        if self.merged:
            return {}
        return {"peft_config": self.peft_config, "base_sync_done": not self.with_base}

    def figures(self, layout: WeightLayout) -> dict[str, Any]:
        """What a publish of ``layout`` carried: ``publish``, ``base_sync_done``, ``merged_bytes`` (a merged
        publish's), ``adapter_bytes``."""
        return {"publish": "merged" if self.merged else "adapter",
                "base_sync_done": None if self.merged else not self.with_base,
                "merged_bytes": self.base_layout.nbytes, "adapter_bytes": self.adapter_layout.nbytes}

    def memory_terms(self) -> tuple[str, dict[str, int]]:
        """What the trainer holds for LoRA besides its model and optimizer: ``(words, {term: bytes})``."""
        if self.merged:
            largest = max((e.nbytes for n, e in self.base_layout.entries.items() if n in self.layers), default=0)
            return ("the publish buffer (merged) + a merged tensor's fp32 temporaries",
                    {"lora_publish_bytes": self.base_layout.nbytes, "lora_merge_bytes": 4 * largest})
        terms = {"lora_publish_bytes": self.with_base_layout.nbytes}
        words = "the publish buffer (base and adapter)"
        if self.base_bank is not None:
            terms["lora_decode_base_bytes"] = self.base_layout.nbytes
            words += " + the published base of the trainer's decode"
        return words, terms


def rebase_reason(received: Sequence[Any]) -> str | None:
    """Why the next publish must carry the base (the rollouts that hold none), or ``None``."""
    needing = [r for r in received if getattr(r, "needs_base", None)]
    if not needing:
        return None
    return "; ".join(f"rollout rank {r.rank} holds no base ({r.error or 'none received'})" for r in needing)


__all__ = ["LoraPublisher", "MAX_LORA_RANKS", "PUBLISH_MODES", "max_lora_rank", "rebase_reason"]
