"""verl 0.9.1's own code drives hal's checkpoint engines (the interop lane: the ``verl`` extra and verl 0.9.1
installed as scripts/setup.sh does)."""

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl 0.9.1 is not installed (the verl extra)")

from hal.apps.multiprocess import run_multiprocess
from tests.interop import verl_ckpt_workers

pytestmark = pytest.mark.interop

N_TENSORS = len(verl_ckpt_workers.weights(0))


def test_importing_hal_and_ckpt_does_not_import_verl():
    code = "import sys, hal, ckpt, ckpt.collective, ckpt.colocated; print('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_plugin_registers_hal_engines_in_verls_registry():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import ckpt
    from ckpt.verl_plugin import REGISTERED

    for name in ("collective", "colocated", "file"):
        assert CheckpointEngineRegistry.get(f"hal-{name}") is ckpt.checkpoint_engine_factory(name)
    assert set(REGISTERED) >= {"hal-collective", "hal-colocated", "hal-file"}
    engine = CheckpointEngineRegistry.new("hal-colocated", bucket_size=1 << 20, is_master=True)
    assert engine.bucket_size == 1 << 20 and engine.is_master


def test_verls_colocated_engine_is_flagged_with_the_exact_violation():
    from verl.checkpoint_engine.base import ColocatedCheckpointEngine

    import ckpt
    from ckpt.testing import CONTRACT_CHECKS, run_contract_suite

    assert ckpt.contract_violations(ColocatedCheckpointEngine) == [
        "send_weights is a plain function (def); calling it must give an awaitable ('async def')",
        "receive_weights is a plain generator function (def with yield); calling it must give an async "
        "iterator ('async def' with 'yield')"]

    class Unchecked(ColocatedCheckpointEngine):  # what the suite finds when the calls are actually made
        pass

    async def make():
        engine = Unchecked(bucket_size=1 << 20)
        return engine, engine
    import ckpt.testing as testing

    failures = asyncio.run(run_contract_suite(make, timeout=20))
    assert set(failures) == set(CONTRACT_CHECKS)
    assert failures["call_contract"].startswith("ContractError: checkpoint engine Unchecked breaks the contract: "
                                                "send_weights is a plain function (def)")
    # past the declared check, the behavioural one names the call: its result cannot be awaited
    with pytest.raises(ckpt.ContractError) as info:
        asyncio.run(testing.transfer(Unchecked(bucket_size=1), Unchecked(bucket_size=1), [], 1, 1))
    assert str(info.value) == (
        "Unchecked.send_weights(...) returned NoneType, not an awaitable: it is a plain function (def), so "
        "`await engine.send_weights(...)` raises TypeError; declare it 'async def'")
    assert "NotImplementedError" in failures["verl_lifecycle"]  # its prepare() raises


UPDATES = 8  # enough for a leak of one descriptor or group per update to show from the third update on


@pytest.mark.multiprocess
def test_verl_workers_drive_hal_collective_1_trainer_2_rollouts_and_keep_groups_and_fds_flat(hal_device):
    import hal

    results = run_multiprocess(verl_ckpt_workers.collective, 3, hal_device, UPDATES, 2, timeout=240)
    for rank, reports in results.items():
        assert [r["update"] for r in reports] == list(range(1, UPDATES + 1)), rank
        # one communicator over every update, and no descriptor left behind by one (a refused update included)
        assert [r["groups"] for r in reports] == [1] * UPDATES, rank
        assert reports[-1]["fds"] == reports[2]["fds"], (rank, [r["fds"] for r in reports])
        if rank == 0:
            continue
        for r in reports:
            assert r["devices"] == [hal.get_device(hal_device).type]  # served where the engine received
            if rank == 2 and r["update"] == 2:  # asked for step 102 while 2 was sent
                assert r["error"].startswith("VersionMismatchError") and "102" in r["error"]
                assert r["served_step"] == 1 and r["exact"] == N_TENSORS  # previous step kept, byte-exact
                # the weight checker, called from verl's rollout worker, names what it does not serve
                assert r["check"].startswith("rollout rank 2 does not serve what the trainer published: "), r["check"]
                assert all(f"{name!r} differs" in r["check"] for name in verl_ckpt_workers.weights(2)), r["check"]
            else:
                assert r["error"] is None and r["served_step"] == r["update"] and r["exact"] == N_TENSORS
                assert r["check"] is None


@pytest.fixture(scope="module")
def colocated_runs():
    """Per lane, one process running verl's worker sequence and then verl's manager over hal-colocated
    (verl is imported once for both tests of the lane): ``colocated_runs(kind)`` gives both reports."""
    runs = {}

    def get(kind: str) -> dict:
        if kind not in runs:
            runs[kind] = run_multiprocess(verl_ckpt_workers.colocated_then_manager, 1, kind, 3, timeout=110)[0]
        return runs[kind]
    return get


def test_verl_workers_drive_hal_colocated_1_trainer_2_rollouts(hal_device, colocated_runs):
    reports = colocated_runs(hal_device)["colocated"]
    assert [r["update"] for r in reports] == [1, 2, 3]
    for r in reports:
        assert r["same_engine"]
        if r["update"] == 2:
            assert r["errors"] == [None, None, "VersionMismatchError"] and r["served"] == [2, 1]
        else:
            assert r["errors"] == [None, None, None] and r["served"] == [r["update"]] * 2
        assert r["exact"] == [N_TENSORS, N_TENSORS]


def test_verls_checkpoint_engine_manager_drives_hal_colocated(hal_device, colocated_runs):
    reports = colocated_runs(hal_device)["manager"]
    assert [r["served"] for r in reports] == [[1, 1], [2, 2], [3, 3]]
    assert all(r["exact"] == [N_TENSORS, N_TENSORS] for r in reports)
