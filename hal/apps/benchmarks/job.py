"""The one call from the benchmarks into the weight-sync job (``hal.apps.weightsync``, what ``hal sync`` runs).

``bench_sync`` and ``bench_ray`` measure the job as users run it, with the raw-broadcast reference attached
(:class:`hal.apps.weightsync.raw.RawReference`), through :func:`run_sync_job`.
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
    import hal
    from hal.apps.errors import mib_to_bytes
    from hal.apps.weightsync.launchers import launch
    from hal.apps.weightsync.models import resolve_model
    from hal.apps.weightsync.options import JobOptions
    from hal.apps.weightsync.raw import RawReference

    options = JobOptions(device=hal.resolve_device(device).kind, model=resolve_model(model), rollouts=rollouts,
                         steps=steps, bucket_bytes=mib_to_bytes(bucket_mb, "bucket_mb"), timeout=timeout,
                         launcher=launcher, rollout_apply=rollout_apply)
    return launch(options, [RawReference()]).report(steps)


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
