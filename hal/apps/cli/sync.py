"""``hal sync``: the RL weight-sync loop a user runs first, shaped like an RL job's trainer and rollouts.

One trainer rank and ``--rollouts`` rollout ranks on one device kind. Each of ``--steps`` steps:

1. the trainer takes a real AdamW step on its fp32 master weights (a transformers ``Qwen2ForCausalLM``
   built from the published Qwen2.5-0.5B configuration for the default preset) and offloads per
   ``--offload``;
2. it casts the weights to the published dtype (bf16 for presets, as verl's actor hands its rollout bf16)
   into one flat buffer and publishes them tagged with ``global_steps`` through the chosen engine;
3. every rollout, an inference-server stand-in holding its own bf16 model (``ckpt.ModelRolloutAdapter``),
   loads the update into that model's existing parameters (the collective engine receives straight into
   them), all-or-nothing unless ``--rollout-apply in-place``;
4. off the transfer's critical path, every rollout proves what it serves: a greedy decode of a fixed
   prompt whose tokens equal, and whose logits are within ``--logits-atol`` of, the trainer's own bf16
   model at that step, and a per-tensor CRC-32 equal to the trainer's;
5. the same bytes are broadcast raw (one call, from the trainer's published buffer to the same rollouts,
   on a group of the same backend), once just before step 2 and once after step 4: the mean of the two
   is the reference the step's throughput is divided by (measured on both sides of the publish, so a slow
   or fast spell of a shared machine weighs on both alike);
6. the trainer onloads what it offloaded.

Per step, ``--json`` reports the publish-to-all-applied time and throughput, its ratio to that raw
broadcast, the peak resident (host) memory of every rank against its stated bound, and each rollout's
verification. ``--engine collective``, ``file``, ``nixl``, ``mooncake`` and ``kimi`` run the ranks as separate processes started by
``torch.distributed.launcher`` (the library behind ``torch.distributed.run``); ``colocated`` runs trainer
and rollouts in one process, as a colocated deployment does (no raw reference there). Processes exchange
results through a ``torch.distributed`` TCPStore on the loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
import uuid
import zlib
from typing import Any, Literal

import torch

import hal
from hal.apps.cli.errors import UsageError, mib_to_bytes, worker_failed
from hal.apps.cli.helptext import flowing_help

OFFLOAD_FLAGS: dict[str, dict[str, bool]] = {
    # what to.("cpu", ...) moves for each --offload choice; grad moves only with the model (verl's rule)
    "none": {},
    "optimizer": {"model": False, "optimizer": True, "grad": False},
    "model": {"model": True, "optimizer": False, "grad": True},
    "all": {"model": True, "optimizer": True, "grad": True},
}

RUNTIME_BYTES = 768 << 20
"""The stated constant of the memory bounds, in bytes: a rank's resident memory besides its model,
optimizer and buffers (the interpreter, torch and transformers, activations of a step or a decode)."""

TRAINER_BUCKETS = 3
"""Buckets in the bound of a trainer sending through a bucketed engine (collective, nixl, mooncake): model +
optimizer + 3 buckets + constant (the engine's two send buffers, and one bucket of slack)."""
ROLLOUT_BUCKETS = 2
"""Buckets in a rollout's bound: banks + 2 buckets + constant (the engine's two receive buffers)."""


def memory_bound(peak_bytes: int, form: str, terms: dict[str, int]) -> dict[str, Any]:
    """A peak judged against a stated bound: ``{"form", "terms", "bound_bytes", "peak_bytes", "within"}``.

    Args:
        peak_bytes: the measured peak (resident bytes).
        form: the bound in words (e.g. ``"model + 2 buckets + constant"``).
        terms: its addends in bytes; ``bound_bytes`` is their sum.
    """
    bound = sum(terms.values())
    return {"form": form, "terms": dict(terms), "bound_bytes": bound, "peak_bytes": peak_bytes,
            "within": peak_bytes <= bound}


def engine_send_term(engine: str, bucket_bytes: int, published_bytes: int) -> tuple[str, dict[str, int]]:
    """What the trainer's checkpoint engine holds while it sends: ``(words, {term name: bytes})``.

    * collective, nixl, mooncake: ``TRAINER_BUCKETS`` buckets (``buckets_bytes``), their send buffers;
    * kimi: the whole update pinned in host memory (``pinned_update_bytes`` = ``published_bytes``), as
      checkpoint-engine keeps it for the rollouts to pull;
    * file: host copies of the tensors of one shard before it is written (``host_copies_bytes``); the
      shard is at most the whole update, so ``published_bytes`` (no bucket: ``--bucket-mb`` is unused);
    * colocated: nothing (``{}``): the rollouts copy from the published buffer's views, in this process.

    Raises:
        UsageError: an engine not listed above.
    """
    if engine in ("collective", "nixl", "mooncake"):
        return f"{TRAINER_BUCKETS} buckets", {"buckets_bytes": TRAINER_BUCKETS * bucket_bytes}
    if engine == "kimi":
        return "the update pinned in host memory", {"pinned_update_bytes": published_bytes}
    if engine == "file":
        return "the update's host copies (one shard, at most the update)", {"host_copies_bytes": published_bytes}
    if engine == "colocated":
        return "", {}
    raise UsageError(f"--engine {engine!r} has no stated trainer memory (collective, file, colocated, nixl, "
                     f"mooncake, kimi)")


def trainer_memory_bound(peak_bytes: int, param_bytes: int, grad_bytes: int, optimizer_bytes: int, engine: str,
                         bucket_bytes: int, published_bytes: int) -> dict[str, Any]:
    """The trainer's peak against model + optimizer + what ``engine`` holds to send + constant (see
    :func:`memory_bound`; the engine's term is :func:`engine_send_term`'s: 3 buckets for the bucketed engines,
    the update's host copies for file, none for colocated).

    The model term is the trainer's model state: its fp32 master parameters and their gradients
    (``param_bytes + grad_bytes``); the optimizer term is AdamW's states (``optimizer_bytes``). The peak is
    reached in the backward pass, when every gradient exists beside the parameters and the optimizer states;
    the published buffer (``published_bytes``: bf16 for presets) exists only after the gradients are freed.
    """
    words, sending = engine_send_term(engine, bucket_bytes, published_bytes)
    form = "model (parameters + gradients) + optimizer + " + (f"{words} + " if words else "") + "constant"
    return memory_bound(peak_bytes, form, {"model_bytes": param_bytes + grad_bytes, "optimizer_bytes": optimizer_bytes,
                                           **sending, "constant_bytes": RUNTIME_BYTES})


def rollout_memory_bounds(peak_bytes: int, model_bytes: int, banks: int, bucket_bytes: int) -> dict[str, Any]:
    """A rollout's peak against the bound of its apply mode, and against the single-bank form.

    Returns:
        ``{"mode", "judged_by": memory_bound(...), "model_plus_2_buckets": memory_bound(...)}``:
        ``judged_by`` is the bound the rollout is held to: ``model + 2 buckets + constant`` in place (one
        bank), ``2 x model + 2 buckets + constant`` atomic (a second bank receives the update, so a failed
        one leaves the previous weights in service); ``model_plus_2_buckets`` is the single-bank form,
        reported for both modes (an atomic rollout exceeds it by design).
    """
    buckets = {"buckets_bytes": ROLLOUT_BUCKETS * bucket_bytes, "constant_bytes": RUNTIME_BYTES}
    single = memory_bound(peak_bytes, f"model + {ROLLOUT_BUCKETS} buckets + constant", {"model_bytes": model_bytes, **buckets})
    judged = single if banks == 1 else memory_bound(
        peak_bytes, f"{banks} x model + {ROLLOUT_BUCKETS} buckets + constant", {"model_bytes": banks * model_bytes, **buckets})
    return {"mode": "in-place" if banks == 1 else "atomic", "judged_by": judged, "model_plus_2_buckets": single}


@flowing_help
@dataclasses.dataclass
class Sync:
    """Run an RL weight-sync loop: train, offload, publish with global_steps, load into rollout models,
    verify by greedy decode and checksums, onload."""

    device: str | None = None
    """Device kind (npu, cuda, cpu, npu-sim, ...); default $HAL_DEVICE, else the first available."""
    model: str = "qwen2.5-0.5b"
    """A preset (qwen2.5-0.5b: transformers' Qwen2 with the Qwen2.5-0.5B configuration, random init, 0.99 GB
    published per step in bf16; qwen2.5-tiny: same layout, small; in any letter case) or a path to a
    .safetensors file or a directory of them (model.safetensors.index.json honoured)."""
    rollouts: int = 2
    """Rollout ranks receiving each step."""
    steps: int = 3
    """Training steps, each published as global_steps 1..steps."""
    offload: Literal["none", "optimizer", "model", "all"] = "none"
    """What the trainer offloads to the host between its step and the next."""
    engine: Literal["collective", "file", "colocated", "nixl", "mooncake", "kimi"] = "collective"
    """Checkpoint engine publishing the weights (nixl, mooncake, kimi: where hal info lists them available)."""
    rollout_apply: Literal["atomic", "in-place"] = "atomic"
    """atomic: rollouts load into a second weight bank and switch when the update is whole (a failed update
    leaves the previous step in service; memory 2 x model). in-place: into the served weights (memory
    1 x model; a failed update leaves the rollout serving no step)."""
    bucket_mb: float = 256.0
    """Bucket size of the bucketed engines (collective, nixl, mooncake, kimi), in MiB."""
    lr: float = 1e-4
    """AdamW learning rate."""
    decode_tokens: int = 4
    """Tokens of the greedy decode each rollout and the trainer run after every update (presets only)."""
    logits_atol: float = 1e-2
    """Largest absolute difference allowed between a rollout's decode logits and the trainer's (same bf16
    weights and kernels give 0; the tolerance covers kernels that differ across processes)."""
    timeout: float = 300.0
    """Seconds any rendezvous, transfer or wait may take before it is an error."""
    file_root: str | None = None
    """Directory of the file engine; None: a new temporary one."""
    json: bool = False
    """Print the per-step results as JSON on stdout (progress goes to stderr)."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Who starts the ranks: torchrun (one machine), or Ray actors placed by the kind's Ray resource (engine
    collective); see hal.apps.cli.sync_ray."""
    address: str | None = None
    """With --launcher ray: the cluster, 'auto' or HOST:PORT; default: start a one-node cluster for the run."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """With --launcher ray: how the trainer's and rollouts' bundles are placed across nodes."""


def validate(args: Sync) -> None:
    """Check the arguments before any process starts.

    Raises:
        UsageError: a count or size is not positive (names the flag and value).
        MissingFileError: ``--model`` is neither a preset (in any letter case) nor a safetensors
            file/directory (or its index names a missing shard).
        UnknownDeviceError, DeviceUnavailableError: ``--device`` cannot be used here.
        DeviceIndexError: fewer visible devices than local processes (trainer + rollouts).
    """
    from hal.apps.cli.models import resolve_model

    for flag, value in (("--rollouts", args.rollouts), ("--steps", args.steps), ("--timeout", args.timeout),
                        ("--lr", args.lr), ("--decode-tokens", args.decode_tokens)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    _bucket_bytes(args)
    if not args.logits_atol >= 0:
        raise UsageError(f"--logits-atol must be >= 0, got {args.logits_atol}")
    resolve_model(args.model)
    if args.engine in ("nixl", "mooncake", "kimi"):
        import ckpt

        ok, reason = ckpt.checkpoint_engine_availability(args.engine, args.device)
        if not ok:
            raise UsageError(f"--engine {args.engine} is unavailable here: {reason}")
    if args.launcher == "ray" and args.engine != "collective":
        raise UsageError(f"--launcher ray runs the collective engine across nodes, got --engine {args.engine}")
    spec = hal.resolve_device(args.device)
    if args.engine != "colocated" and args.launcher != "ray":  # one local process, and device, per rank
        from hal.apps.cli.launch import require_devices

        require_devices(spec, 1 + args.rollouts, what=f"1 trainer + --rollouts {args.rollouts} processes")


def checksums(weights) -> dict[str, str]:
    """``{name: CRC-32 (hex) of the tensor's bytes}``, in iteration order (host copies as needed)."""
    out = {}
    for name, tensor in weights:
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    return out


def first_mismatch(expected: dict[str, str], got: dict[str, str]) -> str | None:
    """A sentence naming the first tensor that differs, is missing or is unexpected; ``None`` if equal."""
    for name, digest in expected.items():
        if name not in got:
            return f"tensor {name!r} was not received"
        if got[name] != digest:
            return f"tensor {name!r}: checksum {got[name]} differs from the trainer's {digest}"
    extra = sorted(set(got) - set(expected))
    return f"tensor {extra[0]!r} was received but not sent" if extra else None


def verify(adapter, step: int, expected: dict[str, str]) -> str | None:
    """What is wrong with a rollout after receiving ``step``: the step it serves, else the first tensor
    whose checksum differs from the trainer's; ``None`` when it serves ``step`` byte-exact."""
    if adapter.served_step != step:
        return f"rollout serves step {adapter.served_step}, expected {step}"
    return first_mismatch(expected, checksums(adapter.state_dict().items()))


def verify_rollout(adapter, step: int, expected: dict[str, str], reference: dict[str, Any] | None,
                   decode, atol: float) -> dict[str, Any]:
    """What a rollout proves after receiving ``step``.

    Args:
        adapter: the rollout's ``ModelRolloutAdapter``.
        expected: the trainer's checksums ``{name: crc}``.
        reference: the trainer's decode ``{"tokens": [...], "logits": (n, vocab) float32}``, or ``None``.
        decode: ``() -> (tokens, logits)`` on the rollout's served model, or ``None`` (no decode).

    Returns:
        ``{"error": None | sentence, "tokens": [...], "tokens_equal": bool, "logits_max_diff": float,
        "verify_s": seconds}``: ``error`` names the step served, the first tensor whose checksum differs,
        or the decode that differs.
    """
    start = time.perf_counter()
    out: dict[str, Any] = {"tokens": None, "tokens_equal": None, "logits_max_diff": None}
    out["error"] = verify(adapter, step, expected)
    if adapter.served_step == step:
        if reference is not None and decode is not None:
            tokens, logits = decode()
            diff = float((logits - reference["logits"]).abs().max())
            out.update(tokens=tokens, tokens_equal=tokens == reference["tokens"], logits_max_diff=diff)
            if out["error"] is None and tokens != reference["tokens"]:
                out["error"] = f"greedy decode gave tokens {tokens}, the trainer's model {reference['tokens']}"
            elif out["error"] is None and not diff <= atol:
                out["error"] = f"decode logits differ from the trainer's by {diff:.3g} (> --logits-atol {atol:g})"
    out["verify_s"] = time.perf_counter() - start
    return out


# ---- memory ---------------------------------------------------------------------------------------
def _reset_peak(kind: str) -> None:
    """Start a new peak-memory window: host VmHWM (Linux clear_refs 5) and the device's peak counter."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    with contextlib.suppress(Exception):
        hal.get_torch_device(kind).reset_peak_memory_stats()


def _peak_host_bytes() -> int:
    """Peak resident memory of this process since the last :func:`_reset_peak` (VmHWM), in bytes."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_device_bytes(kind: str) -> int:
    return int(hal.memory_stats(kind)["max_allocated"])


def _trim_host_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``), so memory a step freed (gradients)
    is not counted again beside what the next phase allocates; nothing happens where it is unavailable."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def _threads(n: int):
    """Run the block with ``n`` intra-op threads (decodes use 1 everywhere, so kernels match bitwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- trainer --------------------------------------------------------------------------------------
class _Trainer:
    """Rank 0: fp32 master weights in a TorchEngine with AdamW; publishes a bf16 (presets) flat buffer."""

    def __init__(self, args: Sync) -> None:
        from engines import TorchEngine
        from hal.apps.cli import models

        import ckpt

        self.args, self.kind = args, hal.resolve_device(args.device).kind
        self.device = hal.get_device(self.kind)
        self.preset = args.model in models.PRESETS
        module, self.loss_fn = models.build(args.model)
        params = [p for p in module.parameters() if p.requires_grad]
        fused = self.kind == "cpu" and all(p.dtype == torch.float32 for p in params)  # one pass over the states
        optimizer = torch.optim.AdamW(params, lr=args.lr, **({"fused": True} if fused else {}))
        self.engine = TorchEngine(module, optimizer, device=self.kind)  # moves parameters in place
        self.flags = OFFLOAD_FLAGS[args.offload]
        self.layout = ckpt.WeightLayout(module, dtype=torch.bfloat16 if self.preset else None)
        self.model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self.skeleton = None
        if self.preset:  # the trainer's own bf16 model, bound to each step's published buffer for its decode
            self.skeleton = models.causal_lm(args.model, torch.bfloat16, device=self.device, seed=None)
            self.layout.bind(self.skeleton, None)
            self.prompt = models.prompt_ids(args.model)
        self.bank: torch.Tensor | None = None

    def step(self) -> dict[str, Any]:
        start = time.perf_counter()
        with _threads(os.cpu_count() or 1):  # the rollouts wait meanwhile: the trainer may use every core
            loss = self.engine.train_step(self.loss_fn)
        train_s = time.perf_counter() - start
        states = sum(t.numel() * t.element_size() for s in self.engine.optimizer.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor))
        self.bounds = {"param_bytes": self.model_bytes, "grad_bytes": self.model_bytes,
                       "optimizer_bytes": states}
        if not self.flags:
            self.engine.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next step
            _trim_host_heap()
        start = time.perf_counter()
        if self.flags:
            self.engine.to("cpu", **self.flags)
        offload_s = time.perf_counter() - start
        return {"loss": loss, "train_s": train_s, "offload_s": offload_s,
                "placement": dataclasses.asdict(self.engine.tensor_home())}

    def begin(self, step: int) -> dict[str, Any]:
        """Start step ``step`` under either launcher: a new peak-memory window, the optimizer step and
        offload (:meth:`step`), the cast into the published buffer (:meth:`stage`); returns the step's row."""
        _reset_peak(self.kind)
        row = {"global_steps": step, **self.step()}
        row["stage_s"] = self.stage()
        return row

    async def publish(self, engine, step: int) -> float:
        """Send the published buffer as ``global_steps=step`` through ``engine``; returns the wall-clock
        start of the send (``time.time()``, seconds), which the rollouts' applied times are measured from."""
        t0 = time.time()
        await engine.send_weights(self.published(), step)
        return t0

    def stage(self) -> float:
        """Cast the weights into a fresh published buffer (the trainer's bf16 model views it); seconds."""
        from ckpt.serving import named_weights

        start = time.perf_counter()
        self.bank = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device)
        self.layout.fill(self.bank, named_weights(self.engine.module))
        if self.skeleton is not None:
            self.layout.bind(self.skeleton, self.bank)
        hal.synchronize(self.kind)
        return time.perf_counter() - start

    def published(self):
        """``(name, tensor)`` views of the published buffer, back to back (the engine sends them as runs)."""
        return self.layout.views(self.bank)

    def reference(self) -> tuple[dict[str, str], dict[str, Any] | None]:
        """Checksums of the published buffer and the trainer's own greedy decode of it."""
        from hal.apps.cli import models

        sums = checksums(self.published())
        if self.skeleton is None:
            return sums, None
        with _threads(1):
            tokens, logits = models.greedy_decode(self.skeleton, self.prompt, self.args.decode_tokens)
        return sums, {"tokens": tokens, "logits": logits}

    def release(self) -> None:
        if self.skeleton is not None:
            self.layout.bind(self.skeleton, None)
        self.bank = None

    def finish(self, row: dict[str, Any]) -> dict[str, Any]:
        """Onload what ``step`` offloaded and add the onload time and peak memory figures to ``row``."""
        start = time.perf_counter()
        if self.flags:
            self.engine.to(self.kind, **self.flags)
        row["onload_s"] = time.perf_counter() - start
        row["peak_device_bytes"] = _peak_device_bytes(self.kind)
        row["peak_host_bytes"] = _peak_host_bytes()
        return row

    def memory_bound(self, peak_bytes: int) -> dict[str, Any]:
        """The step's peak against model (parameters + gradients) + optimizer + what the engine holds to send
        + constant (:func:`trainer_memory_bound`)."""
        return trainer_memory_bound(peak_bytes, engine=self.args.engine, bucket_bytes=_bucket_bytes(self.args),
                                    published_bytes=self.layout.nbytes, **self.bounds)

    def conclude(self, row: dict[str, Any], publish_s: float, raw_s: tuple[float, float],
                 rollouts: list[dict[str, Any]]) -> dict[str, Any]:
        """End a step under either launcher: the throughput figures, the rollouts' results, the onload and
        the memory figures with their bounds, added to ``row`` (returned).

        Args:
            publish_s: seconds from the send's start until the last rollout applied the step.
            raw_s: seconds of a raw broadcast of the same bytes to the same rollouts, just before the publish
                and just after it (after verification); the step's reference (``row["raw_s"]``) is their
                mean, so a slow or fast spell of this shared machine weighs on both sides of the ratio
                alike (the ABA order of side-by-side benchmarks), and ``row["raw_s_each"]`` keeps both.
            rollouts: every rollout's result (:meth:`_Rollout.check`), by rank.
        """
        nbytes = self.layout.nbytes
        self.release()
        raw_s_each, raw_s = list(raw_s), sum(raw_s) / len(raw_s)
        row.update(publish_s=publish_s, raw_s=raw_s, raw_s_each=raw_s_each, bytes=nbytes,
                   tensors=len(self.layout.slots),
                   gbps=nbytes / publish_s / 1e9, raw_gbps=nbytes / raw_s / 1e9, ratio_vs_raw=raw_s / publish_s,
                   rollouts=rollouts)
        self.finish(row)
        row["memory"] = self.memory_bound(row["peak_host_bytes"])
        row["memory_bound_bytes"] = row["memory"]["bound_bytes"]
        return row

    def abandon(self) -> None:
        """After a failed update: drop the published buffer and onload what the step offloaded, so the
        next step starts as usual."""
        self.release()
        if self.flags:
            self.engine.to(self.kind, **self.flags)


