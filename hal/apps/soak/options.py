"""One soak run's options (``hal soak``'s flags map onto them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hal.apps.soak.faults import KINDS

STOP_EXTRA_S = 2.0  # seconds a stop fault lasts beyond the timeout


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    """One soak run (``hal soak --help`` describes each field; sizes in bytes, times in seconds)."""

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
        """The weight-sync job's options for this run (``model_path``: the ``"tensors"`` checkpoint)."""
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
