"""hal's tensor-parallel rollout: a preset's Qwen2 split by the model's own tensor-parallel plan.

The plan is transformers' (``config.base_model_tp_plan``, the head's ``_tp_plan``), applied with torch's
``parallelize_module``; to it we add the vocabulary split of the embedding, as vLLM's
``VocabParallelEmbedding`` splits it (transformers leaves it whole, and a Qwen2.5-0.5B embedding is 28% of the
model). The same plan gives the rank's :class:`ckpt.reshard.RolloutLayout`, so what a rank receives is exactly
the shards its parameters hold (checked against the built model).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from ckpt.reshard import Region, RolloutLayout, Slice, chunk_range
from hal.apps.errors import UsageError

VOCAB_SPLIT = {"model.embed_tokens": "embedding_rowwise"}  # vLLM's VocabParallelEmbedding, torch's RowwiseParallel
SPLIT_DIMS = {  # per style: the dim each parameter kind is split along (None: whole on every rank)
    "colwise": {"weight": 0, "bias": 0},
    "colwise_gather_output": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1, "bias": None},
    "embedding_rowwise": {"weight": 0},
}


def tp_plan(config: Any, model_cls: type) -> dict[str, str]:
    """``{module path pattern: style}`` of a causal LM: its base model's plan under ``model.``, the vocabulary
    split, and the head's own."""
    plan = {f"model.{k}": v for k, v in (config.base_model_tp_plan or {}).items()}
    plan.update(VOCAB_SPLIT)
    plan.update(getattr(model_cls, "_tp_plan", None) or {})
    unknown = sorted({v for v in plan.values() if v not in SPLIT_DIMS})
    if unknown:
        raise UsageError(f"tensor-parallel styles {unknown} of {model_cls.__name__} are not supported "
                         f"(supported: {', '.join(SPLIT_DIMS)})")
    return plan


def check_tp(config: Any, tp: int) -> None:
    """Refuse a tensor-parallel size that does not divide the attention or key-value heads."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or kv % tp:
        ok = [n for n in range(1, heads + 1) if heads % n == 0 and kv % n == 0]
        raise UsageError(f"--rollout-tp {tp} does not divide the model's {heads} attention heads and {kv} key-value "
                         f"heads; it can be {', '.join(map(str, ok))}")


def style_of(name: str, plan: dict[str, str]) -> tuple[str | None, str]:
    """``(style, parameter kind)`` of parameter ``name`` (``None``: not in the plan)."""
    module, kind = name.rsplit(".", 1) if "." in name else ("", name)
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            return style, kind
    return None, kind


def tp_layout(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], plan: dict[str, str],
              rank: int, tp: int) -> RolloutLayout:
    """The slices tensor-parallel rank ``rank`` of ``tp`` keeps: each tensor its plan splits, the chunk
    ``torch.chunk`` gives (DTensor's ``Shard``); the others whole."""
    slices = []
    for name, full in shapes.items():
        style, kind = style_of(name, plan)
        dim = None if style is None else SPLIT_DIMS[style].get(kind)
        offsets, sizes = [0] * len(full), list(full)
        if dim is not None:
            start, stop = chunk_range(full[dim], tp, rank)
            offsets[dim], sizes[dim] = start, stop - start
        slices.append(Slice(name, tuple(full), Region(tuple(offsets), tuple(sizes)), name, tuple(sizes),
                            (0,) * len(full), dtypes[name]))
    return RolloutLayout(slices)


def parallel_styles(plan: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    return {pattern: made[style]() for pattern, style in plan.items()}


def tp_causal_lm(preset: str, dtype: torch.dtype, device: torch.device, mesh: Any) -> tuple[nn.Module, RolloutLayout]:
    """A preset's model split over the 1-D ``mesh`` (this process's rank of it), materialised on ``device``
    (values unset until the first update), and the layout of what this rank keeps.

    Raises:
        UsageError: the mesh's size does not divide the heads.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from hal.apps.weightsync import models

    config = models.qwen2_config(preset)
    tp, rank = mesh.size(), mesh.get_local_rank()
    check_tp(config, tp)
    module = models.meta_causal_lm(preset, dtype)
    plan = tp_plan(config, type(module))
    # checkpoint names and full shapes as the trainer publishes them (a tied head once, as the embedding)
    from ckpt.layout import named_weights

    shapes = {n: tuple(t.shape) for n, t in named_weights(module)}
    dtypes = {n: t.dtype for n, t in named_weights(module)}
    parallelize_module(module, mesh, parallel_styles(plan))
    if config.tie_word_embeddings:  # parallelize_module gave the head a DTensor of its own: tie them again
        module.lm_head.weight = module.model.embed_tokens.weight
    module = module.to_empty(device=device)
    models.rebuild_rotary(module, device)
    layout = tp_layout(shapes, dtypes, plan, rank, tp)
    held = {n: tuple(_local(t).shape) for n, t in named_weights(module)}
    for s in layout.slices:
        if held.get(s.target) != s.target_shape:
            raise RuntimeError(f"tensor-parallel rank {rank}: {s.target} holds {held.get(s.target)}, the plan "
                               f"gives {s.target_shape}")
    return module.eval(), layout


def agreement(device: torch.device):
    """``agree(ok) -> bool``: whether every rank of this process's default group (the server's tensor-parallel
    ranks) says ok; a dead or missing rank is a no, within the group's timeout."""
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        except Exception:  # noqa: BLE001 - a peer died or timed out: the update is not whole anywhere
            return False
        return bool(flag.item())
    return agree


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = ["agreement", "check_tp", "parallel_styles", "style_of", "tp_causal_lm", "tp_layout", "tp_plan"]
