"""The one call from the benchmarks into the weight-sync job, with the raw-broadcast reference attached."""

from __future__ import annotations

from typing import Any, Callable


def run_sync_job(*, device: str, model: str, rollouts: int, steps: int, bucket_mb: float, timeout: float,
                 launcher: str = "torchrun", rollout_apply: str = "atomic") -> dict[str, Any]:
    """One ``hal sync`` run: 1 trainer and ``rollouts`` rollouts, collective engine, ``steps`` steps; returns the
    job's ``--json`` result (``bucket_mb`` in MiB, ``timeout`` in seconds)."""
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
    """``call()``, again (up to ``attempts`` calls) while it fails only because a rendezvous port was taken
    meanwhile (``EADDRINUSE``)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for _ in range(attempts - 1):
        try:
            return call()
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
    return call()
