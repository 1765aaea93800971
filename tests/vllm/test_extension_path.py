"""The worker-extension path (for a vLLM without WeightTransferEngineFactory), in a process of its own:
one vLLM engine per process in-process mode, and the module's shared rollout uses the other path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")

SCRIPT = r"""
import asyncio, json, sys, tempfile, pathlib, torch
from ckpt.collective import CollectiveCheckpointEngine
from hal.apps.weightsync.vllm_rollout import VllmRollout
from tests.vllm.trainer import Trainer

trainer = Trainer(torch.float32)
kw = dict(world_size=2, master_addr="127.0.0.1", timeout=120.0, bucket_size=1 << 20)
sender = CollectiveCheckpointEngine(rank=0, device="cpu", **kw)
kw["master_port"] = sender.prepare()["master_port"]  # its store, on a port the kernel picked
with tempfile.TemporaryDirectory() as tmp:
    rollout = VllmRollout(trainer.save(pathlib.Path(tmp) / "m"), dict(rank=1, **kw), device="cpu",
                          interface="extension")
    out = {"interface": rollout.interface, "results": [], "tokens_equal": [], "tokens": [], "sent": []}
    for step, expected in ((1, None), (2, "corrupt")):
        trainer.step(step)
        sums = trainer.checksums()
        if expected == "corrupt":
            sums = {n: "00000000" for n in sums}
        async def both():
            return await asyncio.wait_for(asyncio.gather(sender.send_weights(trainer.published(), step),
                                                         rollout.receive(step, sums), return_exceptions=True), 240)
        sent, result = asyncio.run(both())
        out["sent"].append(None if sent is None else type(sent).__name__ + ": " + str(sent))
        out["results"].append({k: result[k] for k in ("error", "served_step")})
        out["tokens"].append(rollout.generate_greedy(trainer.prompt[0].tolist(), 12))
        out["tokens_equal"].append(out["tokens"][-1] == trainer.reference_tokens(12))
    rollout.close()
sender.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_the_worker_extension_path_serves_a_verified_step_and_refuses_a_corrupted_one():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["interface"] == "extension"
    assert out["results"][0] == {"error": None, "served_step": 1}
    assert out["results"][1]["served_step"] == 1 and "step 2 not served" in out["results"][1]["error"]
    assert out["sent"][0] is None and out["sent"][1].startswith("UpdateRefusedError: step 2 was not applied")
    assert out["tokens_equal"] == [True, False]  # step 2 (refused) is not what vLLM serves
    assert out["tokens"][1] == out["tokens"][0]  # step 1 still is