def _rollout_model(args: Sync, adapter_cls=None):
    """A rollout's served model in an adapter (``adapter_cls(module, atomic=...)``, default
    :class:`ckpt.ModelRolloutAdapter`) and its greedy decode (``None`` for a model that is not a preset)."""
    from hal.apps.cli import models

    import ckpt

    kind = hal.resolve_device(args.device).kind
    module = models.serving_model(args.model, hal.get_device(kind))
    adapter = (adapter_cls or ckpt.ModelRolloutAdapter)(module, atomic=args.rollout_apply == "atomic")
    decode = None
    if args.model in models.PRESETS:
        prompt = models.prompt_ids(args.model)

        def decode():
            with _threads(1):
                return models.greedy_decode(module, prompt, args.decode_tokens)
    return adapter, decode


class _Rollout:
    """A rollout rank's side of every step, under either launcher: its served model, the checkpoint worker
    receiving into it, and the verification against the trainer's checksums and decode.

    Args:
        engine: this rank's receiving checkpoint engine.
        rank: the rollout's rank (1..R), for reports.
        adapter_cls: the server adapter's class (see :func:`_rollout_model`).
    """

    def __init__(self, args: Sync, engine, rank: int, adapter_cls=None) -> None:
        import ckpt

        self.args, self.rank = args, rank
        self.kind = hal.resolve_device(args.device).kind
        self.adapter, self.decode = _rollout_model(args, adapter_cls)
        self.worker = ckpt.CheckpointEngineWorker(engine, self.adapter)

    async def receive(self, step: int) -> tuple[dict[str, Any], float]:
        """Receive and apply ``step`` (a transfer error is reported, not raised).

        Returns:
            ``(result, applied_at)``: ``result`` has ``rank``, ``served_step``, ``error``, ``receive_s``,
            ``copied_bytes``, this rank's peak memory since the receive began (``peak_host_bytes``,
            ``peak_device_bytes``) and the host peak against its bounds (``memory``: see
            :func:`rollout_memory_bounds`; ``memory_bound_bytes``: the bound it is judged by);
            ``applied_at`` is the wall-clock time (``time.time()``) the step was in service.
        """
        _reset_peak(self.kind)
        result: dict[str, Any] = {"rank": self.rank, "served_step": None, "error": None}
        start = time.perf_counter()
        try:
            await self.worker.update_weights(step)
            hal.synchronize(self.kind)
        except hal.HalError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        applied_at = time.time()
        adapter = self.adapter
        peak = _peak_host_bytes()
        memory = rollout_memory_bounds(peak, adapter.layout.nbytes, len(adapter.banks), _bucket_bytes(self.args))
        result.update(receive_s=time.perf_counter() - start, copied_bytes=adapter.last_copied_bytes,
                      served_step=adapter.served_step, peak_host_bytes=peak,
                      peak_device_bytes=_peak_device_bytes(self.kind), memory=memory,
                      memory_bound_bytes=memory["judged_by"]["bound_bytes"], banks=[b.data_ptr() for b in adapter.banks])
        return result, applied_at

    def check(self, step: int, result: dict[str, Any], expected: dict[str, str],
              reference: dict[str, Any] | None) -> dict[str, Any]:
        """Add :func:`verify_rollout`'s findings to ``result`` (a transfer error stays the error reported)."""
        checked = verify_rollout(self.adapter, step, expected, reference, self.decode, self.args.logits_atol)
        result["error"] = result["error"] or checked.pop("error")
        result.update(checked)
        return result

    def raw_target(self) -> torch.Tensor:
        """Where the raw reference broadcast lands: the staging bank, so the weights in service stay as they are."""
        return self.adapter.staging[:self.adapter.layout.nbytes]


