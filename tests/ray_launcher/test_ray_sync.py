"""hal sync over Ray actors on the shared local cluster (the job with its Ray launcher, and the end-to-end run): verified steps (decode and checksums, as under torchrun),
a rollout killed mid-update failing the update at once, a replacement, a rollout killed before the raw group
forms failing that phase at once; the CLI on a cluster given by address."""

from __future__ import annotations

import functools
import time

import pytest

from tests.ray_launcher.rollout_adapters import DiesMidUpdate
from tests.ray_launcher.conftest import ray

from ckpt.manager import UpdateError
from hal.apps.cli.sync import Sync, job_options
from hal.apps.weightsync.launchers.ray import RayJob
from hal.apps.weightsync.raw import RawReference
from hal.apps.weightsync.rollout import Rollout

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TIMEOUT = 20.0  # the checkpoint engine's timeout: waiting it out would take at least this long


def check_row(row: dict, step: int, rollouts: int = 2) -> None:
    """What every verified step of the Ray launcher reports, as the torchrun launcher's rows do."""
    assert row["global_steps"] == step and row["tensors"] == 26 and row["bytes"] > 1_700_000  # tiny, bf16
    assert [(r["rank"], r["served_step"], r["error"]) for r in row["rollouts"]] == \
        [(rank, step, None) for rank in range(1, rollouts + 1)]
    assert len(row["tokens"]) == 4
    for r in row["rollouts"]:  # each served model decodes exactly what the trainer's own bf16 model does
        assert r["tokens"] == row["tokens"] and r["tokens_equal"] is True and r["logits_max_diff"] <= 1e-2
        assert 0 < r["peak_host_bytes"] <= r["memory_bound_bytes"]
    assert row["raw_s"] > 0 and row["ratio_vs_raw"] > 0 and len(row["raw_s_each"]) == 2  # the add-on measured
    assert 0 < row["peak_host_bytes"] <= row["memory_bound_bytes"]


@pytest.mark.hal_device("cpu")  # npu-sim runs the whole loop in the test by address below
def test_steps_then_a_rollout_dies_mid_update_fails_it_at_once_and_is_replaced(cluster, hal_device):
    options = job_options(Sync(device=hal_device, model="qwen2.5-tiny", rollouts=2, steps=4, bucket_mb=0.25,
                               timeout=TIMEOUT))
    with RayJob(options, [RawReference()], adapters={2: functools.partial(DiesMidUpdate, at_step=3)}) as run:
        assert [b.kind for b in run.bindings] == [hal_device] * 3
        run.warmup()
        rows = [run.step(step) for step in (1, 2)]
        for step, row in enumerate(rows, start=1):
            check_row(row, step)
        assert rows[1]["loss"] < rows[0]["loss"]  # the trainer really stepped
        # step 3: rollout 2 dies after its first tensor; the update fails as soon as Ray reports the death,
        # naming it, long before the engine's timeout would have passed
        start = time.monotonic()
        with pytest.raises(UpdateError, match=r"rollout rank 2 on node [\d.]+.* died") as info:
            run.step(3)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT / 2, (elapsed, str(info.value))
        assert "rollout rank 1" not in str(info.value)  # the survivor did not fail
        # the other rollout keeps serving step 2, byte for byte
        assert run.call(1, Rollout.verify, 2, run.checksums[2]) is None
        # a replacement in the dead one's bundle; the next update reaches both, verified
        run.replace_rollout(2)
        check_row(run.step(4), 4)
        # a death outside the update: another replacement (the next step forms a new raw group first), killed
        # as that step begins; the others wait in the group's rendezvous until the timeout, the step does not
        run.replace_rollout(2)
        ray.kill(run.group.actors[2], no_restart=True)
        start = time.monotonic()
        with pytest.raises(UpdateError, match=r"^raw group failed: rollout rank 2 on node [\d.]+.* died") as info:
            run.step(5)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT / 2, (elapsed, str(info.value))
        assert "rollout rank 1" not in str(info.value) and "trainer" not in str(info.value)


def test_the_ray_launcher_runs_the_collective_and_ipc_engines_only():
    from hal.apps.cli.sync import validate

    with pytest.raises(ValueError, match=r"--launcher ray runs engines collective, ipc \(collective across nodes, ipc "
                                         r"with every actor on one node\), got --engine file"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray", engine="file"))
    validate(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray", engine="ipc"))
    validate(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray"))  # the default launcher stays torchrun
    assert Sync().launcher == "torchrun"


@pytest.mark.hal_device("cpu")
def test_ray_actors_on_one_node_hand_over_through_the_ipc_engine(cluster, hal_device):
    options = job_options(Sync(device=hal_device, model="qwen2.5-tiny", rollouts=2, steps=2, bucket_mb=0.25,
                               timeout=TIMEOUT, engine="ipc"))
    with RayJob(options, [RawReference()]) as run:
        assert len({b.node_ip for b in run.bindings}) == 1  # the engine's topology refuses two hosts
        run.warmup()
        for step in (1, 2):
            check_row(run.step(step), step)


def test_hal_sync_on_an_existing_cluster_by_address(cluster):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    env.update({k: v for k, v in cluster.env().items() if k.startswith("RAY_AUTH")})
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--launcher", "ray", "--address",
                          cluster.address, "--device", "npu-sim", "--model", "qwen2.5-tiny", "--rollouts", "1",
                          "--steps", "2", "--timeout", "60", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["verified"] and result["launcher"] == "ray" and len(result["rows"]) == 2
    # step 0 (the initial weights, untimed) and the summary, as under torchrun
    assert result["warmup"]["errors"] == [] and result["warmup"]["publish_s"] > 0 and result["warmup"]["raw_s"] > 0
    assert result["memory_within"] is True
    assert 0 < result["ratio_vs_raw_min"] <= result["rows"][0]["ratio_vs_raw"]
    for step, row in enumerate(result["rows"], start=1):
        check_row(row, step, rollouts=1)
    ids = [w["device_id"] for w in result["workers"]]  # trainer and rollout: each its own simulated npu
    assert len(set(ids)) == 2 and set(ids) <= {"0", "1", "2"} and len({w["pid"] for w in result["workers"]}) == 2
    assert {w["resource"] for w in result["workers"]} == {"NPU_SIM"}
    # the run released its placement group: every NPU_SIM of the cluster is free again
    deadline = time.monotonic() + 30
    while ray.available_resources().get("NPU_SIM") != 3.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)
