"""M-to-N resharding: each rollout rank receives only the slices it keeps, from the trainer ranks that hold them.

A *region* is a box of a checkpoint tensor (offsets and sizes per dimension). A trainer rank holds a region of
each tensor it publishes (FSDP2: its dim-0 rows; any ``Shard(d)``/``Replicate`` DTensor). A rollout rank's
:class:`RolloutLayout` lists what it keeps: for each :class:`Slice`, a region of a checkpoint tensor and where it
lands in one of its own tensors (a tensor-parallel shard; rows of a fused ``qkv_proj`` or ``gate_up_proj``).
The *plan* of a (trainer rank, rollout rank) pair is every non-empty intersection (:func:`pair_plan`), in the
trainer's order, then the layout's; both sides compute it from the trainer's head and the rollout's layout,
check it before any byte moves (:func:`check_coverage`), and fill buckets the same way (:func:`bucket_plan`).
Layouts reach the trainer as verl's topologies do: a rollout engine's ``prepare()`` reports its layout,
``build_topology`` hands every layout to the trainer ranks. The transfer itself: :mod:`ckpt.reshard.transfer`.
"""

from ckpt.reshard.layout import Holding, Region, RolloutLayout, Slice, chunk_range, held_parts
from ckpt.reshard.plan import Piece, PlanError, bucket_plan, check_coverage, pair_plan

__all__ = ["Holding", "Piece", "PlanError", "Region", "RolloutLayout", "Slice", "bucket_plan", "check_coverage",
           "chunk_range", "held_parts", "pair_plan"]
