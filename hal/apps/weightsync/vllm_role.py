"""A rollout's role backed by vLLM (``hal sync --rollout vllm``): the step loop's calls, served by an in-process
:class:`~hal.apps.weightsync.vllm_rollout.VllmRollout`.

hal's checkpoint engine lives inside vLLM's worker and the manager runs its lifecycle on that object, so the
vLLM rollout joins the trainer's group as hal's own does. Per step it proves the step it serves, the CRC-32 of
every tensor as received, and vLLM's greedy tokens against the trainer's (exact in float32).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import time
from typing import Any

from hal.apps.weightsync.messages import Checked, Received, Reference
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.verify import first_mismatch
from hal.apps.weightsync.worker import RolloutRole, Where

LOGGING_STREAM_ENV = "VLLM_LOGGING_STREAM"  # default stdout; the role sends it to stderr

# the name a fault-injected update announces: never sent, so the update is refused after it arrived
FAULT_TENSOR = "hal.fault-injection"
# tests: comma-separated global_steps whose update every vLLM rollout refuses after receiving it (each
# tensor-parallel server's rank 0 only)
REFUSE_STEPS_ENV = "HAL_TEST_VLLM_REFUSE_STEPS"


def refuse_steps() -> frozenset[int]:
    """The steps :data:`REFUSE_STEPS_ENV` names (empty when unset); ValueError names a malformed value."""
    text = os.environ.get(REFUSE_STEPS_ENV, "").strip()
    parts = [part.strip() for part in text.split(",")] if text else []
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ValueError(f"{REFUSE_STEPS_ENV}={text!r}: expected comma-separated global_steps (integers >= 0), "
                         "such as '2' or '2,5'")
    return frozenset(int(part) for part in parts)


def save_initial_model(options: JobOptions, root: str | None = None) -> JobOptions:
    """Write the trainer's initial preset model (``save_pretrained``, the published dtype) into a new temporary
    directory for vLLM; returns ``options`` with ``vllm_model_dir`` set."""
    import torch

    from hal.apps.weightsync import models

    if options.model not in models.PRESETS:
        raise ValueError(f"the vLLM rollout serves a preset ({sorted(models.PRESETS)}), got {options.model!r}")
    module, _ = models.build(options.model)
    path = pathlib.Path(tempfile.mkdtemp(prefix="hal-sync-vllm-", dir=root)) / options.model
    module.to(getattr(torch, options.published_dtype)).save_pretrained(path)
    return dataclasses.replace(options, vllm_model_dir=str(path))


def worker_engine(worker: Any) -> Any:
    """hal's checkpoint engine inside a vLLM worker; runs there through ``collective_rpc``."""
    state = getattr(getattr(worker, "weight_transfer_engine", None), "state", None)
    state = state if state is not None else getattr(worker, "_hal_transfer", None)
    if state is None:
        raise RuntimeError("this vLLM worker holds no hal checkpoint engine (init_weight_transfer_engine not run)")
    return state.engine


def reference_logprobs(reference: Reference) -> tuple[list[int], list[float]] | None:
    """The trainer's greedy tokens and their log-probabilities; ``None`` without a decode."""
    import torch

    if reference.tokens is None or reference.logits is None:
        return None
    logprobs = torch.log_softmax(reference.logits.float(), dim=-1)
    return list(reference.tokens), [float(logprobs[i, t]) for i, t in enumerate(reference.tokens)]


