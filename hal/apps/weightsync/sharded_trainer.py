"""A sharded trainer rank of the weight-sync job (``--trainer-ranks N``): hal's FSDP2 engine over N ranks, every
rank publishing its own shards, no rank gathering another's.

Each trainer rank holds, between steps, only its shards: the fp32 master parameters, their gradients and
AdamW's states (:class:`engines.FSDPEngine`, one ``fully_shard`` per decoder layer and one for the root:
embedding, final norm and the tied head), training with verl's FSDP mixed precision (all-gathers and compute
in the published dtype, bf16 for presets; gradients reduced in fp32). What it publishes is a second FSDP2
module in the published dtype, built on the meta device and materialised shard by shard (``to_empty``), so its
bf16 values exist only as this rank's rows, and only from each step's stage to its reference
(:meth:`engines.FSDPEngine.free_shards` in between): the master shards are cast into it
(:meth:`ShardedTrainer.stage`), its shards go out as ``ckpt.RowShard`` parts through the engine's
``multi_sender`` topology (every trainer rank a sender; :mod:`ckpt.multi_sender`), and the rollouts receive
every part straight into its rows of the served tensor. The same module gives the trainer's reference
decode: its forward all-gathers one FSDP unit at a time (the root's embedding stays gathered through a
forward), as any FSDP2 forward does, on every trainer rank at once.

The reference checksums are per part: ``"name[start:stop]"`` for a rank's rows of a tensor
(:func:`hal.apps.weightsync.verify.checksums`), so a rollout checks each rank's rows of what it serves without
any rank ever holding a whole tensor. The memory bound of a rank is its shards (parameters, gradients,
optimizer states, the published copy), the engine's buckets, the FSDP units gathered at once during a
step, and the constant (:meth:`ShardedTrainer.memory_bound`).
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
from hal.apps.weightsync.verify import checksums
from hal.apps.weightsync.worker import Where, Worker

ROOT_COMPUTE_COPIES = 3
"""Copies of the root FSDP unit in the compute dtype a rank may hold at once during a step (measured: the
backward peak of the 0.5B preset on 2 cpu ranks): its parameters, all-gathered for the whole forward and
backward; its unsharded gradient; and, for the tied embedding and head (most of the root's bytes), the second
use's gradient before autograd sums the two. Besides them, one fp32 copy: the flat input of FSDP2's
reduce-scatter (``reduce_dtype`` fp32)."""
LAYER_COMPUTE_COPIES = 4
"""Copies of the largest decoder layer in the compute dtype at once: the layer computing and the one FSDP2
prefetches, each with its unsharded gradient (besides one fp32 reduce-scatter input)."""


def unit_numels(module: torch.nn.Module, layer_cls: type) -> tuple[int, int]:
    """``(root, largest layer)``: elements of the parameters the root FSDP unit owns (every parameter outside
    the ``layer_cls`` submodules; a tied weight once) and of the largest ``layer_cls`` submodule."""
    layers = [m for m in module.modules() if isinstance(m, layer_cls)]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_layers)
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    return root, largest


def gathered_bytes(root_numel: int, layer_numel: int, compute_itemsize: int) -> int:
    """Bytes of FSDP units a rank holds unsharded at once during a step (:data:`ROOT_COMPUTE_COPIES`,
    :data:`LAYER_COMPUTE_COPIES`, plus one fp32 reduce-scatter input of each), for ``compute_itemsize``-byte
    compute (2: bf16)."""
    return ((ROOT_COMPUTE_COPIES * compute_itemsize + 4) * root_numel
            + (LAYER_COMPUTE_COPIES * compute_itemsize + 4) * layer_numel)


class ShardedTrainer(Trainer):
    """Trainer rank ``rank`` of ``options.trainer_ranks`` (see the module docstring); the default process group
    must span the trainer ranks only (the launcher initialises it).

    Args:
        options: the job's options (``model`` a preset).
        engine: this rank's sending checkpoint engine (built with ``multi_sender=True``).
        rank: this rank's index among the trainer ranks (its FSDP2 mesh coordinate).

    Raises:
        UsageError: ``options.model`` is not a preset (a checkpoint path has no decoder layers to shard by).
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
        """``(name, ckpt.RowShard)`` of this rank's rows of every tensor (a tensor every rank holds whole, from
        rank 0 only): what this rank sends (:func:`ckpt.local_parts`)."""
        import ckpt

        # the sharded parameters themselves: a module attribute is the unsharded tensor while a unit is gathered
        return ckpt.local_parts(((name, value) for name, _, value in self.pairs), self.rank)

    def raw_buffer(self) -> torch.Tensor:
        raise NotImplementedError("a sharded trainer has no one published buffer to broadcast raw")

    def reference(self) -> Reference:
        """Checksums of this rank's parts (``"name[start:stop]"``) and the published module's greedy decode
        (a collective: every trainer rank runs it at once; each gets the same tokens)."""
        sums = checksums(self.published())
        with intra_op_threads(1):
            tokens, logits = models.greedy_decode(self.skeleton, self.prompt, self.options.decode_tokens)
        self.published_engine.reshard()  # free the root unit the forward left gathered
        return Reference(sums, tokens, logits)

    def release(self) -> None:
        """Drop the published copy of the shards (refilled by the next :meth:`stage`)."""
        self.published_engine.free_shards()

    state_words = "shards"

    def role_terms(self) -> tuple[str, dict[str, int]]:
        """The published copy of this rank's shards (from the stage to the reference) and the FSDP units gathered
        at once (:func:`gathered_bytes`), besides its shards (fp32 parameters and gradients, AdamW's states), the
        engine's buffers and the constant (:meth:`Trainer.memory_bound`)."""
        return ("the published copy of the shards + the FSDP units gathered at once",
                {"published_shard_bytes": self.published_bytes, "gathered_units_bytes": self.gathered_bytes})

__all__ = ["LAYER_COMPUTE_COPIES", "ROOT_COMPUTE_COPIES", "ShardedTrainer", "gathered_bytes", "unit_numels"]
