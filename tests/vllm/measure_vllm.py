"""Figures for issue 23 (run by hand in .venv-vllm, not collected by pytest):

    .venv-vllm/bin/python -m tests.vllm.measure_vllm --dtype float32
    .venv-vllm/bin/python -m tests.vllm.measure_vllm --dtype bfloat16

One process: the trainer (hal's collective engine, rank 0 of two groups), one in-process vLLM rollout
(group A) and hal's own ``ModelRolloutAdapter`` (group B, its receiver in a thread). Each step publishes
the same weights to both, one after the other; prints JSON: vLLM's start-up seconds and memory, per step
the update's seconds inside vLLM (receive, load) and through the adapter, and the greedy-token agreement
of vLLM with transformers on the published weights over several prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time

import torch

from ckpt.collective import CollectiveCheckpointEngine
from ckpt.serving import ModelRolloutAdapter
from hal.apps.weightsync.models import causal_lm, greedy_decode
from hal.apps.weightsync.vllm_rollout import VllmRollout
from tests.vllm.trainer import PRESET, Trainer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def agreement(trainer: Trainer, rollout: VllmRollout, prompts: int, tokens: int) -> dict:
    """Greedy tokens of vLLM against transformers on the same weights, per prompt: equal or where they part,
    with transformers' logit gap there between its choice and vLLM's (how near a tie the step was)."""
    served = causal_lm(PRESET, trainer.dtype, seed=None)
    served.load_state_dict(dict(trainer.published()), strict=False)
    served.lm_head.weight = served.model.embed_tokens.weight
    rows = []
    for p in range(prompts):
        prompt = torch.randint(0, served.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(p))
        ref, logits = greedy_decode(served, prompt, tokens)
        got = rollout.generate_greedy(prompt[0].tolist(), tokens)
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        row = {"prompt": p, "equal": first is None, "first_difference": first}
        if first is not None:
            row["gap_at_difference"] = float(logits[first, ref[first]] - logits[first, got[first]])
            row["top1_logit"] = float(logits[first, ref[first]])
        rows.append(row)
    return {"prompts": prompts, "tokens": tokens, "equal": sum(r["equal"] for r in rows), "rows": rows}


async def publish(sender, receive, weights, step):
    sent, result = await asyncio.wait_for(asyncio.gather(sender.send_weights(weights, step), receive,
                                                         return_exceptions=True), 300)
    if isinstance(sent, BaseException):
        raise sent
    if isinstance(result, BaseException):
        raise result
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    trainer = Trainer(dtype)
    out: dict = {"preset": PRESET, "dtype": args.dtype, "steps": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = trainer.save(pathlib.Path(tmp) / PRESET)
        kw = dict(world_size=2, master_addr="127.0.0.1", device="cpu", timeout=120.0, bucket_size=1 << 20)
        sender_a = CollectiveCheckpointEngine(rank=0, **kw)
        sender_b = CollectiveCheckpointEngine(rank=0, **kw)
        # their stores, on ports the kernel picked
        port_a, port_b = sender_a.prepare()["master_port"], sender_b.prepare()["master_port"]
        receiver_b = CollectiveCheckpointEngine(rank=1, master_port=port_b, **kw)
        import vllm  # noqa: F401 - imported before the clock starts: start-up is vLLM's engine, not imports

        rss0 = rss_bytes()
        rollout = VllmRollout(model_dir, dict(rank=1, master_port=port_a, **{k: v for k, v in kw.items()
                                                                            if k != "device"}),
                              device="cpu", dtype=args.dtype)
        out["vllm_startup_s"] = round(rollout.startup_seconds, 3)
        out["vllm_rss_added_bytes"] = rss_bytes() - rss0
        out["process_peak_rss_bytes"] = rollout.peak_host_bytes
        out["interface"] = rollout.interface
        adapter = ModelRolloutAdapter(causal_lm(PRESET, dtype, seed=None))

        async def adapter_receive(step):
            def run():
                async def go():
                    start = time.perf_counter()
                    await adapter.update_weights(receiver_b.receive_weights(step, placement=adapter.receive_placement), step)
                    return time.perf_counter() - start
                return asyncio.run(go())
            return await asyncio.to_thread(run)

        try:
            for step in range(1, args.steps + 1):
                trainer.step(step)
                weights, expected = trainer.published(), trainer.checksums()
                v = asyncio.run(publish(sender_a, rollout.receive(step, expected), weights, step))
                a = asyncio.run(publish(sender_b, adapter_receive(step), weights, step))
                out["steps"].append({"step": step, "error": v["error"], "bytes": v["bytes"],
                                     "vllm_receive_s": round(v["receive_s"], 4), "vllm_load_s": round(v["load_s"], 4),
                                     "adapter_update_s": round(a, 4),
                                     "checksums_equal": v["checksums"] == expected})
            out["agreement"] = agreement(trainer, rollout, args.prompts, args.tokens)
        finally:
            rollout.close()
            for engine in (sender_a, sender_b, receiver_b):
                engine.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
