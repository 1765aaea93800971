"""Kimi's checkpoint-engine (``ckpt.kimi``) across processes: 1 trainer + 2 rollouts on each device kind it
runs on (npu-sim here; cuda and npu in the vendor lanes), skipped with the reason on the others. Its
in-process contract suite is in ``test_contract.py``; hal's refusal on cpu is tested there too."""

import pytest

import ckpt
from hal.testing import run_multiprocess
from tests.ckpt import _mp_p2p

pytestmark = pytest.mark.multiprocess


def _require(device):
    ok, reason = ckpt.checkpoint_engine_availability("kimi", device)
    if not ok:
        pytest.skip(f"kimi on {device}: {reason}")


def test_one_trainer_two_rollouts_byte_exact_and_a_version_mismatch_raised(hal_device):
    _require(hal_device)
    results = run_multiprocess(_mp_p2p.steps_and_version_mismatch, 3, "kimi", hal_device, timeout=150)
    assert results[0] == [(1, "sent"), (2, "sent"), (3, "sent")]
    device_type = "cpu" if hal_device == "cpu" else hal_device.split("-")[0]
    for rank in (1, 2):
        first, mismatch, third = results[rank]
        assert first == (1, "ok", 1, True, [device_type]), (rank, first)
        assert third == (3, "ok", 3, True, [device_type]), (rank, third)
        step, text, served, _, _ = mismatch
        assert step == 2 and "global_steps=1" in text and "global_steps=2" in text, (rank, mismatch)
        assert served == 1, (rank, mismatch)  # nothing of step 2 was taken


def test_rollout_killed_mid_transfer_fails_the_send_naming_it(hal_device):
    _require(hal_device)
    timeout = 8
    results = run_multiprocess(_mp_p2p.death_mid_transfer, 3, "kimi", hal_device, 2, timeout, timeout=120,
                               expect_failure=True)
    outcome, elapsed, message, _, _ = results[0]
    assert outcome in ("TransferError", "TransferTimeoutError"), (outcome, message)
    assert "rollout rank 2" in message and "step 2" in message, message
    assert elapsed < timeout + 5, elapsed  # registering 24 MiB in host memory comes before the wait
    # the other rollout loses its broadcast peer: an error, and it keeps serving step 1 byte for byte
    outcome, elapsed, message, served, same = results[1]
    assert outcome in ("TransferError", "TransferTimeoutError"), (outcome, message)
    assert elapsed < timeout + 5, elapsed
    assert (served, same) == (1, True)
