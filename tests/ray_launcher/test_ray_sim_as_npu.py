"""A Ray node whose ``NPU`` resource is the simulated npu: an actor asking Ray for ``{"NPU": 1}``, as verl's
worker groups do, gets one simulated device of its own, and hal binds it by that resource."""

from __future__ import annotations

import os

import pytest

from tests.ray_launcher.conftest import disconnect_driver, ray, ray_cluster

import hal
from hal import ray as hal_ray

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240),
              pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")]


@ray.remote
class NpuWorker:
    """What a verl worker sees: no hal call before torch's import; then hal's binding by the NPU resource."""

    def report(self) -> dict:
        import torch

        seen = {"npu": hasattr(torch, "npu") and torch.npu.device_count(),
                "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                "ray_ids": ray.get_runtime_context().get_accelerator_ids().get("NPU"),
                "tensor": str(torch.ones(2, device="npu").device) if hasattr(torch, "npu") else None}
        binding = hal_ray.bind_assigned_device("npu-sim")
        seen.update(resource=binding.resource, set_by=binding.set_by, local_index=binding.local_index,
                    device_id=binding.device_id)
        return seen


def test_actors_asking_ray_for_npu_run_on_the_sim():
    assert hal_ray.node_environment([], {"npu-sim": "NPU"}) == {
        hal_ray.SCHEDULE_AS_ENV: "npu-sim=NPU", "HAL_DEVICE": "npu-sim"}
    disconnect_driver()
    try:
        with ray_cluster(num_cpus=2, resources={"NPU": 2}, schedule_as={"npu-sim": "NPU"}):
            assert hal_ray.resource_request("npu-sim") == {"CPU": 1.0, "NPU": 1.0}  # the driver places by NPU too
            workers = [NpuWorker.options(num_cpus=0, resources={"NPU": 1}).remote() for _ in range(2)]
            reports = ray.get([w.report.remote() for w in workers], timeout=150)
    finally:
        os.environ.pop(hal_ray.SCHEDULE_AS_ENV, None)
    assert sorted(r["device_id"] for r in reports) == ["0", "1"]  # each its own simulated device
    for r in reports:
        # Ray set the visible device, and the sim registered inside import torch over exactly that one
        assert r["visible"] == r["device_id"] and r["ray_ids"] == [r["device_id"]]
        assert (r["npu"], r["tensor"], r["resource"], r["set_by"], r["local_index"]) == (1, "npu:0", "NPU", "ray", 0)
