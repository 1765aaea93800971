"""The documented library path (``ckpt.vllm_transfer``'s usage block) serves no cached KV of the previous
weights (issue 50, point 5; verl 6522): its ``finish_weight_update`` resets vLLM's prefix cache. In a process of
its own: one vLLM engine per process in-process mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")

SCRIPT = r"""
import asyncio, json, pathlib, tempfile, threading, torch, vllm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from ckpt.collective import CollectiveCheckpointEngine
from ckpt.vllm_transfer import EXTENSION, finish_weight_update, register_vllm_backend
from hal.apps.weightsync.vllm_rollout import DEFAULT_LLM_KWARGS
from tests.vllm.trainer import Trainer

trainer = Trainer(torch.float32)
kw = dict(world_size=2, master_addr="127.0.0.1", timeout=120.0, bucket_size=1 << 20)
sender = CollectiveCheckpointEngine(rank=0, device="cpu", **kw)
kw["master_port"] = sender.prepare()["master_port"]
prompt = TokensPrompt(prompt_token_ids=[(7 * i) % 500 + 3 for i in range(160)])  # full KV blocks: cached
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)

def logprobs():
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return [float(step[t].logprob) for step, t in zip(out.logprobs, out.token_ids)]

with tempfile.TemporaryDirectory() as tmp:
    register_vllm_backend()
    llm = vllm.LLM(model=trainer.save(pathlib.Path(tmp) / "m"), dtype="float32", worker_extension_cls=EXTENSION,
                   weight_transfer_config={"backend": "hal"}, enable_prefix_caching=True, **DEFAULT_LLM_KWARGS)
    llm.init_weight_transfer_engine({"init_info": {"engine": "collective",
                                                   "engine_kwargs": dict(rank=1, device="cpu", **kw)}})
    before = logprobs()  # the prompt's blocks are now in the prefix cache, computed with step 0
    trainer.step(1)
    sent = threading.Thread(target=lambda: asyncio.run(sender.send_weights(trainer.published(), 1)))
    sent.start()
    llm.start_weight_update()  # the usage block's sequence
    llm.update_weights({"update_info": {"global_steps": 1, "checksums": trainer.checksums()}})
    finish_weight_update(llm, weight_version="1")
    sent.join()
    served = logprobs()
    llm.reset_prefix_cache()
    fresh = logprobs()  # computed from scratch with step 1
    print("RESULT " + json.dumps({"before": before, "served": served, "fresh": fresh}))
sender.close()
"""


@pytest.mark.timeout(600)
def test_the_documented_finish_weight_update_serves_no_kv_cached_with_the_previous_weights():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["fresh"] != out["before"]  # the update moved the answer
    assert out["served"] == out["fresh"]  # no block of the prompt was served from the old weights' KV
