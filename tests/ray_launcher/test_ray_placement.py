"""hal.ray on a local Ray cluster with declared resources: bundles by the kind's resource, one device per actor."""

from __future__ import annotations

import os

import pytest

from tests.ray_launcher.probe_actors import EnvProbe
from tests.ray_launcher.conftest import ray

import hal
from hal import ray as hal_ray

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@ray.remote
class Probe:
    """An actor that binds its device the way hal's workers do and reports what it sees."""

    def __init__(self, kind: str) -> None:
        self.binding = hal_ray.bind_assigned_device(kind)

    def report(self) -> dict:
        out = {"assigned": ray.get_runtime_context().get_assigned_resources(),
               "env": {k: os.environ.get(k) for k in ("HAL_DEVICE", "LOCAL_RANK", "ASCEND_RT_VISIBLE_DEVICES",
                                                      "CUDA_VISIBLE_DEVICES")},
               "binding": self.binding}
        import torch

        kind = self.binding.kind
        out["device"] = str(hal.get_device(kind))
        out["torch_device_count"] = hal.get_torch_device(kind).device_count()
        out["tensor_device"] = str(torch.ones(2, device=hal.get_device(kind)).device)
        return out


def test_resource_request_follows_the_spec():
    assert hal_ray.resource_request("cpu") == {"CPU": 1.0}
    assert hal_ray.resource_request("cuda", cpus=2) == {"CPU": 2.0, "GPU": 1.0}
    assert hal_ray.resource_request("npu") == {"CPU": 1.0, "NPU": 1.0}
    assert hal_ray.resource_request("npu-sim") == {"CPU": 1.0, "NPU_SIM": 1.0}
    assert hal_ray.actor_resources({"CPU": 1.0, "GPU": 1.0}) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert hal_ray.actor_resources({"CPU": 1.0, "NPU": 1.0}) == {"num_cpus": 1.0, "resources": {"NPU": 1.0}}
    assert hal_ray.node_environment(["npu-sim"])[hal_ray.UNIT_INSTANCE_ENV].split(",")[-1] == "NPU_SIM"
    assert hal_ray.node_environment(["npu", "cuda", "cpu"]) == {}
    with pytest.raises(ValueError, match="strategy"):
        hal_ray.place_workers("cpu", 1, strategy="DENSE")


def test_npu_sim_actors_land_by_resource_and_bind_their_own_device(cluster):
    placement = hal_ray.place_workers("npu-sim", rollouts=2, strategy="PACK")
    try:
        actors = [Probe.options(**placement.options(i)).remote("npu-sim") for i in range(3)]
        reports = ray.get([a.report.remote() for a in actors], timeout=120)
        bindings = [r["binding"] for r in reports]
        hal_ray.check_distinct_devices(bindings)
        assert sorted(b.device_id for b in bindings) == ["0", "1", "2"]
        for r, b in zip(reports, bindings):
            assert r["assigned"]["NPU_SIM"] == 1.0
            assert (b.set_by, b.visible, b.local_index) == ("hal", b.device_id, 0)
            assert r["env"]["HAL_DEVICE"] == "npu-sim" and r["env"]["LOCAL_RANK"] == "0"
            assert r["env"]["ASCEND_RT_VISIBLE_DEVICES"] == b.device_id
            # the sim sees exactly the one device Ray assigned, as torch_npu would
            assert (r["device"], r["tensor_device"], r["torch_device_count"]) == ("npu:0", "npu:0", 1)
        assert len({b.pid for b in bindings}) == 3
        # while the three hold every NPU_SIM, a fourth worker of the kind cannot be placed: a clear error
        with pytest.raises(hal_ray.RayLaunchError, match="NPU_SIM"):
            hal_ray.place_workers("npu-sim", rollouts=1, timeout=3)
    finally:
        placement.remove()


def test_ray_sets_the_visible_devices_of_its_own_accelerators(cluster):
    # NPU and GPU are Ray's own accelerators: Ray sets ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES itself
    for kind, env, resource in (("npu", "ASCEND_RT_VISIBLE_DEVICES", "NPU"), ("cuda", "CUDA_VISIBLE_DEVICES", "GPU")):
        assert hal_ray.ray_sets_visible_devices(resource)
        placement = hal_ray.place_workers(kind, rollouts=1, strategy="SPREAD")
        try:
            actors = [EnvProbe.options(**placement.options(i)).remote() for i in range(2)]
            reports = ray.get([a.report.remote() for a in actors], timeout=120)
            assert sorted(r["env"][env] for r in reports) == ["0", "1"]
            assert all(r["assigned"][resource] == 1.0 for r in reports)
        finally:
            placement.remove()
    assert not hal_ray.ray_sets_visible_devices("NPU_SIM")


def test_cpu_workers_ask_for_cpus_only(cluster):
    placement = hal_ray.place_workers("cpu", rollouts=2, strategy="SPREAD")
    try:
        assert placement.bundles == [{"CPU": 1.0}] * 3 and placement.strategy == "SPREAD"
        assert placement.options(2)["num_cpus"] == 1.0 and "resources" not in placement.options(2)
        assert len(placement.node_ids()) == 3
    finally:
        placement.remove()


def test_with_rays_noset_switch_nobody_sets_the_variable_and_the_id_is_the_index(cluster):
    # RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1: hal leaves the variable alone, as Ray does for NPU,
    # and binds Ray's node-wide id as the local index (every device of the node stays visible)
    noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1", "HAL_SIM_NPU_COUNT": "3"}}
    placement = hal_ray.place_workers("npu-sim", rollouts=1)
    try:
        actors = [Probe.options(**placement.options(i), runtime_env=noset).remote("npu-sim") for i in range(2)]
        reports = ray.get([a.report.remote() for a in actors], timeout=120)
        for r in reports:
            b = r["binding"]
            assert (b.set_by, b.visible, r["env"]["ASCEND_RT_VISIBLE_DEVICES"]) == ("noset", None, None)
            assert b.local_index == int(b.device_id) and r["device"] == f"npu:{b.device_id}"
            assert r["tensor_device"] == f"npu:{b.device_id}" and r["torch_device_count"] == 3
        hal_ray.check_distinct_devices([r["binding"] for r in reports])
    finally:
        placement.remove()


def test_two_workers_bound_to_one_device_of_a_node_are_refused():
    def binding(node: str, device: str) -> hal_ray.DeviceBinding:
        return hal_ray.DeviceBinding("npu-sim", "NPU_SIM", (device,), "ASCEND_RT_VISIBLE_DEVICES", device, "hal",
                                     0, device, node, f"ip-{node}", 1)

    hal_ray.check_distinct_devices([binding("a", "0"), binding("a", "1"), binding("b", "0")])  # distinct: fine
    with pytest.raises(hal_ray.RayLaunchError, match=r"workers 0 and 2 both bound NPU_SIM 1 on node ip-a"):
        hal_ray.check_distinct_devices([binding("a", "1"), binding("b", "1"), binding("a", "1")])
