"""One soak run's options (``hal soak``'s flags map onto them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hal.apps.soak.faults import KINDS

STOP_EXTRA_S = 2.0
"""Seconds a ``stop`` fault lasts beyond the timeout (a stop shorter than the timeout is no fault)."""


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    """One soak run (``hal soak --help`` describes each field as a flag; sizes in bytes, times in seconds).

    Attributes:
        engine: a checkpoint engine's registry name.
        device: a resolved device kind (``"cpu"``, ``"npu-sim"``).
        seed: the plan's seed.
        updates: updates after step 0 (``global_steps`` 1..updates).
        wire_format: ``"full"`` or ``"delta"``.
        faults: the fault kinds asked for (those the engine or machine cannot produce are skipped).
        fault_rate: probability that an update (not one of the first two, not one right after a fault) gets one.
        rollouts: rollout processes.
        timeout: the engines' and the job's timeout.
        margin: seconds beyond ``timeout`` within which a fault must end in an error (the manager's margin).
        bucket_bytes: the bucketed engines' bucket size; also the bound on resident-memory growth.
        model: ``"tensors"`` (a 2.3 MB checkpoint the run writes, :mod:`hal.apps.soak.model`) or a preset of
            :mod:`hal.apps.weightsync.models` (``"qwen2.5-tiny"``: a transformer, whose decode is verified too).
        rollout_apply: ``"atomic"`` or ``"in-place"``.
        sample_every: every how many updates each process's descriptors and resident memory are sampled (after a
            clean update; each sample runs a full garbage collection in every process, about 0.3 s).
    """

    engine: str = "collective"
    device: str = "cpu"
    seed: int = 0
    updates: int = 40
    wire_format: str = "full"
    faults: tuple[str, ...] = KINDS
    fault_rate: float = 0.25
    rollouts: int = 2
    timeout: float = 5.0
    margin: float = 10.0
    bucket_bytes: int = 1 << 20
    model: str = "tensors"
    rollout_apply: str = "atomic"
    sample_every: int = 5

    def __post_init__(self) -> None:
        for name, value, ok, accepted in (
                ("updates", self.updates, self.updates >= 1, ">= 1"),
                ("rollouts", self.rollouts, self.rollouts >= 1, ">= 1"),
                ("timeout", self.timeout, self.timeout > 0, "> 0 seconds"),
                ("margin", self.margin, self.margin > 0, "> 0 seconds"),
                ("bucket_bytes", self.bucket_bytes, self.bucket_bytes > 0, "> 0 bytes"),
                ("sample_every", self.sample_every, self.sample_every >= 1, ">= 1"),
                ("fault_rate", self.fault_rate, 0.0 <= self.fault_rate <= 1.0, "in [0, 1]"),
                ("wire_format", self.wire_format, self.wire_format in ("full", "delta"), "'full' or 'delta'"),
                ("rollout_apply", self.rollout_apply, self.rollout_apply in ("atomic", "in-place"),
                 "'atomic' or 'in-place'")):
            if not ok:
                raise ValueError(f"SoakOptions.{name} must be {accepted}, got {value!r}")
        for kind in self.faults:
            if kind not in KINDS:
                raise ValueError(f"SoakOptions.faults: {kind!r} is not a fault kind ({', '.join(KINDS)})")

    @property
    def stop_s(self) -> float:
        """How long a ``stop`` fault keeps its process stopped."""
        return self.timeout + STOP_EXTRA_S

    @property
    def detection_bound_s(self) -> float:
        """The checker's bound on a fault's detection: ``timeout + margin``."""
        return self.timeout + self.margin

    def job_options(self, file_root: str | None, model_path: str | None = None) -> Any:
        """The weight-sync job's options for this run (``model_path``: where the ``"tensors"`` checkpoint was
        written)."""
        import ckpt
        from hal.apps.soak.model import NAME
        from hal.apps.weightsync.options import JobOptions

        publishes_to_files = ckpt.checkpoint_engine_says(self.engine, "publishes_to_files")
        if self.model == NAME and model_path is None:
            raise ValueError(f"model {NAME!r} needs the path its checkpoint was written to (hal.apps.soak.model.write)")
        model = model_path if self.model == NAME else self.model
        return JobOptions(device=self.device, model=model, rollouts=self.rollouts, steps=self.updates,
                          engine=self.engine, rollout_apply=self.rollout_apply, bucket_bytes=self.bucket_bytes,
                          decode_tokens=1, timeout=self.timeout, file_root=file_root if publishes_to_files else None,
                          wire_format=self.wire_format)


__all__ = ["STOP_EXTRA_S", "SoakOptions"]
