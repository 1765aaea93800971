"""An engine's warm offload round trip on npu-sim under the resident cache limit: the onload finds the blocks
its offload freed still resident (nothing repopulated) when they fit under ``HAL_SIM_CACHE_RESIDENT_MB``, even
after a step left its temporaries in the cache, while the free blocks never hold more than the limit.

Runs in a fresh process: the limit is read once per process and the counters of ``torch.npu.host_cache_stats``
add up over its life.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import hal

REPO = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not hal.availability("npu-sim"),
                                reason=f"npu-sim unavailable: {hal.availability('npu-sim').reason}")

ROUND_TRIPS = """
import json, torch
from torch import nn
from engines import TorchEngine
MIB = 1 << 20
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))  # 1 MiB weights: one 1 MiB block each
engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "npu-sim")
x = torch.randn(8, 512).to(engine.torch_device)

def loss_fn(m):
    activations = torch.ones(40 * MIB, dtype=torch.uint8, device=engine.torch_device)  # freed in the step
    return m(x).square().mean() + activations[:1].float().sum() * 0

rounds = []
for _ in range(3):
    engine.train_step(loss_fn)
    in_use = torch.npu.memory_allocated()
    before = torch.npu.host_cache_stats()
    engine.to("cpu")
    offloaded = torch.npu.host_cache_stats()
    moved_blocks = in_use - torch.npu.memory_allocated()
    engine.to("npu-sim")
    onloaded = torch.npu.host_cache_stats()
    rounds.append({"moved_blocks": moved_blocks, "moved_bytes": engine.last_moved_bytes, "before": before,
                   "offloaded": offloaded, "onloaded": onloaded})
print(json.dumps(rounds))
"""


def test_a_warm_onload_repopulates_nothing_when_the_engines_blocks_fit_under_the_limit():
    env = {**os.environ, "HAL_DEVICE": "npu-sim", "HAL_SIM_CACHE_RESIDENT_MB": "48"}
    done = subprocess.run([sys.executable, "-c", ROUND_TRIPS], capture_output=True, text=True, timeout=180,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(done.stdout.strip().splitlines()[-1])
    for r in rounds:
        # parameters, gradients, exp_avg and exp_avg_sq: 24 blocks of 1 MiB (whole pages: no rounding held for
        # nothing) and 24 small ones
        assert 24 * MIB <= r["moved_blocks"] < 25 * MIB and r["moved_bytes"] > 24 * MIB
        # the step's 40 MiB of activations stayed resident in the cache until the offload needed the room...
        assert r["before"]["resident_bytes"] >= 40 * MIB
        # ...then gave their pages back, the engine's blocks staying resident within the limit
        assert r["offloaded"]["resident_bytes"] <= 48 * MIB
        assert r["offloaded"]["dropped_bytes"] - r["before"]["dropped_bytes"] == 40 * MIB
        # the onload took exactly those blocks back: not a page repopulated
        assert r["onloaded"]["repopulated_bytes"] == r["offloaded"]["repopulated_bytes"]
