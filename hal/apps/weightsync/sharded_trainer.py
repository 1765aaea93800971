"""A sharded trainer rank of the weight-sync job (``--trainer-ranks N``): hal's FSDP2 engine over N ranks, every
rank publishing its own shards, no rank gathering another's.

A rank holds only its shards (:class:`engines.FSDPEngine`, one ``fully_shard`` per decoder layer plus the root)
and trains with verl's FSDP mixed precision. It publishes a second FSDP2 module in the published dtype, its
shards materialised only from each step's stage to its reference, as ``ckpt.RowShard`` parts through the
engine's ``multi_sender`` topology; rollouts receive each part into its rows. Reference checksums are per part,
``"name[start:stop]"``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import hal
from hal.apps.errors import UsageError
from hal.apps.weightsync import memory, models
from hal.apps.weightsync.messages import Reference
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.trainer import Trainer, intra_op_threads
from hal.apps.weightsync.worker import Where, Worker

# copies of the root FSDP unit in compute dtype at once (measured: 0.5B preset, 2 cpu ranks): gathered
# parameters, their gradient, the tied head's second gradient; plus one fp32 reduce-scatter input
ROOT_COMPUTE_COPIES = 3
# copies of the largest layer at once: computing and prefetched, each with its gradient (+ one fp32 input)
LAYER_COMPUTE_COPIES = 4


def unit_numels(module: torch.nn.Module, layer_cls: type) -> tuple[int, int]:
    """``(root, largest layer)``: elements of the parameters the root FSDP unit owns (a tied weight once) and of
    the largest ``layer_cls`` submodule."""
    layers = [m for m in module.modules() if isinstance(m, layer_cls)]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_layers)
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    return root, largest


def gathered_bytes(root_numel: int, layer_numel: int, compute_itemsize: int) -> int:
    """Bytes of FSDP units a rank holds unsharded at once during a step, for ``compute_itemsize``-byte compute."""
    return ((ROOT_COMPUTE_COPIES * compute_itemsize + 4) * root_numel
            + (LAYER_COMPUTE_COPIES * compute_itemsize + 4) * layer_numel)


class ShardedTrainer(Trainer):
    """Trainer rank ``rank`` of ``options.trainer_ranks``; the default process group spans the trainer ranks only.

    ``engine`` is built with ``multi_sender=True``; UsageError unless ``options.model`` is a preset.
    """

    def __init__(self, options: JobOptions, engine: Any, rank: int, where: Where | None = None) -> None:
        from engines import FSDPEngine

        if options.model not in models.PRESETS:
            raise UsageError(f"--trainer-ranks {options.trainer_ranks} trains a preset "
                             f"({', '.join(sorted(models.PRESETS))}), got --model {options.model!r}")
        self.resident_before = memory.resident_bytes()  # what the process held before the job: not judged
        Worker.__init__(self, options, rank, engine, where)
        self.rank = rank
        self.device = hal.get_device(self.kind)
        self.preset, self.flags, self.sender = True, options.offload_flags, None
        module, self.loss_fn = models.build(options.model)
        layer_cls = type(module.model.layers[0])
        published = getattr(torch, options.published_dtype)
        # verl's FSDP actor's default: all-gathers and compute in the published dtype, fp32 master and reduction
        self.gathered_bytes = gathered_bytes(*unit_numels(module, layer_cls), published.itemsize)
        self.fused = hal.resolve_device(self.kind).fused_adamw  # one pass over the states (DTensor shards take it)
        self.torch_engine = FSDPEngine(
            module, lambda params: torch.optim.AdamW(params, lr=options.lr, **({"fused": True} if self.fused else {})),
            device=self.kind, shard=(layer_cls,),
            mp_policy=MixedPrecisionPolicy(param_dtype=published, reduce_dtype=torch.float32))
        skeleton = models.meta_causal_lm(options.model, published)
        self.published_engine = FSDPEngine(skeleton, None, device=self.kind, mesh=self.torch_engine.mesh,
                                           shard=(layer_cls,))
        models.rebuild_rotary(skeleton, self.device)
        self.skeleton = skeleton.eval()
        self.prompt = models.prompt_ids(options.model)
        from ckpt.layout import named_weights

        masters = dict(named_weights(self.torch_engine.module))
        self.pairs = [(name, masters[name], value) for name, value in named_weights(self.skeleton)]
        for name, master, value in self.pairs:  # the same mesh and shapes give the same rows
            if master.to_local().shape != value.to_local().shape:
                raise RuntimeError(f"{name}: the published module's shard {tuple(value.to_local().shape)} differs "
                                   f"from the master's {tuple(master.to_local().shape)} on trainer rank {rank}")
        shard_bytes = sum(memory.local_nbytes(p) for p in self.torch_engine.module.parameters())
        self.state_bytes = {"param_bytes": shard_bytes, "grad_bytes": shard_bytes, "optimizer_bytes": 0}
        self.published_bytes = sum(memory.local_nbytes(value) for _, _, value in self.pairs)
        self.published_engine.free_shards()  # filled by each step's stage, freed after its reference

    def published_shape(self) -> tuple[int, int]:
        """``(bytes, tensors)`` this rank publishes: its rows of every tensor (the job adds the ranks' bytes)."""
        return self.published_bytes, len(self.pairs)

    def stage(self) -> float:
        """Give the published module's shards their memory back and cast the master shards into them; seconds."""
        start = time.perf_counter()
        self.published_engine.alloc_shards()
        with torch.no_grad():
            for _, master, value in self.pairs:
                value.to_local().copy_(master.to_local())
        hal.synchronize(self.kind)
        return time.perf_counter() - start

    def published(self):
        """``(name, ckpt.RowShard)`` of this rank's rows of every tensor (one held whole: from rank 0 only)."""
        import ckpt

        # the sharded parameters themselves: a module attribute is the unsharded tensor while a unit is gathered
        return ckpt.local_parts(((name, value) for name, _, value in self.pairs), self.rank)

    def raw_buffer(self) -> torch.Tensor:
        raise NotImplementedError("a sharded trainer has no one published buffer to broadcast raw")

    def reference(self) -> Reference:
        """Checksums of this rank's parts and the published module's greedy decode (a collective on every rank)."""
        sums = self.reference_sums()
        with intra_op_threads(1):
            tokens, logits = models.greedy_decode(self.skeleton, self.prompt, self.options.decode_tokens)
        self.published_engine.reshard()  # free the root unit the forward left gathered
        return Reference(sums, tokens, logits)

    def release(self) -> None:
        """Drop the published copy of the shards (refilled by the next :meth:`stage`)."""
        self.published_engine.free_shards()

    state_words = "shards"

    def role_terms(self) -> tuple[str, dict[str, int]]:
        """The published copy of this rank's shards and the FSDP units gathered at once (:func:`gathered_bytes`)."""
        return ("the published copy of the shards + the FSDP units gathered at once",
                {"published_shard_bytes": self.published_bytes, "gathered_units_bytes": self.gathered_bytes})

__all__ = ["LAYER_COMPUTE_COPIES", "ROOT_COMPUTE_COPIES", "ShardedTrainer", "gathered_bytes", "unit_numels"]
