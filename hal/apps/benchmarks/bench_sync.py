"""The main job's weight sync, as ``hal sync`` runs it, against a raw broadcast of the same bytes.

1 trainer and ``rollouts`` rollouts, collective engine, via :func:`hal.apps.benchmarks.job.run_sync_job` on a
bf16 tensor mix or a preset. Per step, ``publish`` (send until every rollout applied) against ``raw`` (one
broadcast of the same bytes to the same rollouts); an untimed step 0 pays one-time costs. Reports the median
and smallest raw / publish ratio and each rank's peak against its bound.

    hal bench --only main --main-model qwen2.5-0.5b          # the README's hal sync
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from hal.apps.benchmarks.bench_ray import write_model
from hal.apps.benchmarks.job import run_sync_job
from hal.apps.errors import mib_to_bytes


def run(size_mb: int, device: str = "cpu", rollouts: int = 2, steps: int = 3, bucket_mb: float = 256.0,
        applies: tuple[str, ...] | list[str] = ("atomic",), model: str | None = None,
        timeout: float = 600.0) -> dict[str, Any]:
    """Run ``hal sync`` once per apply mode in ``applies``; returns per-step and summary figures (GB/s = 1e9
    bytes/s). RuntimeError when a run did not verify every step."""
    if min(steps, rollouts, size_mb) < 1 or not applies or set(applies) - {"atomic", "in-place"}:
        raise ValueError(f"steps, rollouts and size_mb must be >= 1 and applies a non-empty subset of "
                         f"('atomic', 'in-place'), got {steps}, {rollouts}, {size_mb}, {list(applies)}")
    label = model or "tensor mix"
    with tempfile.TemporaryDirectory(prefix="hal-bench-sync-") as tmp:
        if model is None:
            model = str(Path(tmp) / "model.safetensors")
            write_model(Path(model), size_mb)
        runs = []
        for apply in applies:
            result = run_sync_job(device=device, model=model, rollouts=rollouts, steps=steps, bucket_mb=bucket_mb,
                                  rollout_apply=apply, timeout=timeout)
            if not result["verified"]:
                raise RuntimeError(f"hal sync --rollout-apply {apply} did not verify: {result['errors'][:3]}")
            runs.append(_figures(apply, result))
    sent = {(r.pop("bytes"), r.pop("tensors")) for r in runs}
    if len(sent) != 1:
        raise RuntimeError(f"the runs published different (bytes, tensors): {sorted(sent)}")
    nbytes, tensors = sent.pop()
    return {"device": device, "model": label, "bytes": nbytes, "tensors": tensors, "rollouts": rollouts,
            "bucket_bytes": mib_to_bytes(bucket_mb, "--bucket-mb"), "runs": runs}


def _figures(apply: str, result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    med = statistics.median

    def worst(records: list[dict[str, Any]]) -> dict[str, Any]:  # the record furthest above (or least below) its bound
        return max(records, key=lambda m: m["peak_bytes"] - m["bound_bytes"])

    rollout_memory = {}
    for r in rows[0]["rollouts"]:
        rank = r["rank"]
        records = [x["memory"] for row in rows for x in row["rollouts"] if x["rank"] == rank]
        rollout_memory[rank] = max(records, key=lambda m: m["judged_by"]["peak_bytes"])
    return {"rollout_apply": apply, "bytes": rows[0]["bytes"], "tensors": rows[0]["tensors"],
            "steps": [{k: row[k] for k in ("global_steps", "publish_s", "raw_s", "gbps", "raw_gbps", "ratio_vs_raw")}
                      for row in rows],
            "gbps": med(row["gbps"] for row in rows), "raw_gbps": med(row["raw_gbps"] for row in rows),
            "ratio_vs_raw": med(row["ratio_vs_raw"] for row in rows), "ratio_vs_raw_min": result["ratio_vs_raw_min"],
            "warmup": result.get("warmup"), "trainer_memory": worst([row["memory"] for row in rows]),
            "rollout_memory": rollout_memory, "memory_within": result["memory_within"]}


def print_table(r: dict[str, Any]) -> None:
    """The figures of :func:`run` as a rich table: per step, then each run's peaks against their bounds."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"main job: 1 trainer -> {r['rollouts']} rollouts applying into their models, {r['model']}, "
                        f"{r['bytes'] / 2**20:.0f} MiB ({r['tensors']} tensors), {r['device']}, "
                        f"bucket {r['bucket_bytes'] / 2**20:g} MiB")
    for col in ("apply", "step", "publish ms", "GB/s", "raw ms", "raw GB/s", "x raw"):
        table.add_column(col, justify="right")
    for run_ in r["runs"]:
        for s in run_["steps"]:
            table.add_row(run_["rollout_apply"], str(s["global_steps"]), f"{s['publish_s'] * 1e3:.0f}",
                          f"{s['gbps']:.2f}", f"{s['raw_s'] * 1e3:.0f}", f"{s['raw_gbps']:.2f}",
                          f"{s['ratio_vs_raw']:.2f}")
        table.add_row(run_["rollout_apply"], "median", "", f"{run_['gbps']:.2f}", "", f"{run_['raw_gbps']:.2f}",
                      f"{run_['ratio_vs_raw']:.2f} (min {run_['ratio_vs_raw_min']:.2f})")
    console = Console(width=150)
    console.print(table)
    for run_ in r["runs"]:
        t = run_["trainer_memory"]
        console.print(f"{run_['rollout_apply']}: trainer peak {t['peak_bytes'] / 1e9:.2f} GB <= {t['form']} = "
                      f"{t['bound_bytes'] / 1e9:.2f} GB: {t['within']}")
        for rank, m in run_["rollout_memory"].items():
            j, single = m["judged_by"], m["model_plus_2_buckets"]
            console.print(f"  rollout {rank}: peak {j['peak_bytes'] / 1e9:.2f} GB <= {j['form']} = "
                          f"{j['bound_bytes'] / 1e9:.2f} GB: {j['within']} (model + 2 buckets + constant = "
                          f"{single['bound_bytes'] / 1e9:.2f} GB: {single['within']})")

