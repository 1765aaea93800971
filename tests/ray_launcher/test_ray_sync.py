"""hal sync over Ray actors on a local cluster: 3 verified steps, a rollout killed mid-update, a replacement."""

from __future__ import annotations

import functools
import time

import pytest

from tests.ray_launcher._adapters import DiesMidUpdate
from tests.ray_launcher.conftest import ray, ray_cluster

from hal.cli.sync import Sync
from hal.cli.sync_ray import RaySync, SyncUpdateError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TIMEOUT = 10.0  # the checkpoint engine's timeout: a dead peer must surface within it


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(num_cpus=3, resources={"NPU_SIM": 3}) as c:
        yield c


def served(run: RaySync) -> list[tuple[int, int | None, str | None]]:
    """(rank, step served, what differs from the last published step's checksums) of every rollout."""
    (step, sums), = run.checksums.items()
    out = []
    for rank, actor in enumerate(run.rollouts, start=1):
        out.append((rank, step, ray.get(actor.verify.remote(step, sums), timeout=60)))
    return out


def test_three_steps_then_a_rollout_dies_mid_update_and_is_replaced(cluster, hal_device):
    args = Sync(device=hal_device, model="qwen2.5-tiny", rollouts=2, steps=5, bucket_mb=0.25, timeout=TIMEOUT)
    with RaySync(args, adapters={2: functools.partial(DiesMidUpdate, 4)}) as run:
        assert [b.kind for b in run.bindings] == [hal_device] * 3
        if hal_device == "npu-sim":  # each rank holds its own simulated npu, Ray's id made visible by hal
            assert sorted(b.device_id for b in run.bindings) == ["0", "1", "2"]
            assert {(b.visible, b.local_index, b.set_by) for b in run.bindings} == \
                {(b.device_id, 0, "hal") for b in run.bindings}
        for step in (1, 2, 3):
            row = run.step(step)
            assert row["bytes"] > 0 and row["tensors"] > 0 and row["global_steps"] == step
            assert [(r["rank"], r["served_step"], r["error"]) for r in row["rollouts"]] == [(1, step, None),
                                                                                           (2, step, None)]
        assert served(run) == [(1, 3, None), (2, 3, None)]
        # step 4: rollout 2 dies after its first tensor; the update fails within the timeout, naming it
        start = time.monotonic()
        with pytest.raises(SyncUpdateError, match=r"rollout rank 2 on node [\d.]+.* died") as info:
            run.step(4)
        assert time.monotonic() - start < TIMEOUT + 30, str(info.value)
        # the other rollout keeps serving step 3, byte for byte
        assert ray.get(run.rollouts[0].verify.remote(3, run.checksums[3]), timeout=60) is None
        # a replacement in the dead one's bundle; the next update reaches both
        run.replace_rollout(2)
        row = run.step(5)
        assert [(r["rank"], r["served_step"], r["error"]) for r in row["rollouts"]] == [(1, 5, None), (2, 5, None)]
        assert served(run) == [(1, 5, None), (2, 5, None)]


def test_the_ray_launcher_runs_the_collective_engine_only():
    from hal.cli.sync import validate

    with pytest.raises(ValueError, match="--launcher ray runs the collective engine"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray", engine="file"))
    validate(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray"))  # the default launcher stays torchrun
    assert Sync().launcher == "torchrun"


def test_hal_sync_on_an_existing_cluster_by_address(cluster):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    env.update({k: v for k, v in cluster.env().items() if k.startswith("RAY_AUTH")})
    out = subprocess.run([sys.executable, "-m", "hal.cli.main", "sync", "--launcher", "ray", "--address",
                          cluster.address, "--device", "npu-sim", "--model", "qwen2.5-tiny", "--rollouts", "2",
                          "--steps", "2", "--timeout", "60", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["verified"] and result["launcher"] == "ray" and len(result["rows"]) == 2
    assert [[r["served_step"] for r in row["rollouts"]] for row in result["rows"]] == [[1, 1], [2, 2]]
    assert sorted(w["device_id"] for w in result["workers"]) == ["0", "1", "2"]
    assert {w["resource"] for w in result["workers"]} == {"NPU_SIM"}
    # the run released its placement group: every NPU_SIM of the cluster is free again
    deadline = time.monotonic() + 30
    while ray.available_resources().get("NPU_SIM") != 3.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)
