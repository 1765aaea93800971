"""LoRA adapters published alone against merged publishes of the same training, in one run (issue 48).

Two ``hal sync --lora-rank R`` runs of one training (same seed, preset, engine, rollouts): ``--lora-publish
adapter`` (the base once, then the adapter alone) and ``merged`` (whole weights every step). Per update after
the first: bytes and publish seconds (the trainer's send until every rollout serves the step). Each run makes
``steps + 1`` updates after the first publish; the first of them is a warm-up in both (one-time allocations for
the adapter's size) and left out of the medians. ``adapter_bytes_fraction`` is an adapter update's bytes over a
merged one's, ``adapter_vs_merged_time`` the median adapter update's seconds over the median merged one's.

    hal bench --only lora --main-model qwen2.5-0.5b       # rank 8 on the default preset
"""

from __future__ import annotations

import statistics
from typing import Any

MODES = ("adapter", "merged")


def run(model: str = "qwen2.5-0.5b", device: str = "cpu", rollouts: int = 2, steps: int = 3, bucket_mb: float = 256.0,
        rank: int = 8, engine: str = "collective", timeout: float = 600.0) -> dict[str, Any]:
    """Run the two publishes of one LoRA training; returns per-update and summary figures. RuntimeError when a run
    did not verify every step."""
    import hal
    from hal.apps.errors import mib_to_bytes
    from hal.apps.weightsync.launchers import launch
    from hal.apps.weightsync.models import resolve_model
    from hal.apps.weightsync.options import JobOptions

    if min(steps, rollouts, rank) < 1:
        raise ValueError(f"steps, rollouts and rank must be >= 1, got {steps}, {rollouts}, {rank}")
    runs = {}
    for mode in MODES:
        options = JobOptions(device=hal.resolve_device(device).kind, model=resolve_model(model), rollouts=rollouts,
                             steps=steps + 1, bucket_bytes=mib_to_bytes(bucket_mb, "bucket_mb"), timeout=timeout,
                             engine=engine, lora_rank=rank, lora_publish=mode)
        report = launch(options).report(steps + 1)
        if not report["verified"]:
            raise RuntimeError(f"hal sync --lora-rank {rank} --lora-publish {mode} did not verify: "
                               f"{report['errors'][:3]}")
        runs[mode] = {"first": {"bytes": report["warmup"]["sent_bytes"], "publish_s": report["warmup"]["publish_s"]},
                      "updates": [{k: row[k] for k in ("global_steps", "bytes", "publish_s", "loss")}
                                  for row in report["rows"]],
                      "memory_within": report["memory_within"]}
    med = statistics.median
    adapter, merged = runs["adapter"]["updates"][1:], runs["merged"]["updates"][1:]  # after the warm-up update
    if [r["loss"] for r in runs["adapter"]["updates"]] != [r["loss"] for r in runs["merged"]["updates"]]:
        raise RuntimeError("the two runs did not train alike (losses differ): not the same training")
    return {"device": device, "model": model, "engine": engine, "rank": rank, "rollouts": rollouts, "runs": runs,
            "adapter_bytes": med(r["bytes"] for r in adapter), "merged_bytes": med(r["bytes"] for r in merged),
            "adapter_bytes_fraction": med(r["bytes"] for r in adapter) / med(r["bytes"] for r in merged),
            "adapter_publish_s": med(r["publish_s"] for r in adapter),
            "merged_publish_s": med(r["publish_s"] for r in merged),
            "adapter_vs_merged_time": med(r["publish_s"] for r in adapter) / med(r["publish_s"] for r in merged)}


def print_table(r: dict[str, Any]) -> None:
    """The figures of :func:`run` as a rich table: each update of both runs, then the two ratios."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"LoRA rank {r['rank']}: the adapter alone against merged weights, {r['model']}, "
                        f"{r['device']}, engine {r['engine']}, {r['rollouts']} rollouts",
                  caption="step 0: the first publish (adapter: the base and the adapter); step 1: a warm-up, left out "
                          "of the medians; MB = 10^6 bytes")
    for col in ("publish", "step", "MB", "publish ms"):
        table.add_column(col, justify="right")
    for mode in MODES:
        run_ = r["runs"][mode]
        table.add_row(mode, "0", f"{run_['first']['bytes'] / 1e6:.2f}", f"{run_['first']['publish_s'] * 1e3:.1f}")
        for u in run_["updates"]:
            table.add_row(mode, str(u["global_steps"]), f"{u['bytes'] / 1e6:.2f}", f"{u['publish_s'] * 1e3:.1f}")
    console = Console(width=120)
    console.print(table)
    console.print(f"an update after the first: adapter {r['adapter_bytes'] / 1e6:.2f} MB = "
                  f"{100 * r['adapter_bytes_fraction']:.2f}% of merged {r['merged_bytes'] / 1e6:.2f} MB; "
                  f"{r['adapter_publish_s'] * 1e3:.1f} ms = {r['adapter_vs_merged_time']:.3f} x merged "
                  f"{r['merged_publish_s'] * 1e3:.1f} ms (medians)")


__all__ = ["MODES", "print_table", "run"]
