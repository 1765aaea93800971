"""verl 0.9.1's own CheckpointEngineManager drives hal-collective with every trainer rank a sender (issue 22):
prepare, build_topology, init_process_group, concurrent send/receive, finalize, with 2 trainer ranks (each
publishing its FSDP2 dim-0 rows) and 2 rollouts, byte-exact, three updates (the interop lane)."""

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl 0.9.1 is not installed (the verl extra)")

from hal.apps.multiprocess import run_multiprocess
from tests.interop import verl_multi_sender_workers as workers

pytestmark = pytest.mark.interop

N_TENSORS = len(workers.weights(0))


def test_verls_manager_drives_two_senders_and_two_rollouts_byte_exact(hal_device):
    import hal

    reports = run_multiprocess(workers.manager_multi_sender, 1, hal_device, 3, timeout=240)[0]
    assert [r["update"] for r in reports] == [1, 2, 3]
    for r in reports:
        assert r["served"] == [r["update"]] * 2
        assert r["exact"] == [N_TENSORS, N_TENSORS]
        assert r["devices"] == [hal.get_device(hal_device).type]
        roles = [(t["rank"], t["role"]) for t in r["topology"]]
        assert roles == [(0, "sender"), (1, "sender"), (2, "receiver"), (3, "receiver")]
        assert all(t["senders"] == [0, 1] and t["world_size"] == 4 for t in r["topology"])