def _make_checkpoint_engine(args: Sync, rank: int, world_size: int, port: int, root: str):
    import ckpt

    kind = hal.resolve_device(args.device).kind
    if args.engine in ("collective", "nixl", "mooncake", "kimi"):
        return ckpt.get_checkpoint_engine(args.engine, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                          master_port=port, bucket_size=_bucket_bytes(args), device=kind,
                                          timeout=args.timeout)
    return ckpt.get_checkpoint_engine("file", root=root, keep_last=2, device=kind, timeout=args.timeout)


def _bucket_bytes(args: Sync) -> int:
    """``--bucket-mb`` in bytes (raises :class:`UsageError` naming it unless it is positive)."""
    return mib_to_bytes(args.bucket_mb, "--bucket-mb")


def _release(engine) -> None:
    """End of the run: verl's per-update ``finalize()``, then ``close()`` (the group too) where there is one."""
    engine.finalize()
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False)


def _stage(progress: Any, task: Any, text: str) -> None:
    """Show ``text`` as the bar's description; piped or logged (rich draws no bar there), print it as a line."""
    progress.update(task, description=text)
    if not progress.console.is_terminal:
        progress.console.print(f"hal sync: {text}")


def _rank_main(args_dict: dict[str, Any], ckpt_port: int, ctl_port: int, root: str) -> dict[str, Any]:
    """One process of a multi-process sync: rank 0 trains and publishes, the others load and verify."""
    args = Sync(**args_dict)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hal.bind_local_device(args.device)  # one device per rank: LOCAL_RANK's
    store = hal.connect_store("127.0.0.1", ctl_port, rank, world_size, timeout=args.timeout)
    kind = hal.resolve_device(args.device).kind
    # the raw reference: a group of the same backend and ranks, formed once, beside the engine's own
    raw_group = hal.new_group_from_store(store, rank, world_size, kind, args.timeout, "raw")
    engine = _make_checkpoint_engine(args, rank, world_size, ckpt_port, root)
    try:
        if rank == 0:
            return asyncio.run(_trainer_loop(args, engine, store, raw_group, world_size))
        return asyncio.run(_rollout_loop(args, engine, store, raw_group, rank))
    finally:
        raw_group.close()


