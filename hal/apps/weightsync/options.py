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
    rollout: str = "hal"
    """``"hal"``: hal's own server stand-in (:class:`~hal.apps.weightsync.rollout.Rollout`); ``"vllm"``: a vLLM
    engine per rollout (:class:`~hal.apps.weightsync.vllm_role.VllmRolloutRole`)."""
    publish_dtype: str | None = None
    """The dtype the trainer publishes presets in (``"bfloat16"``, ``"float32"``); ``None``: float32 with
    ``rollout="vllm"`` (vLLM's tokens then equal transformers' exactly), else bfloat16 (verl's choice)."""
    vllm_model_dir: str | None = None
    """With ``rollout="vllm"``: the Hugging Face directory vLLM starts from (the launcher writes it)."""
    wire_format: str = "full"
    """``full``: every tensor each step; ``delta``: verl's ``delta_flush`` (:mod:`hal.apps.weightsync.delta`)."""
    compare_full: bool = False
    """Also time a full publish of the same weights around each step's (:mod:`hal.apps.weightsync.full_reference`)."""
    hybrid: bool = False
    """verl's hybrid engine: the trainer and every rollout on one device (the kind's device 0), each in its own
    process; the trainer offloads its model, gradients and optimizer states before the rollouts apply an update
    (``offload="all"``) and onloads them after. Needs an engine whose class says ``ranks_may_share_a_device``."""
    trainer_ranks: int = 1
    """Trainer ranks: 1, one process with the whole model (:class:`~hal.apps.weightsync.trainer.Trainer`); more,
    hal's FSDP2 engine over that many processes, every rank publishing its own shards
    (:class:`~hal.apps.weightsync.sharded_trainer.ShardedTrainer`, the engine's ``multi_sender`` topology)."""

    link_gbit: float | None = None
    """Each process in a network namespace of its own, joined to the others by an emulated link of this many
    Gbit/s each way (:mod:`hal.apps.links`; the torchrun launcher); ``None``: the host's loopback. The job's
    control plane stays on the loopback: only the engine's (and the raw reference's) bytes cross the links."""

    @property
    def colocated(self) -> bool:
        """Trainer and rollouts share one process (an engine whose class says ``one_process``: the colocated
        one)."""
        import ckpt

        return ckpt.checkpoint_engine_says(self.engine, "one_process")

    @property
    def sharded(self) -> bool:
        """The trainer is sharded over several ranks (``trainer_ranks > 1``)."""
        return self.trainer_ranks > 1

    @property
    def world_size(self) -> int:
        """Workers of the job: the trainer ranks, then the rollouts."""
        return self.trainer_ranks + self.rollouts

    @property
    def rank_device(self) -> str:
        """The device every rank resolves: the kind (each rank then takes its ``LOCAL_RANK``'s device, see
        :func:`hal.local_device`), or with :attr:`hybrid` the kind's device 0 for every rank."""
        return f"{self.device}:0" if self.hybrid else self.device

    @property
    def offload_flags(self) -> dict[str, bool]:
        """What ``to("cpu", ...)`` moves for :attr:`offload` (``{}``: nothing)."""
        return OFFLOAD_FLAGS[self.offload]

    @property
    def published_dtype(self) -> str:
        """The dtype a preset is published in (:attr:`publish_dtype`, resolved): ``"bfloat16"`` or ``"float32"``."""
        if self.publish_dtype is not None:
            return self.publish_dtype
        return "float32" if self.rollout == "vllm" else "bfloat16"

    @property
    def delta(self) -> bool:
        """The update travels as deltas (``wire_format == "delta"``)."""
        return self.wire_format == "delta"


__all__ = ["JobOptions", "OFFLOAD_FLAGS"]
