"""Memory of the weight-sync job: each rank's peak (Linux ``VmHWM``, reset per window) against a stated bound,
a sum of named terms in bytes (:func:`memory_bound`). The trainer's: model state, AdamW's states, what its
engine holds while sending (:func:`send_buffer`) and :data:`RUNTIME_BYTES`; a rollout's: its weight banks, the
engine's receive buckets and :data:`RUNTIME_BYTES`."""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
from typing import Any

import hal

# bytes a rank holds besides model, optimizer and buffers (interpreter, torch, activations of a step or decode)
RUNTIME_BYTES = 768 << 20
# of RUNTIME_BYTES, what a process holds with hal, torch and transformers imported (244 MB measured), headroom
IMPORTS_BYTES = 384 << 20

TRAINER_BUCKETS = 3  # two send buffers + one of slack
ROLLOUT_BUCKETS = 2  # the engine's two receive buffers


def local_nbytes(tensor: Any) -> int:
    """Bytes ``tensor`` holds on this rank: a ``DTensor``'s local shard (FSDP2), else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def memory_bound(peak_bytes: int, form: str, terms: dict[str, int]) -> dict[str, Any]:
    """A peak judged against a stated bound: ``{"form", "terms", "bound_bytes", "peak_bytes", "within"}``;
    ``form`` is the bound in words, ``terms`` its addends in bytes."""
    bound = sum(terms.values())
    return {"form": form, "terms": dict(terms), "bound_bytes": bound, "peak_bytes": peak_bytes,
            "within": peak_bytes <= bound}


def send_buffer(engine_cls: Any, bucket_bytes: int, published_bytes: int) -> tuple[str, dict[str, int]]:
    """What a trainer's engine of class ``engine_cls`` holds while it sends, as the class states it:
    ``(words, {term: bytes})``; ValueError for a class that states nothing."""
    if not hasattr(engine_cls, "send_buffer_bytes"):
        raise ValueError(f"checkpoint engine class {getattr(engine_cls, '__name__', engine_cls)!r} states no "
                         "send_buffer_bytes (ckpt.CheckpointEngine's classmethod): its memory bound is unknown")
    return (getattr(engine_cls, "send_buffer_words", ""),
            dict(engine_cls.send_buffer_bytes(bucket_bytes, published_bytes)))


def trainer_memory_bound(peak_bytes: int, param_bytes: int, grad_bytes: int, optimizer_bytes: int, engine_cls: Any,
                         bucket_bytes: int, published_bytes: int, device_words: str = "",
                         device_terms: dict[str, int] | None = None, state_words: str = "model") -> dict[str, Any]:
    """The trainer's peak against model (fp32 parameters + gradients) + AdamW states + its engine's send buffer +
    constant (:func:`memory_bound`)."""
    words, sending = send_buffer(engine_cls, bucket_bytes, published_bytes)
    form = (f"{state_words} (parameters + gradients) + optimizer + " + (f"{words} + " if words else "")
            + (f"{device_words} + " if device_words else "") + "constant")
    return memory_bound(peak_bytes, form, {"model_bytes": param_bytes + grad_bytes, "optimizer_bytes": optimizer_bytes,
                                           **sending, **(device_terms or {}), "constant_bytes": RUNTIME_BYTES})


def host_device_terms(kind: str, step_temporaries_bytes: int = 0,
                      offloaded_bytes: int = 0, working_bytes: int = 0) -> tuple[str, dict[str, int]]:
    """What a kind whose device memory is host memory (the simulated npu) adds to a host bound: ``(words,
    {term: bytes})`` (allocator cache, step temporaries, offload buffers, device working memory); ``("", {})``
    for every other kind."""
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
    """A rollout's peak against its apply mode's bound (``judged_by``: 1 bank in place, 2 atomic, + 2 buckets per
    sender + constant) and the single-bank form (``model_plus_2_buckets``)."""
    count = ROLLOUT_BUCKETS * senders
    buckets = {"buckets_bytes": count * bucket_bytes, **(device_terms or {}), "constant_bytes": RUNTIME_BYTES}
    tail = f" + {count} buckets + " + (f"{device_words} + " if device_words else "") + "constant"
    single = memory_bound(peak_bytes, "model" + tail, {"model_bytes": model_bytes, **buckets})
    judged = single if banks == 1 else memory_bound(
        peak_bytes, f"{banks} x model" + tail, {"model_bytes": banks * model_bytes, **buckets})
    return {"mode": "in-place" if banks == 1 else "atomic", "judged_by": judged, "model_plus_2_buckets": single}


def held_before_terms(resident_before: int) -> tuple[str, dict[str, int]]:
    """What the process held beyond :data:`IMPORTS_BYTES` when the job's worker was built (a pytest worker, say):
    ``(words, {"held_before_bytes": bytes})``, or ``("", {})``."""
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
    """A size field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``) in bytes; ``None`` without ``/proc``."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``VmRSS``), in bytes; 0 without ``/proc``."""
    return proc_status_bytes("VmRSS") or 0


def held_resident_bytes() -> int:
    """This process's anonymous and shared-memory resident bytes (``RssAnon + RssShmem``: what a leak can hold,
    unlike library pages); 0 without ``/proc``."""
    return (proc_status_bytes("RssAnon") or 0) + (proc_status_bytes("RssShmem") or 0)


def device_cache_in_host_bytes(kind: str) -> int:
    """Host bytes the caching allocator of a device of ``kind`` keeps resident for freed blocks, where device
    memory is host memory (the simulated npu); 0 for every other kind."""
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
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``) where available."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


__all__ = ["IMPORTS_BYTES", "ROLLOUT_BUCKETS", "RUNTIME_BYTES", "held_before_terms", "resident_bytes", "TRAINER_BUCKETS", "local_nbytes", "memory_bound",
           "peak_device_bytes", "peak_host_bytes", "reset_peak", "rollout_memory_bounds", "send_buffer",
           "trainer_memory_bound", "trim_host_heap"]