def _raw_broadcast(group, tensor: torch.Tensor) -> None:
    """One broadcast of ``tensor`` from rank 0 on ``group``; returns when it completed here."""
    group.broadcast(tensor, 0)


def _logits_bytes(logits: torch.Tensor) -> bytes:
    return logits.contiguous().numpy().tobytes()


async def _publish_timed(trainer: _Trainer, engine, store, receivers, step: int, row: dict | None = None) -> float:
    """Send the staged buffer as ``step``; seconds from the send's start until every rollout applied it
    (the send's own seconds go to ``row["send_s"]``)."""
    t0 = await trainer.publish(engine, step)
    if row is not None:
        row["send_s"] = time.time() - t0
    applied = [json.loads(store.get(f"applied/{step}/{r}")) for r in receivers]
    return max(a["t"] for a in applied) - t0


async def _raw_timed(trainer: _Trainer, store, raw_group, receivers, step: int | str) -> float:
    """The raw reference of ``step``: the same bytes, one broadcast from the published buffer, to the same
    rollouts; seconds from its start (every rollout's receive posted) until the last rollout has them."""
    for r in receivers:
        store.get(f"rawready/{step}/{r}")
    t_raw = time.time()
    await asyncio.to_thread(_raw_broadcast, raw_group, trainer.bank)
    return max(float(store.get(f"rawdone/{step}/{r}")) for r in receivers) - t_raw


