"""A rollout's role in a weight-sync step: a server stand-in holding its own model, loading each update
through its checkpoint engine and proving what it serves."""

from __future__ import annotations

import time
from typing import Any

import hal
from hal.apps.weightsync import memory, models
from hal.apps.weightsync.messages import Checked, Received, Reference
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.trainer import intra_op_threads
from hal.apps.weightsync.verify import verify, verify_rollout
from hal.apps.weightsync.worker import RolloutRole, Where


def rollout_model(options: JobOptions, adapter_cls: Any = None, index: int | None = None):
    """A rollout's served model in an adapter (default :class:`ckpt.ModelRolloutAdapter`), its greedy decode
    (``None`` unless a preset) and, tensor-parallel, the layout of what this rank keeps (else ``None``)."""
    import ckpt

    import torch

    device = hal.get_device(options.rank_device if index is None else options.device_of(index))
    dtype = getattr(torch, options.published_dtype)
    atomic, layout, agree = options.rollout_apply == "atomic", None, {}
    if options.resharded:  # this process is one rank of the server's default process group (the launcher's)
        from torch.distributed.device_mesh import init_device_mesh

        from hal.apps.weightsync import tp

        mesh = init_device_mesh(hal.resolve_device(options.device).name, (options.rollout_tp,))
        module, layout = tp.tp_causal_lm(options.model, dtype, device, mesh)
        agree = {"agree": tp.agreement(device)}
    else:
        module = models.serving_model(options.model, device, dtype)
    adapter = (adapter_cls or ckpt.ModelRolloutAdapter)(module, atomic=atomic, **agree)
    decode = None
    if options.model in models.PRESETS:
        prompt = models.prompt_ids(options.model)

        def decode():
            with intra_op_threads(1):
                return models.greedy_decode(module, prompt, options.decode_tokens)
    return adapter, decode, layout


class Rollout(RolloutRole):
    """A rollout rank (1..R): the receiving checkpoint engine and the served model it loads into."""

    def __init__(self, options: JobOptions, engine: Any, rank: int, adapter_cls: Any = None,
                 where: Where | None = None) -> None:
        import ckpt

        super().__init__(options, rank, engine, where)
        if options.delta:  # the served model takes deltas through a DeltaReceiver (hal.apps.weightsync.delta)
            from hal.apps.weightsync.delta import DeltaServing, single_bank

            bank, self.decode, self.layout = rollout_model(options, adapter_cls or single_bank)
            self.adapter = self.receiver = DeltaServing(bank, engine, options.rollout_apply == "atomic")
            return
        if adapter_cls is None and options.lora_adapters:  # the base, and peft's LoRA layers on the first adapter
            adapter_cls = ckpt.LoraRolloutAdapter
        self.adapter, self.decode, self.layout = rollout_model(options, adapter_cls, rank)
        if self.layout is not None:  # reported by the engine's prepare(), so the trainer sends only these slices
            engine.rollout_layout = self.layout
        self.receiver = ckpt.CheckpointEngineWorker(engine, self.adapter)

    async def update_weights(self, global_steps: int, **lora: Any) -> Received:
        """Receive and apply ``global_steps`` (a transfer error is reported in the result, not raised); ``lora``:
        the update's ``peft_config`` and ``base_sync_done``."""
        started_at = time.time()
        memory.reset_peak(self.kind)
        error = None
        start = time.perf_counter()
        try:
            await self.receiver.update_weights(global_steps, **lora)
            hal.synchronize(self.kind)
        except hal.HalError as exc:
            error = f"{type(exc).__name__}: {exc}"
        applied_at = time.time()
        held = self.adapter.memory()
        out = Received(rank=self.index, served_step=self.adapter.served_step, error=error,
                       receive_s=time.perf_counter() - start, copied_bytes=held.last_copied_bytes,
                       started_at=started_at, applied_at=applied_at, held_bytes=held.banks * held.bank_bytes,
                       needs_seed=getattr(self.receiver, "needs_seed", None), device=str(hal.get_device(self.kind)),
                       received_bytes=None if self.layout is None else self.layout.nbytes,
                       needs_base=getattr(self.adapter, "needs_base", None))
        delta_words, delta_terms = self.delta_memory(held)
        out.held_bytes += sum(delta_terms.values())
        if self.whereabouts.resource is not None:
            out.node_ip, out.device_id = self.whereabouts.node_ip, self.whereabouts.device_id
        if not self.options.colocated:  # colocated: the process's peak is the trainer's, judged there
            out.peak_host_bytes = memory.peak_host_bytes()
            out.peak_device_bytes = memory.peak_device_bytes(self.kind)
            device_words, device_terms = memory.host_device_terms(self.kind)
            if delta_terms:
                device_words = " + ".join(w for w in (delta_words, device_words) if w)
            out.memory = memory.rollout_memory_bounds(out.peak_host_bytes, held.model_bytes, held.banks,
                                                      self.options.bucket_bytes, device_words,
                                                      {**delta_terms, **device_terms}, self.options.trainer_ranks)
            out.memory_bound_bytes = out.memory["judged_by"]["bound_bytes"]
        return out

    def delta_memory(self, held: Any) -> tuple[str, dict[str, int]]:
        """What the delta receiver holds besides the bank (``("", {})`` for full updates)."""
        if not self.options.delta:
            return "", {}
        from hal.apps.weightsync.delta import flush_bytes, receiver_memory

        largest = max(e.nbytes for e in self.adapter.layout.entries.values())
        return receiver_memory(self.receiver.atomic, held.model_bytes, largest, flush_bytes(self.options.bucket_bytes))

    def check(self, global_steps: int, reference: Reference) -> Checked:
        """What this rollout proves after receiving ``global_steps`` (:func:`verify_rollout`; LoRA adapters: the
        adapter's tensors, and the base's where the update carried it)."""
        return verify_rollout(self.adapter, global_steps, reference, self.decode, self.options.logits_atol,
                              self.layout, self.checked_tensors(reference.sums))

    def verify(self, global_steps: int, expected: dict[str, str]) -> str | None:
        """What is wrong with the weights in service against step ``global_steps``'s checksums (``None``: exact)."""
        return verify(self.adapter, global_steps, expected, self.checked_tensors(expected))

    def checked_tensors(self, expected: dict[str, str]) -> dict[str, Any] | None:
        """LoRA adapters: the tensors checked against ``expected`` (the adapter's, and the base's where the update
        carried it); else ``None`` (every tensor served)."""
        if not self.options.lora_adapters:
            return None
        from ckpt.lora import is_adapter_tensor

        return self.adapter.state_dict(with_base=not all(map(is_adapter_tensor, expected)))

    def raw_buffer(self):
        """The adapter's staging area (a raw broadcast lands there; the weights in service stay as they are)."""
        return self.adapter.staging[:self.adapter.memory().bank_bytes]


__all__ = ["Rollout", "rollout_model"]
