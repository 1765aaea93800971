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
    """One weight-sync job (``hal sync --help`` describes each field): ``device`` a resolved kind, ``model`` a preset
    key or a safetensors path; sizes in bytes, times in seconds."""

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
    rollout: str = "hal"  # or "vllm"
    # None: float32 with rollout="vllm", else bfloat16
    publish_dtype: str | None = None
    # with rollout="vllm": the directory vLLM starts from (the launcher writes it)
    vllm_model_dir: str | None = None
    wire_format: str = "full"
    compare_full: bool = False
    hybrid: bool = False  # trainer and rollouts on device 0
    check_every: int = 0  # every K-th step is weight-checked (ckpt.checker); 0: none
    trainer_ranks: int = 1
    # > 1: every rollout_tp consecutive rollout ranks are one tensor-parallel server, each rank receiving only
    # its slices (ckpt.reshard)
    rollout_tp: int = 1
    lora_rank: int = 0  # > 0: train a peft LoRA adapter of this rank on the frozen base
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ()  # module names; (): every linear layer (peft's "all-linear")
    lora_publish: str = "adapter"  # or "merged": base and adapter merged into whole weights every step

    # None: the host's loopback; the control plane always stays there
    link_gbit: float | None = None

    @property
    def colocated(self) -> bool:
        """Trainer and rollouts share one process (an engine whose class says ``one_process``)."""
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
        """The device every rank resolves: the kind (each rank takes its ``LOCAL_RANK``'s), or device 0 with
        :attr:`hybrid`."""
        return f"{self.device}:0" if self.hybrid else self.device

    @property
    def offload_flags(self) -> dict[str, bool]:
        """What ``to("cpu", ...)`` moves for :attr:`offload` (``{}``: nothing)."""
        return OFFLOAD_FLAGS[self.offload]

    @property
    def published_dtype(self) -> str:
        """The dtype a preset is published in: ``"bfloat16"`` or ``"float32"``."""
        if self.publish_dtype is not None:
            return self.publish_dtype
        # float32 for vLLM (its tokens equal transformers') and for tensor-parallel rollouts (bf16 partial sums
        # round apart: the 0.5B preset's logits 1.26 from the trainer's, a token differs; float32: 4e-6)
        return "float32" if self.rollout == "vllm" or self.resharded else "bfloat16"

    @property
    def resharded(self) -> bool:
        """Each rollout rank receives only its tensor-parallel slices (``rollout_tp > 1``)."""
        return self.rollout_tp > 1

    def device_of(self, index: int) -> str:
        """The device worker ``index`` resolves: :attr:`rank_device`, or with :attr:`hybrid` tensor-parallel ranks
        device ``r`` for trainer rank ``r`` and for rollout rank ``r`` of the server (verl's hybrid engine on N
        devices)."""
        if not (self.hybrid and self.resharded):
            return self.rank_device
        return f"{self.device}:{index if index < self.trainer_ranks else self.tp_rank(index)[1]}"

    def tp_rank(self, index: int) -> tuple[int, int]:
        """``(server, rank within it)`` of the worker ``index`` (a rollout rank)."""
        return divmod(index - self.trainer_ranks, self.rollout_tp)

    @property
    def lora(self) -> bool:
        """The trainer trains a LoRA adapter (``lora_rank > 0``)."""
        return self.lora_rank > 0

    @property
    def lora_adapters(self) -> bool:
        """Updates carry the adapter alone after the base (LoRA, ``lora_publish == "adapter"``)."""
        return self.lora and self.lora_publish == "adapter"

    @property
    def delta(self) -> bool:
        """The update travels as deltas (``wire_format == "delta"``)."""
        return self.wire_format == "delta"


__all__ = ["JobOptions", "OFFLOAD_FLAGS"]
