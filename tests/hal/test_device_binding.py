"""One device per rank: what hal starts binds LOCAL_RANK's device, and the sim's hccl refuses a shared one."""

import pytest

from hal.apps.multiprocess import run_multiprocess
from tests.hal import binding_workers

pytestmark = [pytest.mark.hal_device("npu-sim"), pytest.mark.multiprocess]


def test_three_ranks_sit_on_three_devices(hal_device):
    results = run_multiprocess(binding_workers.sync_ranks_devices, 3, None, timeout=120,
                               env={"HAL_DEVICE": "npu-sim"})
    assert results[0]["trainer"] == "npu:0"
    for rank in range(3):
        r = results[rank]
        assert "error" not in r, r
        assert r["bound"] == r["buffers"] == f"npu:{rank}" and r["local_rank"] == str(rank)
        # this rank's checkpoint buffers (and the trainer's model) hold bytes on its own device only
        assert r["allocated"][rank] > 0 and sum(r["allocated"]) == r["allocated"][rank], r["allocated"]
    for rank in (1, 2):
        assert results[rank]["received"] == [("w", [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0],
                                                    [9.0, 10.0, 11.0, 12.0]], f"npu:{rank}")]


def test_the_checkpoint_group_refuses_ranks_that_share_a_device(hal_device):
    results = run_multiprocess(binding_workers.sync_ranks_devices, 3, "npu-sim:0", timeout=120,
                               env={"HAL_DEVICE": "npu-sim"})
    for rank in range(3):
        assert results[rank]["bound"] == "npu:0"
        error = results[rank].get("error", "")
        assert "Duplicate NPU detected" in error and "physical npu device 0" in error, results[rank]


def test_the_sim_hccl_refuses_two_ranks_on_one_device(hal_device):
    results = run_multiprocess(binding_workers.shared_device_group, 2, None, timeout=90,
                               env={"HAL_DEVICE": "npu-sim"})
    for rank in (0, 1):
        assert results[rank].startswith("DistBackendError: npu-sim hccl: Duplicate NPU detected: rank 1 and rank 0")


def test_a_collective_that_cpp_starts_is_the_sims_too(hal_device):
    # DTensor's all-gather is a functional collective: C++ calls the group, which must land in the sim's
    # hccl (here: its device check refuses the shared device) and not in the gloo it wraps, which took
    # npu tensors without a check and, with the caller's GIL held, could deadlock with gloo's worker.
    results = run_multiprocess(binding_workers.shared_device_full_tensor, 2, timeout=90,
                               env={"HAL_DEVICE": "npu-sim"})
    for rank in (0, 1):
        assert results[rank].startswith("DistBackendError: npu-sim hccl: Duplicate NPU detected"), results[rank]


def test_one_local_index_on_two_visible_devices_is_two_devices(hal_device):
    results = run_multiprocess(binding_workers.shared_device_group, 2, ["4", "5"], timeout=90,
                               env={"HAL_DEVICE": "npu-sim"})
    assert results == {0: "ok [3.0, 3.0]", 1: "ok [3.0, 3.0]"}


def test_a_launched_rank_needs_no_binding_to_meet_its_engine(hal_device):
    # the report: under hal launch, rank 1's hal.get_device() said npu:0 while TorchEngine put the model on npu:1
    results = run_multiprocess(binding_workers.unbound_rank_devices, 2, timeout=120, env={"HAL_DEVICE": "npu-sim"})
    for rank in (0, 1):
        assert results[rank] == {
            "local_rank": str(rank), "get_device": f"npu:{rank}", "get_device_id": rank,
            "engine": f"npu:{rank}", "params": [f"npu:{rank}"],
            "out_device": f"npu:{rank}", "out_equal": True,
            "current": 0,  # nothing was bound: torch's current device is still the default
        }
