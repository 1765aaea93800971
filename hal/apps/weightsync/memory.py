"""Memory of the weight-sync job: each rank's peak, and the stated bounds it is judged by.

A bound is a sum of named terms in bytes (:func:`memory_bound`). The trainer's is its model state (fp32
parameters and gradients), AdamW's states, what its checkpoint engine holds while sending (a fact of the
engine's class, :func:`send_buffer`) and :data:`RUNTIME_BYTES`; a rollout's is its weight banks (from its
adapter's ``memory()``, :func:`adapter_memory`), the engine's receive buckets and :data:`RUNTIME_BYTES`.
Peaks are the process's resident high-water mark (Linux ``VmHWM``), reset at the start of each window.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import pathlib
from typing import Any

import hal

RUNTIME_BYTES = 768 << 20
"""The stated constant of the memory bounds, in bytes: a rank's resident memory besides its model,
optimizer and buffers (the interpreter, torch and transformers, activations of a step or a decode)."""

TRAINER_BUCKETS = 3
"""Buckets a bucketed engine (collective, nixl, mooncake) holds while sending: its two send buffers and one
bucket of slack."""
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


def _known_send_buffers() -> dict[Any, tuple[str, Any]]:
    """Today's send terms of hal's engines, by class (for classes that do not state their own)."""
    import ckpt

    buckets = (f"{TRAINER_BUCKETS} buckets", lambda bucket, published: {"buckets_bytes": TRAINER_BUCKETS * bucket})
    table = {"collective": buckets, "nixl": buckets, "mooncake": buckets,
             "kimi": ("the update pinned in host memory", lambda bucket, published: {"pinned_update_bytes": published}),
             "file": ("the update's host copies (one shard, at most the update)",
                      lambda bucket, published: {"host_copies_bytes": published}),
             "colocated": ("", lambda bucket, published: {})}
    known = {}
    for name, entry in table.items():
        with contextlib.suppress(ckpt.CheckpointEngineError):
            known[ckpt.checkpoint_engine_factory(name)] = entry
    return known


def send_buffer(engine_cls: Any, bucket_bytes: int, published_bytes: int) -> tuple[str, dict[str, int]]:
    """What a trainer's checkpoint engine of class ``engine_cls`` holds while it sends: ``(words, {term: bytes})``.

    The class states it: ``engine_cls.send_buffer_bytes(bucket_size, published_bytes)`` and
    ``engine_cls.send_buffer_words``. A class without them gets hal's known values for its engines (3 buckets
    for collective, nixl and mooncake; the update pinned in host memory for kimi; the update's host copies
    for file; nothing for colocated); the class's own attributes win when present.

    Raises:
        ValueError: a class that neither states it nor is one of hal's engines.
    """
    if hasattr(engine_cls, "send_buffer_bytes"):
        return (getattr(engine_cls, "send_buffer_words", ""),
                dict(engine_cls.send_buffer_bytes(bucket_bytes, published_bytes)))
    known = _known_send_buffers()
    if engine_cls not in known:
        raise ValueError(f"checkpoint engine class {getattr(engine_cls, '__name__', engine_cls)!r} states no "
                         "send_buffer_bytes and is not one of hal's engines (collective, file, colocated, nixl, "
                         "mooncake, kimi)")
    words, terms = known[engine_cls]
    return words, terms(bucket_bytes, published_bytes)


def trainer_memory_bound(peak_bytes: int, param_bytes: int, grad_bytes: int, optimizer_bytes: int, engine_cls: Any,
                         bucket_bytes: int, published_bytes: int) -> dict[str, Any]:
    """The trainer's peak against model + optimizer + what its engine holds to send + constant
    (:func:`memory_bound`; the engine's term is :func:`send_buffer`'s).

    The model term is the trainer's model state: its fp32 master parameters and their gradients
    (``param_bytes + grad_bytes``); the optimizer term is AdamW's states (``optimizer_bytes``). The peak is
    reached in the backward pass, when every gradient exists beside the parameters and the optimizer states;
    the published buffer (``published_bytes``: bf16 for presets) exists only after the gradients are freed.
    """
    words, sending = send_buffer(engine_cls, bucket_bytes, published_bytes)
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


@dataclasses.dataclass(frozen=True)
class HeldMemory:
    """What a rollout adapter holds, in bytes (the fields of ``ckpt``'s ``AdapterMemory``): its served model
    (``model_bytes``), ``banks`` weight banks of ``bank_bytes`` each, its staging area, and the bytes its
    last update copied."""

    model_bytes: int
    banks: int
    bank_bytes: int
    staging_bytes: int
    last_copied_bytes: int


def adapter_memory(adapter: Any) -> Any:
    """What ``adapter`` holds: its ``memory()`` (``model_bytes``, ``banks``, ``bank_bytes``, ``staging_bytes``,
    ``last_copied_bytes``). An adapter without ``memory()`` is read as ``ckpt.ModelRolloutAdapter`` lays
    itself out (one layout, a list of banks); its own ``memory()`` wins when present."""
    if hasattr(adapter, "memory"):
        return adapter.memory()
    nbytes = adapter.layout.nbytes
    return HeldMemory(model_bytes=nbytes, banks=len(adapter.banks), bank_bytes=nbytes,
                      staging_bytes=int(adapter.staging.numel()), last_copied_bytes=adapter.last_copied_bytes)


# ---- peaks ------------------------------------------------------------------------------------------
def reset_peak(kind: str) -> None:
    """Start a new peak-memory window: host VmHWM (Linux clear_refs 5) and the device's peak counter."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    with contextlib.suppress(Exception):
        hal.get_torch_device(kind).reset_peak_memory_stats()


def peak_host_bytes() -> int:
    """Peak resident memory of this process since the last :func:`reset_peak` (VmHWM), in bytes."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes(kind: str) -> int:
    """The device's peak allocated bytes since the last :func:`reset_peak`."""
    return int(hal.memory_stats(kind)["max_allocated"])


def trim_host_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``), so memory a step freed (gradients)
    is not counted again beside what the next phase allocates; nothing happens where it is unavailable."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


__all__ = ["HeldMemory", "ROLLOUT_BUCKETS", "RUNTIME_BYTES", "TRAINER_BUCKETS", "adapter_memory", "memory_bound",
           "peak_device_bytes", "peak_host_bytes", "reset_peak", "rollout_memory_bounds", "send_buffer",
           "trainer_memory_bound", "trim_host_heap"]