async def _trainer_loop(args: Sync, engine, store, raw_group, world_size: int) -> dict[str, Any]:
    trainer = _Trainer(args)
    # join the checkpoint group now (every rank has built its model by then), so step 1 times a transfer
    await asyncio.to_thread(engine.init_process_group)
    receivers = range(1, world_size)
    # step 0, untimed: the rollouts load the trainer's initial weights, as an RL job syncs its rollouts
    # before their first generation; every one-time cost (first transfer on each group's connections,
    # buffers allocated and first touched) is paid here, by the engine and by the raw reference alike
    start = time.perf_counter()
    trainer.stage()
    warmup = {"publish_s": await _publish_timed(trainer, engine, store, receivers, 0)}
    warmup["errors"] = [f"rollout rank {r}: {e}" for r in receivers
                        if (e := json.loads(store.get(f"applied/0/{r}"))["error"])]
    warmup["raw_s"] = await _raw_timed(trainer, store, raw_group, receivers, 0)
    trainer.release()
    warmup["wall_s"] = time.perf_counter() - start
    rows = []
    with _progress() as progress:
        task = progress.add_task("sync", total=args.steps)
        for step in range(1, args.steps + 1):
            _stage(progress, task, f"step {step}/{args.steps}: train")
            row = trainer.begin(step)
            raw_before = await _raw_timed(trainer, store, raw_group, receivers, f"{step}-before")
            _stage(progress, task, f"step {step}/{args.steps}: publish")
            publish_s = await _publish_timed(trainer, engine, store, receivers, step, row)
            _stage(progress, task, f"step {step}/{args.steps}: verify")
            sums, ref = trainer.reference()
            store.set(f"sums/{step}", json.dumps(sums))
            store.set(f"ref/{step}", json.dumps(None if ref is None else {"tokens": ref["tokens"]}))
            if ref is not None:
                store.set(f"logits/{step}", _logits_bytes(ref["logits"]))
                row["tokens"] = ref["tokens"]
            raw_after = await _raw_timed(trainer, store, raw_group, receivers, step)
            results = [json.loads(store.get(f"result/{step}/{r}")) for r in receivers]
            rows.append(trainer.conclude(row, publish_s, (raw_before, raw_after), results))
            progress.advance(task)
    _release(engine)
    return {"warmup": warmup, "rows": rows}


