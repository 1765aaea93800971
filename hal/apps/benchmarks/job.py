"""The one call from the benchmarks into the weight-sync job (``hal sync``'s trainer and rollouts).

``bench_sync`` and ``bench_ray`` measure the job as users run it; they reach it only through
:func:`run_sync_job`, so the job can move (it is being rewritten as a library, ``hal.apps.weightsync``)
with one import to change here.
"""

from __future__ import annotations

from typing import Any, Callable


def run_sync_job(*, device: str, model: str, rollouts: int, steps: int, bucket_mb: float, timeout: float,
                 launcher: str = "torchrun", rollout_apply: str = "atomic") -> dict[str, Any]:
    """One ``hal sync`` run: 1 trainer and ``rollouts`` rollouts, collective engine, ``steps`` steps.

    Args:
        model: a ``hal sync`` preset name or a safetensors path.
        bucket_mb: the engine's bucket size in MiB; ``timeout``: seconds any rendezvous or transfer may take.
        launcher: ``"torchrun"`` (processes on this machine) or ``"ray"``; ``rollout_apply``: ``"atomic"``
            or ``"in-place"``.

    Returns:
        The job's result: ``rows`` (one per step: ``bytes``, ``tensors``, ``publish_s``, ``raw_s``, ``gbps``,
        ``raw_gbps``, ``ratio_vs_raw``, ``memory``, ``rollouts``), ``verified``, ``errors``,
        ``ratio_vs_raw_min``, ``memory_within``, ``warmup`` and, under Ray, ``startup``.

    Raises:
        UsageError: an option the job refuses; RuntimeError: a trainer or rollout process failed.
    """
    # The job still lives in the command line; this is the only benchmark import of it (re-pointed at
    # hal.apps.weightsync when that lands).
    from hal.apps.cli.sync import Sync, execute

    return execute(Sync(device=device, model=model, rollouts=rollouts, steps=steps, bucket_mb=bucket_mb,
                        timeout=timeout, launcher=launcher, rollout_apply=rollout_apply))


def retry_port_taken(call: Callable[[], dict[str, Any]], attempts: int = 2) -> dict[str, Any]:
    """``call()``, again (up to ``attempts`` calls in all) while it fails only because a rendezvous port it
    picked was taken meanwhile (``EADDRINUSE`` in the error: a shared machine); any other error passes.

    Raises:
        ValueError: ``attempts`` below 1; whatever the last ``call()`` raised.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for _ in range(attempts - 1):
        try:
            return call()
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
    return call()
