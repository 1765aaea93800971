"""Memory of the weight-sync job: each rank's peak, and the stated bounds it is judged by.

A bound is a sum of named terms in bytes (:func:`memory_bound`). The trainer's is its model state (fp32
parameters and gradients), AdamW's states, what its checkpoint engine holds while sending (a fact of the
engine's class, :func:`send_buffer`) and :data:`RUNTIME_BYTES`; a rollout's is its weight banks (from its
adapter's ``memory()``), the engine's receive buckets and :data:`RUNTIME_BYTES`.
Peaks are the process's resident high-water mark (Linux ``VmHWM``), reset at the start of each window.
"""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
from typing import Any

import hal

RUNTIME_BYTES = 768 << 20
"""The stated constant of the memory bounds, in bytes: a rank's resident memory besides its model,
optimizer and buffers (the interpreter, torch and transformers, activations of a step or a decode)."""
IMPORTS_BYTES = 384 << 20
"""Of :data:`RUNTIME_BYTES`, what a process holds before a job's workers are built: the interpreter with hal,
torch and transformers imported (measured 244 MB on cpu with torch 2.13), with headroom. What a process holds
beyond it when the job begins is not the job's (:func:`held_before_terms`)."""

TRAINER_BUCKETS = 3
"""Buckets a bucketed engine (collective, nixl, mooncake) holds while sending: its two send buffers and one
bucket of slack."""
ROLLOUT_BUCKETS = 2
"""Buckets in a rollout's bound: banks + 2 buckets + constant (the engine's two receive buffers)."""


