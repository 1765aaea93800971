"""Weight-sync throughput of one checkpoint engine over Ray actors vs under torchrun, and Ray's start-up time.

The same ``hal sync`` job (collective engine, a safetensors model of bf16 tensors) under both launchers, runs
alternating; a step's throughput is its bytes over its publish time, the first step of a run a warm-up;
medians. The figure of merit is ``ray / torchrun`` (goal >= 0.9); start-up is ``cluster_s`` and ``actors_s``.

    hal bench --only ray --quick --device npu-sim --json
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
from pathlib import Path

import torch

from hal.apps.benchmarks.bench_ckpt import tensor_sizes
from hal.apps.benchmarks.job import retry_port_taken, run_sync_job


def write_model(path: Path, size_mb: int, seed: int = 0) -> int:
    """Write bf16 tensors totalling ``size_mb`` MiB to ``path`` (safetensors); returns the bytes written."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sizes = tensor_sizes(size_mb << 20, seed=seed)
    tensors = {f"layer{i}.weight": torch.randn(n // 2, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)}
    save_file(tensors, str(path))
    return sum(sizes)


def step_gbps(rows: list[dict]) -> list[float]:
    """GB/s of each step of a run but the first (the warm-up)."""
    return [row["bytes"] / row["publish_s"] / 1e9 for row in rows[1:]]


def run(size_mb: int, device: str = "cpu", rollouts: int = 2, steps: int = 4, rounds: int = 2,
        bucket_mb: float = 64.0, threads: int = 1) -> dict:
    """Measure both launchers; returns medians, the ratio and Ray's start-up seconds (RuntimeError unless every
    step verified)."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is a warm-up), got {steps}")
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by torchrun's ranks and the Ray node's workers
    try:
        return _run(size_mb, device, rollouts, steps, rounds, bucket_mb, threads)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def _run(size_mb: int, device: str, rollouts: int, steps: int, rounds: int, bucket_mb: float, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hal-bench-ray-") as tmp:
        model = Path(tmp) / "model.safetensors"
        nbytes = write_model(model, size_mb)
        options = dict(device=device, model=str(model), rollouts=rollouts, steps=steps, bucket_mb=bucket_mb,
                       timeout=600.0)
        gbps: dict[str, list[float]] = {"torchrun": [], "ray": []}
        startup: list[dict] = []
        sent = set()
        for _ in range(rounds):
            for launcher in ("torchrun", "ray"):
                result = retry_port_taken(functools.partial(run_sync_job, **options, launcher=launcher))
                if not result["verified"]:
                    raise RuntimeError(f"{launcher} run did not verify: {result['errors'][:3]}")
                gbps[launcher] += step_gbps(result["rows"])
                sent |= {row["bytes"] for row in result["rows"]}
                if launcher == "ray":
                    startup.append(result["startup"])
    if len(sent) != 1:
        raise RuntimeError(f"the launchers sent different byte counts: {sorted(sent)}")
    med = {k: statistics.median(v) for k, v in gbps.items()}
    return {"device": device, "bytes": sent.pop(), "model_bytes": nbytes, "rollouts": rollouts,
            "bucket_mb": bucket_mb, "threads": threads, "steps_counted": {k: len(v) for k, v in gbps.items()},
            "gbps": med, "ratio": med["ray"] / med["torchrun"],
            "cluster_start_s": statistics.median(s["cluster_s"] for s in startup),
            "actors_start_s": statistics.median(s["actors_s"] for s in startup)}


def print_table(r: dict) -> None:
    """The figures of :func:`run` as a rich table, then Ray's start-up seconds."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hal sync weight publication: Ray actors vs torchrun, {r['bytes'] / 2**20:.0f} MiB, "
                        f"{r['rollouts']} rollouts, {r['device']}, bucket {r['bucket_mb']:g} MiB")
    for col in ("launcher", "steps", "GB/s (median)", "vs torchrun"):
        table.add_column(col, justify="right")
    for launcher in ("torchrun", "ray"):
        table.add_row(launcher, str(r["steps_counted"][launcher]), f"{r['gbps'][launcher]:.3f}",
                      f"{r['gbps'][launcher] / r['gbps']['torchrun']:.2f}x")
    console = Console()
    console.print(table)
    console.print(f"Ray start-up: node serving after {r['cluster_start_s']:.1f} s, actors bound after "
                  f"{r['actors_start_s']:.1f} s (medians)")

