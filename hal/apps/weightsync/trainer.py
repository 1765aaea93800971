"""The trainer's role in a weight-sync step: fp32 master weights in a TorchEngine with AdamW, an optimizer
step, offload, a cast into one flat published buffer, the send tagged with ``global_steps``, onload."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Iterator

import torch

import hal
from hal.apps.weightsync import delta, memory, models
from hal.apps.weightsync.messages import Concluded, Reference, Sent, Trained
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.verify import checksums, slice_checksums
from hal.apps.weightsync.worker import Where, Worker


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (decodes use 1 everywhere, so kernels match bitwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Trainer(Worker):
    """Worker 0: the model being trained (``options.model``) and the sending checkpoint engine."""

    lora: Any = None  # --lora-rank: the adapter's publisher (hal.apps.weightsync.lora.LoraPublisher)

    def __init__(self, options: JobOptions, engine: Any, where: Where | None = None) -> None:
        import ckpt
        from engines import TorchEngine

        self.resident_before = memory.resident_bytes()  # what the process held before the job: not judged
        super().__init__(options, 0, engine, where)
        self.device = hal.get_device(self.kind)
        self.preset = options.model in models.PRESETS
        module, self.loss_fn = models.build(options.model)
        published = getattr(torch, options.published_dtype)
        self.skeleton = None
        if self.preset:  # the trainer's own model in the published dtype, bound to each step's buffer for its decode
            self.skeleton = models.causal_lm(options.model, published, device=self.device, seed=None)
            self.prompt = models.prompt_ids(options.model)
        if options.lora:
            from hal.apps.weightsync.lora import LoraPublisher

            self.lora = LoraPublisher(module, options, published, self.skeleton)
            module = self.lora.model
        params = [p for p in module.parameters() if p.requires_grad]
        # one pass over the states where the kind runs it (DeviceSpec.fused_adamw)
        fused = hal.resolve_device(self.kind).fused_adamw and all(p.dtype == torch.float32 for p in params)
        optimizer = torch.optim.AdamW(params, lr=options.lr, **({"fused": True} if fused else {}))
        self.fused = fused
        self.torch_engine = TorchEngine(module, optimizer, device=self.kind)  # moves parameters in place
        self.flags = options.offload_flags
        self.layout = ckpt.WeightLayout(module, dtype=published if self.preset else None) if self.lora is None \
            else self.lora.with_base_layout if options.lora_adapters else self.lora.base_layout
        self.model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.state_bytes = {"param_bytes": self.model_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": 0}
        if self.skeleton is not None and not options.lora_adapters:
            self.layout.bind(self.skeleton, None)
        self.bank: torch.Tensor | None = None
        self.sender = None  # --wire-format delta: the snapshot of the last published step, kept across steps
        if options.delta:
            from ckpt.delta import DeltaSender

            self.sender = DeltaSender(flush_bytes=delta.flush_bytes(options.bucket_bytes), device=self.kind)

    def published_shape(self) -> tuple[int, int]:
        """``(bytes, tensors)`` of one published update."""
        return self.layout.nbytes, len(self.layout.slots)

    def train(self, global_steps: int) -> Trained:
        """Start step ``global_steps``: a new peak-memory window, one optimizer step, the offload, :meth:`stage`."""
        # the last step's gradients: freed now and the heap trimmed, so this backward reuses their memory
        self.torch_engine.optimizer.zero_grad(set_to_none=True)
        memory.trim_host_heap()
        memory.reset_peak(self.kind)
        start = time.perf_counter()
        with intra_op_threads(os.cpu_count() or 1):  # the rollouts wait meanwhile: the trainer may use every core
            loss = self.torch_engine.train_step(self.loss_fn)
        train_s = time.perf_counter() - start
        self.state_bytes["optimizer_bytes"] = sum(  # a sharded trainer's: its shards'
            memory.local_nbytes(t) for s in self.torch_engine.optimizer.state.values()
            for t in s.values() if isinstance(t, torch.Tensor))
        if not self.flags:
            self.torch_engine.optimizer.zero_grad(set_to_none=True)  # not needed until the next step
            memory.trim_host_heap()
        start = time.perf_counter()
        if self.flags:
            self.torch_engine.to("cpu", **self.flags)
        offload_s = time.perf_counter() - start
        return Trained(global_steps=global_steps, loss=loss, train_s=train_s, offload_s=offload_s,
                       tensor_home=dataclasses.asdict(self.torch_engine.tensor_home()), stage_s=self.stage())

    def stage(self) -> float:
        """Cast the weights into a fresh published buffer (the engine's ``publish_buffer``); returns seconds."""
        from ckpt.layout import named_weights

        start = time.perf_counter()
        if self.lora is not None:
            self.bank, self.layout = self.lora.stage(self.engine, self.device)
        else:
            self.bank = self.engine.publish_buffer(self.layout.nbytes, self.device)
            self.layout.fill(self.bank, named_weights(self.torch_engine.module))
        if self.skeleton is not None and not self.options.lora_adapters:
            self.layout.bind(self.skeleton, self.bank)
        hal.synchronize(self.kind)
        return time.perf_counter() - start

    def published(self):
        """``(name, tensor)`` views of the published buffer, back to back."""
        return self.layout.views(self.bank)

    def raw_buffer(self) -> torch.Tensor:
        """The published buffer (a raw broadcast sends it as it is)."""
        return self.bank

    def update_kwargs(self) -> dict[str, Any]:
        """The rollouts' ``update_weights`` keywords for the staged publish (LoRA adapters: ``peft_config`` and
        ``base_sync_done``; else none)."""
        return self.lora.update_kwargs() if self.lora is not None else {}

    async def update_weights(self, global_steps: int) -> Sent:
        """Send the published buffer as ``global_steps`` through the engine (verl's trainer worker method); a
        rollout's refusal, and every ``check_every``-th step's weight check, are in the result."""
        from ckpt.checker import Digester, WeightCheckError
        from ckpt.outcome import UpdateRefusedError

        t0 = time.time()
        every = self.options.check_every
        digester = Digester() if every and global_steps % every == 0 else None
        sent = Sent(t0=t0, send_s=0.0)
        try:
            if self.sender is None:
                await self.engine.send_weights(self.published(), global_steps,
                                               **({"check": True} if digester else {}))
            else:
                from ckpt.delta import delta_send

                weights = self.published() if digester is None else digester.watch(self.published())
                sent.delta = dataclasses.asdict(await delta_send(self.engine, weights, global_steps, self.sender,
                                                                 check=digester))
        except UpdateRefusedError as exc:  # the rollouts say why; the job reports them with their own errors
            sent.refused = {str(who): cause for who, cause in exc.refusals.items()}
            stats = getattr(self.sender, "undelivered", None)
            if stats is not None:  # sent, not applied everywhere: the next update is a seed
                sent.delta = dataclasses.asdict(stats)
        except WeightCheckError as exc:
            sent.check = {"checked": len(exc.outcomes), "mismatches": exc.mismatches}
        if digester is not None and sent.check is None and sent.refused is None:
            sent.check = {"checked": len(getattr(self.engine, "outcomes", {})), "mismatches": {}}
        sent.send_s = time.time() - t0
        if self.lora is not None:  # what this publish carried varies per step
            sent.nbytes, sent.tensors = self.layout.nbytes, len(self.layout.slots)
            sent.lora = self.lora.figures(self.layout)
        return sent

    def reseed(self, reason: str) -> None:
        """Make the next update a full seed (delta) or carry the base (LoRA adapters): the job's fault policy."""
        if self.sender is not None:
            self.sender.reseed(reason)
        if self.lora is not None:
            self.lora.base_due = reason

    def reference_sums(self) -> dict[str, str]:
        """Checksums of what this rank published: per tensor (or row part), or per piece each tensor-parallel
        rollout rank was sent (the layouts of the last update, :func:`slice_checksums`)."""
        if self.options.resharded:
            return slice_checksums(self.published(), self.engine.rollout_layouts)
        return checksums(self.published())

    def reference(self) -> Reference:
        """Checksums of the published buffer and the trainer's own greedy decode of it (presets)."""
        sums = self.reference_sums()
        if self.skeleton is None:
            return Reference(sums)
        with intra_op_threads(1):
            tokens, logits = models.greedy_decode(self.skeleton, self.prompt, self.options.decode_tokens)
            if self.lora is None or self.lora.adapter_holder is None:
                return Reference(sums, tokens, logits)
            with self.lora.base_only():
                _, base_logits = models.greedy_decode(self.skeleton, self.prompt, self.options.decode_tokens)
        return Reference(sums, tokens, logits, float((logits - base_logits).abs().max()))

    def release(self) -> None:
        """Drop the published buffer (and the engine's, :meth:`ckpt.CheckpointEngine.release_publish_buffer`)."""
        if self.lora is not None and self.options.lora_adapters:
            self.lora.unbind()
        elif self.skeleton is not None:
            self.layout.bind(self.skeleton, None)
        self.bank = None
        self.engine.release_publish_buffer()

    def offloaded_bytes(self) -> int:
        """Bytes ``--offload`` moves to the host each step (what the engine's host buffers hold)."""
        moved = self.state_bytes["param_bytes"] + self.state_bytes["grad_bytes"] if self.flags.get("model") else 0
        return moved + (self.state_bytes["optimizer_bytes"] if self.flags.get("optimizer") else 0)

    state_words = "model"  # the model state in the bound's form

    def role_terms(self) -> tuple[str, dict[str, int]]:
        """What this role holds besides model, optimizer and engine: ``(words, {term: bytes})``."""
        if self.lora is not None:
            return self.lora.memory_terms()
        if self.sender is None:
            return "", {}
        largest = max(e.nbytes for e in self.layout.entries.values())
        return delta.sender_memory(self.layout.nbytes, largest, self.sender.flush_bytes)

    def memory_bound(self, peak_bytes: int, extra: dict[str, int] | None = None, words: str = "",
                     peak_device_bytes: int = 0) -> dict[str, Any]:
        """The step's peak against :func:`hal.apps.weightsync.memory.trainer_memory_bound`, plus :meth:`role_terms`
        and ``extra`` (colocated: the rollouts' banks)."""
        # a fused AdamW updates in one pass; the foreach one keeps about one fp32 model of temporaries
        temporaries = 0 if self.fused else self.state_bytes["param_bytes"]
        working = peak_device_bytes - temporaries - sum(self.state_bytes.values())
        device_words, device_terms = memory.host_device_terms(self.kind, temporaries, self.offloaded_bytes(),
                                                              working)
        bound = memory.trainer_memory_bound(peak_bytes, engine_cls=type(self.engine),
                                            bucket_bytes=self.options.bucket_bytes,
                                            published_bytes=self.published_shape()[0], device_words=device_words,
                                            device_terms=device_terms, state_words=self.state_words,
                                            **self.state_bytes)
        for more_words, more in (self.role_terms(), memory.held_before_terms(self.resident_before),
                                 (words, extra or {})):
            if more:
                bound = memory.memory_bound(peak_bytes, f"{bound['form']} + {more_words}", {**bound["terms"], **more})
        return bound

    def conclude(self, extra: dict[str, int] | None = None, words: str = "") -> Concluded:
        """End a step: drop the published buffer, onload, and judge the step's peak."""
        self.release()
        start = time.perf_counter()
        if self.flags:
            self.torch_engine.to(self.kind, **self.flags)
        onload_s = time.perf_counter() - start
        peak, device_peak = memory.peak_host_bytes(), memory.peak_device_bytes(self.kind)
        return Concluded(onload_s=onload_s, peak_device_bytes=device_peak, peak_host_bytes=peak,
                         memory=self.memory_bound(peak, extra, words, device_peak))

    def abandon(self) -> None:
        """After a failed update: drop the published buffer and onload, so the next step starts as usual."""
        self.release()
        if self.flags:
            self.torch_engine.to(self.kind, **self.flags)


__all__ = ["Trainer", "intra_op_threads"]
