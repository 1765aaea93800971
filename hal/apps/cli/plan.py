"""``hal plan``: the resharding plan between a sharded trainer and tensor-parallel rollout ranks, shown before a run.

Checkpoint names and shapes come from the preset's model (built on the meta device: no memory); the trainer's
layout is FSDP2's (dim-0 chunks over ``--trainer-ranks``), the rollout's the model's tensor-parallel plan
(:mod:`hal.apps.weightsync.tp`). The plan is what ``hal sync --rollout-tp`` sends: the same functions, the same
checks (a plan that cannot be formed exits 2 naming the parameter and both layouts).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Annotated, Any, Literal

import tyro

from hal.apps.cli.helptext import flowing_help, optional
from hal.apps.errors import UsageError


@flowing_help
@dataclasses.dataclass
class Plan:
    """Show which slice of every checkpoint tensor each tensor-parallel rollout rank receives from each trainer rank."""

    model: Annotated[str, tyro.conf.arg(metavar="{qwen2.5-0.5b,qwen2.5-tiny}")] = "qwen2.5-0.5b"
    """A preset."""
    trainer_ranks: int = 2
    """Trainer ranks (FSDP2: each holds a dim-0 chunk of every tensor)."""
    rollout_tp: int = 2
    """Tensor-parallel size of the rollout."""
    dtype: Literal["bfloat16", "float32"] = "float32"
    """The dtype published and served."""
    tensors: Annotated[str | None, optional("PATTERN", "every tensor")] = None
    """Show only the tensors whose names match this glob (the totals still count every tensor)."""
    json: bool = False
    """Print the plan as JSON."""


def build(args: Plan) -> dict[str, Any]:
    """The plan as data: tensors, each side's regions, per pair the pieces and bytes, per rollout rank its share.

    Raises:
        UsageError: a bad size or model; ckpt.reshard.PlanError: a plan that cannot be formed.
    """
    import torch

    from ckpt.layout import named_weights
    from ckpt.reshard import Holding, Region, chunk_range, check_coverage, pair_plan
    from hal.apps.weightsync import models, tp

    if args.model not in models.PRESETS:
        raise UsageError(f"hal plan shows a preset ({', '.join(sorted(models.PRESETS))}), got --model {args.model}")
    for flag, value in (("--trainer-ranks", args.trainer_ranks), ("--rollout-tp", args.rollout_tp)):
        if value < 1:
            raise UsageError(f"{flag} must be positive, got {value}")
    config = models.qwen2_config(args.model)
    tp.check_tp(config, args.rollout_tp)
    module = models.meta_causal_lm(args.model, getattr(torch, args.dtype))
    shapes = {n: tuple(t.shape) for n, t in named_weights(module)}
    dtypes = {n: t.dtype for n, t in named_weights(module)}
    plan = tp.tp_plan(config, type(module))
    held = {}
    for s in range(args.trainer_ranks):
        held[s] = []
        for name, full in shapes.items():
            a, b = chunk_range(full[0], args.trainer_ranks, s) if full else (0, 0)
            region = Region((a,) + (0,) * (len(full) - 1), (b - a, *full[1:])) if full else Region.whole(full)
            held[s].append(Holding(name, full, dtypes[name], region))
    model_bytes = sum(torch.Size(f).numel() * dtypes[n].itemsize for n, f in shapes.items())
    rollouts, tensors = [], {n: {"shape": list(f), "dtype": str(dtypes[n]).removeprefix("torch."),
                                 "trainer": [str(h.region) for s in held for h in held[s] if h.name == n],
                                 "rollout": []} for n, f in shapes.items()}
    for r in range(args.rollout_tp):
        layout = tp.tp_layout(shapes, dtypes, plan, r, args.rollout_tp)
        pieces = {s: pair_plan(held[s], layout, s, r) for s in held}
        check_coverage(layout, pieces, held, r)
        for sl in layout.slices:
            tensors[sl.name]["rollout"].append(f"{sl.region} -> {sl.target}{sl.dest}")
        rollouts.append({"rank": r, "bytes": layout.nbytes, "fraction": layout.nbytes / model_bytes,
                         "from": [{"trainer_rank": s, "pieces": len(ps), "bytes": sum(p.nbytes for p in ps)}
                                  for s, ps in pieces.items()]})
    return {"model": args.model, "dtype": args.dtype, "trainer_ranks": args.trainer_ranks,
            "rollout_tp": args.rollout_tp, "model_bytes": model_bytes, "tp_plan": plan, "tensors": tensors,
            "rollouts": rollouts}


def run(args: Plan) -> int:
    """``hal plan``: print the plan (a table, or ``--json``); exit 0, or 2 where it cannot be formed."""
    from ckpt.reshard import PlanError

    try:
        out = build(args)
    except PlanError as exc:
        raise UsageError(f"the plan cannot be formed: {exc}") from exc
    shown = {n: t for n, t in out["tensors"].items() if args.tensors is None or fnmatch.fnmatchcase(n, args.tensors)}
    if args.json:
        print(json.dumps({**out, "tensors": shown}, indent=2))
        return 0
    from rich.table import Table

    from hal.apps.cli.tables import console_for

    table = Table(title=f"hal plan: {out['model']} ({len(out['tensors'])} tensors, {out['dtype']}), "
                        f"{out['trainer_ranks']} trainer ranks (FSDP2 dim-0) to rollout TP {out['rollout_tp']}")
    for col in ("tensor", "shape", "trainer ranks hold", "rollout ranks keep -> where"):
        table.add_column(col)
    for name, t in shown.items():
        table.add_row(name, "x".join(map(str, t["shape"])) or "()", "\n".join(
            f"{s}: {region}" for s, region in enumerate(t["trainer"])), "\n".join(
            f"{r}: {slot}" for r, slot in enumerate(t["rollout"])))
    console = console_for(table, 140)
    console.print(table)
    for r in out["rollouts"]:
        console.print(f"rollout rank {r['rank']}: receives {r['bytes'] / 1e6:.1f} of {out['model_bytes'] / 1e6:.1f} MB "
                      f"({r['fraction']:.3f} of the model): " + ", ".join(
                          f"{p['bytes'] / 1e6:.1f} MB in {p['pieces']} pieces from trainer rank {p['trainer_rank']}"
                          for p in r["from"]))
    return 0


__all__ = ["Plan", "build", "run"]