async def _raw_received(rollout: _Rollout, store, raw_group, rank: int, step: int | str) -> None:
    """A rollout's side of :func:`_raw_timed`: post the receive, say so, and say when the bytes arrived."""
    store.set(f"rawready/{step}/{rank}", "1")
    await asyncio.to_thread(_raw_broadcast, raw_group, rollout.raw_target())
    store.set(f"rawdone/{step}/{rank}", repr(time.time()))


async def _rollout_loop(args: Sync, engine, store, raw_group, rank: int) -> dict[str, Any]:
    rollout = _Rollout(args, engine, rank)
    await asyncio.to_thread(engine.init_process_group)
    for step in range(0, args.steps + 1):  # step 0: the trainer's initial weights, untimed (see the trainer)
        if step > 0:  # the raw reference just before the publish (and again after it, below)
            await _raw_received(rollout, store, raw_group, rank, f"{step}-before")
        result, applied_at = await rollout.receive(step)
        store.set(f"applied/{step}/{rank}", json.dumps({"t": applied_at, "error": result["error"]}))
        if step == 0:
            await _raw_received(rollout, store, raw_group, rank, step)
            continue
        sums = json.loads(store.get(f"sums/{step}"))
        ref = json.loads(store.get(f"ref/{step}"))
        if ref is not None:
            ref["logits"] = torch.frombuffer(bytearray(store.get(f"logits/{step}")), dtype=torch.float32).view(
                len(ref["tokens"]), -1)
        rollout.check(step, result, sums, ref)
        await _raw_received(rollout, store, raw_group, rank, step)
        store.set(f"result/{step}/{rank}", json.dumps(result))
    _release(engine)
    return {"rank": rank}


