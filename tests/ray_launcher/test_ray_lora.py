"""hal sync --lora-rank over Ray actors (issue 48): a rollout killed between updates and restarted in its bundle
gets the base again before the next adapter, and every rollout verifies that step and the next (adapter alone)."""

from __future__ import annotations

import pytest

from tests.ray_launcher.conftest import ray

from hal.apps.cli.sync import Sync, job_options
from hal.apps.weightsync.launchers.ray import RayJob

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
pytest.importorskip("peft")


def check(row: dict, step: int, base: bool) -> None:
    assert row["global_steps"] == step and row["lora"]["base_sync_done"] is (not base)
    assert row["bytes"] == (1_788_160 + 74_752 if base else 74_752)  # tiny, bf16: base and adapter, or adapter
    assert [(r["rank"], r["served_step"], r["error"], r["needs_base"]) for r in row["rollouts"]] == \
        [(1, step, None, False), (2, step, None, False)]
    assert all(r["tokens"] == row["tokens"] and r["logits_max_diff"] == 0.0 for r in row["rollouts"])
    assert row["lora"]["adapter_logits_shift"] > 0.1


@pytest.mark.hal_device("cpu")
def test_a_killed_and_restarted_rollout_gets_the_base_before_the_next_adapter(cluster, hal_device):
    options = job_options(Sync(device=hal_device, model="qwen2.5-tiny", rollouts=2, steps=3, bucket_mb=0.25,
                               timeout=30.0, lora_rank=8, lr=3e-2))
    with RayJob(options) as run:
        assert run.warmup()["lora"]["base_sync_done"] is False
        check(run.step(1), 1, base=False)
        killed = run.bindings[2].pid
        ray.kill(run.group.actors[2], no_restart=True)  # between updates
        assert run.replace_rollout(2).pid != killed  # a new process, holding no base
        check(run.step(2), 2, base=True)
        check(run.step(3), 3, base=False)
