"""The weight-sync job's options: what every launcher and role reads (the CLI's flags map onto them)."""

from __future__ import annotations

import dataclasses

OFFLOAD_FLAGS: dict[str, dict[str, bool]] = {
    # what to("cpu", ...) moves for each offload choice; grad moves only with the model (verl's rule)
    "none": {},
    "optimizer": {"model": False, "optimizer": True, "grad": False},
    "model": {"model": True, "optimizer": False, "grad": True},
    "all": {"model": True, "optimizer": True, "grad": True},
}


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """One weight-sync job (``hal sync --help`` describes each field as a flag).

    ``device`` is a resolved device kind (``"cpu"``, ``"npu-sim"``, ...); ``model`` a preset key or a
    safetensors path; sizes are in bytes, times in seconds.
    """

    device: str
    model: str
    rollouts: int = 2
    steps: int = 3
    offload: str = "none"
    engine: str = "collective"
    rollout_apply: str = "atomic"
    bucket_bytes: int = 256 << 20
    lr: float = 1e-4
    decode_tokens: int = 4
    logits_atol: float = 1e-2
    timeout: float = 300.0
    file_root: str | None = None
    launcher: str = "torchrun"
    address: str | None = None
    placement: str = "PACK"
    wire_format: str = "full"
    """``full``: every tensor each step; ``delta``: verl's ``delta_flush`` (:mod:`hal.apps.weightsync.delta`)."""
    compare_full: bool = False
    """Also time a full publish of the same weights around each step's (:mod:`hal.apps.weightsync.full_reference`)."""

    @property
    def colocated(self) -> bool:
        """Trainer and rollouts share one process (the colocated engine)."""
        return self.engine == "colocated"

    @property
    def offload_flags(self) -> dict[str, bool]:
        """What ``to("cpu", ...)`` moves for :attr:`offload` (``{}``: nothing)."""
        return OFFLOAD_FLAGS[self.offload]

    @property
    def delta(self) -> bool:
        """The update travels as deltas (``wire_format == "delta"``)."""
        return self.wire_format == "delta"


__all__ = ["JobOptions", "OFFLOAD_FLAGS"]