class VllmRolloutRole(RolloutRole):
    """A rollout rank (1..R) served by vLLM from ``options.vllm_model_dir`` (:func:`save_initial_model`)."""

    def __init__(self, options: JobOptions, rank: int, where: Where | None = None) -> None:
        from hal.apps.weightsync import models
        from hal.apps.weightsync.lora import max_lora_rank
        from hal.apps.weightsync.vllm_rollout import VllmRollout

        if options.vllm_model_dir is None:
            raise ValueError("VllmRolloutRole needs options.vllm_model_dir (save_initial_model writes it), got None")
        self.refuse_steps = refuse_steps()  # a bad value is told before vLLM starts
        super().__init__(options, rank, None, where)
        os.environ.setdefault(LOGGING_STREAM_ENV, "ext://sys.stderr")  # stdout is hal sync --json's
        engine_kwargs = dict(bucket_size=options.bucket_bytes, is_master=False, timeout=options.timeout)
        lora = dict(enable_lora=True, max_lora_rank=max_lora_rank(options.lora_rank), max_loras=1) \
            if options.lora_adapters else None  # one adapter, swapped in place each update
        self.vllm = VllmRollout(options.vllm_model_dir, engine_kwargs, device=options.device,
                                dtype=options.published_dtype, engine=options.engine, in_process=True,
                                llm_kwargs=lora)
        [self.engine] = self.vllm.llm.collective_rpc(worker_engine)  # the manager drives its lifecycle
        self.prompt = models.prompt_ids(options.model)[0].tolist()
        self.received: dict[str, str] = {}
        self.references: dict[int, list[int] | None] = {}

    async def update_weights(self, global_steps: int, **lora: Any) -> Received:
        """Receive ``global_steps`` into vLLM's worker, checksum it there and load it (``lora``: a LoRA update's
        ``peft_config`` and ``base_sync_done``); a failure is reported in the result, vLLM's own times in
        ``Received.vllm``."""
        started_at = time.time()
        start = time.perf_counter()
        expected = {FAULT_TENSOR: "00000000"} if global_steps in self.refuse_steps else None
        try:
            result = await self.vllm.receive(global_steps, expected, **lora)
        except Exception as exc:  # noqa: BLE001 - reported as this step's error; the previous step serves
            result = {"error": f"{type(exc).__name__}: {exc}", "bytes": 0, "receive_s": 0.0, "load_s": 0.0,
                      "checksums": {}}
        self.received = result["checksums"]
        return Received(rank=self.index, served_step=self.vllm.served_step, error=result["error"],
                        receive_s=time.perf_counter() - start, copied_bytes=result["bytes"], started_at=started_at,
                        applied_at=time.time(), held_bytes=0, peak_host_bytes=self.vllm.peak_host_bytes,
                        vllm={"startup_s": self.vllm.startup_seconds, "receive_s": result["receive_s"],
                              "load_s": result["load_s"], "bytes": result["bytes"]},
                        needs_base=result.get("needs_base"))

    def check(self, global_steps: int, reference: Reference) -> Checked:
        """What this rollout proves after ``global_steps``: the step served, vLLM's checksums and greedy tokens equal
        the trainer's, log-probabilities within ``logits_atol``."""
        start = time.perf_counter()
        served = self.vllm.served_step
        if served != global_steps:
            error = f"step {global_steps} not served: vLLM serves step {served}"
        else:
            error = first_mismatch(reference.sums, self.received)
        out = self.decode(global_steps, reference, error)
        out.verify_s = time.perf_counter() - start
        return out

    def decode(self, global_steps: int, reference: Reference, error: str | None) -> Checked:
        """``Checked(error)`` plus vLLM's greedy decode against the trainer's for the step it serves (tokens equal,
        log-probabilities within ``logits_atol``)."""
        self.references[global_steps] = reference_logprobs(reference)
        served = self.vllm.served_step
        out = Checked(error=error)
        expected = self.references.get(served) if served is not None else None
        if expected is not None:
            tokens, logprobs = expected
            out.tokens, got = self.vllm.generate_greedy(self.prompt, len(tokens), logprobs=True)
            out.tokens_equal = out.tokens == tokens
            out.logits_max_diff = max(abs(a - b) for a, b in zip(got, logprobs))
            if not out.tokens_equal and out.error is None:
                out.error = f"vLLM's greedy decode gave tokens {out.tokens}, the trainer's model {tokens}"
            elif not out.logits_max_diff <= self.options.logits_atol and out.error is None:
                out.error = (f"vLLM's log-probabilities differ from the trainer's by {out.logits_max_diff:.3g} "
                             f"(> --logits-atol {self.options.logits_atol:g})")
        return out

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """The engine's lifecycle (:meth:`Worker.execute_checkpoint_engine`); ``close`` also shuts vLLM down."""
        out = super().execute_checkpoint_engine(method, **kwargs)
        if method == "close":
            self.vllm.close()
        return out


def update_time_comparison(vllm_rows: list[dict[str, Any]], hal_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step, the update's seconds inside vLLM (receive + load) against hal's adapter on the same bytes, and
    their ratio (above 1: vLLM slower)."""
    steps = []
    for v, h in zip(vllm_rows, hal_rows):
        vllm_s = [r["vllm"]["receive_s"] + r["vllm"]["load_s"] for r in v["rollouts"] if r.get("vllm")]
        hal_s = [r["receive_s"] for r in h["rollouts"]]
        if not vllm_s or not hal_s:
            continue
        vs, hs = sum(vllm_s) / len(vllm_s), sum(hal_s) / len(hal_s)
        steps.append({"global_steps": v["global_steps"], "bytes": v["bytes"], "vllm_update_s": vs,
                      "vllm_receive_s": sum(r["vllm"]["receive_s"] for r in v["rollouts"]) / len(vllm_s),
                      "vllm_load_s": sum(r["vllm"]["load_s"] for r in v["rollouts"]) / len(vllm_s),
                      "hal_update_s": hs, "ratio": vs / hs})
    return {"steps": steps, "ratio_mean": sum(s["ratio"] for s in steps) / len(steps) if steps else None}


__all__ = ["FAULT_TENSOR", "REFUSE_STEPS_ENV", "VllmRolloutRole", "refuse_steps", "save_initial_model",
           "update_time_comparison", "worker_engine"]