async def _colocated(args: Sync) -> dict[str, Any]:
    """Trainer and ``args.rollouts`` rollouts in this process, one colocated engine per rollout."""
    import ckpt

    trainer = _Trainer(args)
    channels = [ckpt.get_checkpoint_engine("colocated") for _ in range(args.rollouts)]
    rollouts = [_rollout_model(args) for _ in channels]
    rows = []
    with _progress() as progress:
        task = progress.add_task("sync", total=args.steps)
        for step in range(1, args.steps + 1):
            _stage(progress, task, f"step {step}/{args.steps}")
            row = trainer.begin(step)
            start = time.perf_counter()
            sends = [ch.send_weights(trainer.published(), step) for ch in channels]
            receives = [ckpt.CheckpointEngineWorker(ch, ad).update_weights(step) for ch, (ad, _) in zip(channels, rollouts)]
            await asyncio.gather(*sends, *receives)
            row.update(publish_s=time.perf_counter() - start, bytes=trainer.layout.nbytes)
            sums, ref = trainer.reference()
            row["tensors"] = len(sums)
            row["gbps"] = row["bytes"] / row["publish_s"] / 1e9
            row.update(raw_s=None, raw_gbps=None, ratio_vs_raw=None)
            if ref is not None:
                row["tokens"] = ref["tokens"]
            row["rollouts"] = []
            for i, (adapter, decode) in enumerate(rollouts):
                checked = verify_rollout(adapter, step, sums, ref, decode, args.logits_atol)
                row["rollouts"].append({"rank": i + 1, "served_step": adapter.served_step,
                                        "copied_bytes": adapter.last_copied_bytes, **checked})
            trainer.release()
            trainer.finish(row)
            own = trainer.memory_bound(row["peak_host_bytes"])  # one process: the rollouts' banks too
            banks = sum(len(a.banks) * a.layout.nbytes for a, _ in rollouts)
            row["memory"] = memory_bound(row["peak_host_bytes"], own["form"] + " + the rollouts' banks",
                                         {**own["terms"], "rollout_banks_bytes": banks})
            row["memory_bound_bytes"] = row["memory"]["bound_bytes"]
            rows.append(row)
            progress.advance(task)
    return {"rows": rows}


def _role(rank: int) -> str:
    """What a global rank of the torchrun path is: rank 0 trains, the rest serve."""
    return "trainer (rank 0)" if rank == 0 else f"rollout {rank} (rank {rank})"