def local_nbytes(tensor: Any) -> int:
    """Bytes ``tensor`` holds on this rank: a ``DTensor``'s local shard (FSDP2), else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


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


def send_buffer(engine_cls: Any, bucket_bytes: int, published_bytes: int) -> tuple[str, dict[str, int]]:
    """What a trainer's checkpoint engine of class ``engine_cls`` holds while it sends: ``(words, {term: bytes})``.

    The class states it (``ckpt.CheckpointEngine.send_buffer_bytes(bucket_size, published_bytes)`` and
    ``send_buffer_words``; the ABC's default is nothing held): 3 buckets for collective, nixl and mooncake,
    the update pinned in host memory for kimi, the update's host copies for file, nothing for colocated.

    Raises:
        ValueError: a class that does not state it (not a ``ckpt.CheckpointEngine``, and no such attributes).
    """
    if not hasattr(engine_cls, "send_buffer_bytes"):
        raise ValueError(f"checkpoint engine class {getattr(engine_cls, '__name__', engine_cls)!r} states no "
                         "send_buffer_bytes (ckpt.CheckpointEngine's classmethod): its memory bound is unknown")
    return (getattr(engine_cls, "send_buffer_words", ""),
            dict(engine_cls.send_buffer_bytes(bucket_bytes, published_bytes)))


def trainer_memory_bound(peak_bytes: int, param_bytes: int, grad_bytes: int, optimizer_bytes: int, engine_cls: Any,
                         bucket_bytes: int, published_bytes: int, device_words: str = "",
                         device_terms: dict[str, int] | None = None, state_words: str = "model") -> dict[str, Any]:
    """The trainer's peak against model + optimizer + what its engine holds to send + constant
    (:func:`memory_bound`; the engine's term is :func:`send_buffer`'s).

    The model term is the trainer's model state: its fp32 master parameters and their gradients
    (``param_bytes + grad_bytes``); the optimizer term is AdamW's states (``optimizer_bytes``). The peak is
    reached in the backward pass, when every gradient exists beside the parameters and the optimizer states;
    the published buffer (``published_bytes``: bf16 for presets) exists only after the gradients are freed.
    ``device_words``/``device_terms`` (:func:`host_device_terms`) are what a host-backed device adds;
    ``state_words`` names the model state in the form (a sharded trainer's rank: ``"shards"``).
    """
    words, sending = send_buffer(engine_cls, bucket_bytes, published_bytes)
    form = (f"{state_words} (parameters + gradients) + optimizer + " + (f"{words} + " if words else "")
            + (f"{device_words} + " if device_words else "") + "constant")
    return memory_bound(peak_bytes, form, {"model_bytes": param_bytes + grad_bytes, "optimizer_bytes": optimizer_bytes,
                                           **sending, **(device_terms or {}), "constant_bytes": RUNTIME_BYTES})


def host_device_terms(kind: str, step_temporaries_bytes: int = 0,
                      offloaded_bytes: int = 0, working_bytes: int = 0) -> tuple[str, dict[str, int]]:
    """What a kind whose device memory is host memory (the simulated npu: ``DeviceSpec.device_memory_in_host``)
    adds to a host bound: ``(words, {term: bytes})``; ``("", {})`` for every other kind.

    The terms: the device allocator's resident cache (``device_cache_bytes``: freed blocks it may keep
    resident, ``DeviceSpec.host_cached_bytes()``); when given, the optimizer step's temporaries
    (``optimizer_step_bytes``: on a device they are device memory, here they are the host's); and the host
    buffers an engine offloads into (``offload_buffers_bytes``: the bytes it offloads; it keeps them for the
    next offload, ``engines.host_buffers``, so here they stand beside the onloaded tensors); and when given, the
    step's device working memory (``device_working_bytes``: what the device's own allocator counted at its peak
    beyond the states and the temporaries above: activations and the backward's transients, about 1.2 GB for the
    0.5B preset; on a device it is device memory, here the host's, on top of what :data:`RUNTIME_BYTES` holds).
    """
    spec = hal.resolve_device(kind)
    if not spec.device_memory_in_host:
        return "", {}
    words, terms = "the device allocator's resident cache", {"device_cache_bytes": spec.host_cached_bytes()}
    if step_temporaries_bytes:
        words += " + the optimizer step's temporaries"
        terms["optimizer_step_bytes"] = step_temporaries_bytes
    if offloaded_bytes:
        words += " + the offload's host buffers"
        terms["offload_buffers_bytes"] = offloaded_bytes
    if working_bytes > 0:
        words += " + the step's device working memory"
        terms["device_working_bytes"] = working_bytes
    return words, terms


def rollout_memory_bounds(peak_bytes: int, model_bytes: int, banks: int, bucket_bytes: int,
                          device_words: str = "", device_terms: dict[str, int] | None = None,
                          senders: int = 1) -> dict[str, Any]:
    """A rollout's peak against the bound of its apply mode, and against the single-bank form.

    Returns:
        ``{"mode", "judged_by": memory_bound(...), "model_plus_2_buckets": memory_bound(...)}``:
        ``judged_by`` is the bound the rollout is held to: ``model + 2 buckets + constant`` in place (one
        bank), ``2 x model + 2 buckets + constant`` atomic (a second bank receives the update, so a failed
        one leaves the previous weights in service); ``model_plus_2_buckets`` is the single-bank form,
        reported for both modes (an atomic rollout exceeds it by design). ``device_words``/``device_terms``
        (:func:`host_device_terms`) are added to both forms. With ``senders`` trainer ranks sending (a sharded
        trainer), the engine receives every sender's lane at once: 2 buckets per sender (``ckpt.multi_sender``).
    """
    count = ROLLOUT_BUCKETS * senders
    buckets = {"buckets_bytes": count * bucket_bytes, **(device_terms or {}), "constant_bytes": RUNTIME_BYTES}
    tail = f" + {count} buckets + " + (f"{device_words} + " if device_words else "") + "constant"
    single = memory_bound(peak_bytes, "model" + tail, {"model_bytes": model_bytes, **buckets})
    judged = single if banks == 1 else memory_bound(
        peak_bytes, f"{banks} x model" + tail, {"model_bytes": banks * model_bytes, **buckets})
    return {"mode": "in-place" if banks == 1 else "atomic", "judged_by": judged, "model_plus_2_buckets": single}


def held_before_terms(resident_before: int) -> tuple[str, dict[str, int]]:
    """What the process held, when the job's worker was built, beyond :data:`IMPORTS_BYTES`: ``(words,
    {"held_before_bytes": bytes})``, or ``("", {})`` when it held no more (a process of its own, as every
    launcher but the colocated one starts). A job run inside a longer-lived process (a pytest worker, which
    keeps what earlier tests left, up to 1.1 GB measured; an application calling ``run``) is judged by what it
    adds, not by what its host already held.

    Args:
        resident_before: the process's resident bytes (:func:`resident_bytes`) before the worker built anything.
    """
    held = resident_before - IMPORTS_BYTES
    return ("what the process held before the job", {"held_before_bytes": held}) if held > 0 else ("", {})


# ---- peaks ------------------------------------------------------------------------------------------
def reset_peak(kind: str) -> None:
    """Start a new peak-memory window: host VmHWM (Linux clear_refs 5) and the device's peak counter."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    with contextlib.suppress(Exception):
        hal.get_torch_device(kind).reset_peak_memory_stats()


def proc_status_bytes(field: str) -> int | None:
    """A size field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``: kB there), in bytes; ``None`` where
    ``/proc`` is unavailable (not Linux)."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``VmRSS``), in bytes; 0 where ``/proc`` is unavailable."""
    return proc_status_bytes("VmRSS") or 0


def held_resident_bytes() -> int:
    """This process's resident memory less its file-backed pages (Linux ``RssAnon + RssShmem``: heap, anonymous
    and shared-memory maps), in bytes; 0 where ``/proc`` is unavailable. What a leak can hold: ``VmRSS`` also
    counts the mapped libraries' pages, which grow once when first touched (measured: the first C++ exception
    torch raises in a process makes the unwinder read libtorch's unwind tables, ``RssFile`` +6.2 MB,
    ``RssAnon`` unchanged) and are the kernel's to reclaim."""
    return (proc_status_bytes("RssAnon") or 0) + (proc_status_bytes("RssShmem") or 0)


def device_cache_in_host_bytes(kind: str) -> int:
    """Host bytes this process's device of ``kind`` holds resident for freed blocks its caching allocator keeps
    (a kind whose device memory is host memory, ``DeviceSpec.device_memory_in_host``: the simulated npu); 0 for
    every other kind. On a real device that cache is device memory torch's caching allocators keep reserved,
    not host memory a leak holds.

    Raises:
        hal.HalError: the kind is unknown or unusable here.
    """
    local = hal.resolve_local_device(kind)
    return local.spec.host_cache_resident_bytes(local.device.index or 0)  # the spec says 0 where it is not host memory


def peak_host_bytes() -> int:
    """Peak resident memory of this process since the last :func:`reset_peak` (VmHWM), in bytes."""
    peak = proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
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


__all__ = ["IMPORTS_BYTES", "ROLLOUT_BUCKETS", "RUNTIME_BYTES", "held_before_terms", "resident_bytes", "TRAINER_BUCKETS", "local_nbytes", "memory_bound",
           "peak_device_bytes", "peak_host_bytes", "reset_peak", "rollout_memory_bounds", "send_buffer",
           "trainer_memory_bound", "trim_host_heap"]
