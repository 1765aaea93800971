"""A two-node Ray cluster on loopback addresses (head 127.0.0.1, worker 127.0.0.2), each node a ``ray start``
process this test starts and stops by pid: rollouts on the second node receive byte-exact, with global_steps."""

from __future__ import annotations

import time

import pytest

from tests.ray_launcher.conftest import connect_driver, disconnect_driver, ray

from hal.apps.cli.sync import Sync, job_options
from hal.apps.weightsync.launchers.ray import RayJob
from hal.apps.weightsync.raw import RawReference
from hal.ray import LocalCluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

WORKER_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def two_nodes():
    # one host plays two nodes: each node owns its own simulated npus of the host (0 / 1 and 2), as each
    # Ascend node owns its NPUs; Ray's slot numbers map through the node's ASCEND_RT_VISIBLE_DEVICES
    head = LocalCluster(node_ip="127.0.0.1", num_cpus=1, resources={"NPU_SIM": 1},
                        node_env={"ASCEND_RT_VISIBLE_DEVICES": "0"})
    worker = LocalCluster(node_ip=WORKER_IP, num_cpus=2, resources={"NPU_SIM": 2},
                          node_env={"ASCEND_RT_VISIBLE_DEVICES": "1,2"})
    head.start()
    try:
        worker.head, worker.token = head.address, head.token
        worker.start()
        connect_driver(head)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, f"the worker node did not join: {ray.nodes()}"
            time.sleep(0.2)
        yield head, worker
    finally:
        disconnect_driver()
        worker.stop()
        head.stop()
        assert worker.pids() == [] and head.pids() == []


def test_rollouts_on_the_second_node_receive_byte_exact_with_global_steps(two_nodes):
    nodes = {n["NodeManagerAddress"]: n["Resources"].get("NPU_SIM") for n in ray.nodes() if n["Alive"]}
    assert nodes[WORKER_IP] == 2 and len(nodes) == 2
    options = job_options(Sync(device="npu-sim", model="qwen2.5-tiny", rollouts=2, steps=2, timeout=60))
    with RayJob(options, [RawReference()], rollout_node=WORKER_IP) as run:
        trainer, *rollouts = run.bindings
        assert trainer.node_ip != WORKER_IP and {b.node_ip for b in rollouts} == {WORKER_IP}
        assert sorted(b.device_id for b in rollouts) == ["1", "2"] and trainer.device_id == "0"
        assert [(b.visible, b.local_index, b.set_by) for b in run.bindings] == \
            [(b.device_id, 0, "hal") for b in run.bindings]
        for step in (1, 2):
            row = run.step(step)
            # every tensor's CRC-32 equals the trainer's, and the served models decode what its bf16 model does
            assert [(r["rank"], r["node_ip"], r["served_step"], r["error"], r["tokens_equal"])
                    for r in row["rollouts"]] == [(1, WORKER_IP, step, None, True), (2, WORKER_IP, step, None, True)]
        (step, sums), = run.checksums.items()
        assert step == 2 and len(sums) == row["tensors"] == 26