def execute(args: Sync) -> dict[str, Any]:
    """Run the loop; returns ``{"rows": [...per step...], "verified": bool, "errors": [...], ...}``.

    Raises what :func:`validate` raises, and :class:`hal.apps.cli.errors.WorkerFailedError` (a ``RuntimeError``)
    naming the trainer or rollout whose process failed, and how (its exception, signal or exit code).
    """
    from hal.apps.cli.models import resolve_model

    validate(args)
    args = dataclasses.replace(args, model=resolve_model(args.model))  # a preset by its key: Qwen2.5-0.5B too
    kind = hal.resolve_device(args.device).kind
    start = time.perf_counter()
    if args.launcher == "ray":
        from hal.apps.cli.sync_ray import execute_ray

        result = execute_ray(args)
    elif args.engine == "colocated":
        result = asyncio.run(_colocated(args))
    else:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from hal.distributed import pick_port

        os.environ[hal.ENV_VAR] = kind
        root = args.file_root or tempfile.mkdtemp(prefix="hal-sync-")
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1 + args.rollouts,
                              run_id=f"hal-sync-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                              start_method="spawn")
        ckpt_port, ctl_port = pick_port(), pick_port()
        if ckpt_port == ctl_port:
            raise RuntimeError(f"could not find two free ports (got {ckpt_port} twice)")
        try:
            per_rank = elastic_launch(config, _rank_main)(dataclasses.asdict(args), ckpt_port, ctl_port, root)
        except ChildFailedError as exc:
            raise worker_failed(exc, _role, "hal sync") from None
        result = per_rank[0]
    errors = [f"step 0 (initial weights): {e}" for e in result.get("warmup", {}).get("errors", [])]
    errors += [f"step {row['global_steps']}, rollout rank {r['rank']}: {r['error']}"
               for row in result["rows"] for r in row["rollouts"] if r["error"]]
    verified = not errors and len(result["rows"]) == args.steps
    return {"device": kind, "engine": args.engine, "model": args.model, "offload": args.offload,
            "rollout_apply": args.rollout_apply, "launcher": args.launcher,
            **{k: v for k, v in result.items() if k != "rows"}, **summary(result["rows"]),
            "rows": result["rows"], "verified": verified, "errors": errors, "wall_s": time.perf_counter() - start}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every step: the smallest ratio to the raw broadcast (``None`` without one), and whether every
    rank's peak stayed within the bound it is judged by (``None`` where no step reported one)."""
    ratios = [row["ratio_vs_raw"] for row in rows if row.get("ratio_vs_raw") is not None]
    judged = [row["memory"]["within"] for row in rows if "memory" in row]
    judged += [r["memory"]["judged_by"]["within"] for row in rows for r in row["rollouts"] if "memory" in r]
    return {"ratio_vs_raw_min": min(ratios) if ratios else None, "memory_within": all(judged) if judged else None}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["rows"]
    tensors = rows[0]["tensors"] if rows else 0
    model = result["model"]  # a preset name or the path as the user gave it
    table = Table(title=f"hal sync: {model} ({tensors} tensors) on {result['device']}, engine {result['engine']}, "
                        f"offload {result['offload']}, rollouts {result['rollout_apply']}",
                  caption="publish s: trainer's send until every rollout serves the step; x raw: a raw broadcast "
                          "of the same bytes to the same rollouts (mean of one before and one after the publish), "
                          "its time / publish s (above 1: faster than raw); "
                          "MB = 10^6 bytes; GB: peak resident / stated bound")
    # publish = send until every rollout serves the step; raw = a broadcast of the same bytes (mean of 2);
    # peak = max resident memory of the trainer / the largest rollout, against its stated bound
    for col in ("step", "loss", "MB", "publish s", "GB/s", "x raw", "offload s", "onload s", "trainer GB",
                "rollout GB", "tokens", "served", "ok"):
        table.add_column(col, justify="right")
    for row in rows:
        served = sorted({r["served_step"] for r in row["rollouts"]}, key=lambda s: (s is None, s))
        ok = all(r["error"] is None for r in row["rollouts"])
        peaks = [r.get("peak_host_bytes") for r in row["rollouts"] if r.get("peak_host_bytes")]
        bounds = [r.get("memory_bound_bytes") for r in row["rollouts"] if r.get("memory_bound_bytes")]
        ratio = row.get("ratio_vs_raw")
        table.add_row(str(row["global_steps"]), f"{row['loss']:.6g}", f"{row['bytes'] / 1e6:.0f}",
                      f"{row['publish_s']:.2f}", f"{row['gbps']:.2f}", "-" if ratio is None else f"{ratio:.2f}",
                      f"{row['offload_s']:.2f}", f"{row['onload_s']:.2f}",
                      f"{row['peak_host_bytes'] / 1e9:.2f}/{row['memory_bound_bytes'] / 1e9:.2f}",
                      f"{max(peaks) / 1e9:.2f}/{max(bounds) / 1e9:.2f}" if peaks and bounds else "-",
                      " ".join(map(str, row.get("tokens") or [])) or "-", ",".join(map(str, served)),
                      "[green]yes[/green]" if ok else "[red]NO[/red]")
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=140)
    console.print(table)
    for error in result["errors"]:
        console.print(f"[red]mismatch:[/red] {error}")
    how = "tokens, logits and checksums" if rows and rows[0].get("tokens") else "checksums"
    console.print(f"[green]every step verified ({how}), {result['wall_s']:.1f} s[/green]" if result["verified"]
                  else "[red]verification failed[/red]")


def run(args: Sync) -> int:
    result = execute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if not result["verified"]:
        print(f"hal sync: {len(result['errors'])} mismatch(es); first: {result['errors'][:1]}", file=sys.stderr)
        return 1
    return 0
