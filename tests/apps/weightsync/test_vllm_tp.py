"""The vLLM tensor-parallel rollout's pieces that need no vLLM: its shared-memory names and its memory bound."""

import pathlib
import uuid

from hal.apps.weightsync import vllm_tp


def test_a_jobs_leftover_vllm_segments_are_removed_and_no_others(monkeypatch):
    run = f"hal-sync-test{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(vllm_tp.RUN_ID_ENV, run)
    shm = pathlib.Path(vllm_tp.SHM_DIR)
    ours = shm / f"{vllm_tp.shm_ident(0)}-tp:0-[0-1]-cpushm_1"
    other = shm / f"{run}x-vllm-tp0-tp:0-[0-1]-cpushm_0"  # another run whose id starts alike
    try:
        ours.write_bytes(b"x")
        other.write_bytes(b"x")
        assert vllm_tp.remove_shm_segments(run) == [ours.name]
        assert not ours.exists() and other.exists()
    finally:
        ours.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_a_vllm_ranks_bound_is_its_start_its_staging_one_repack_buckets_and_slack():
    bound = vllm_tp.staged_memory_bound(5 << 30, 2 << 30, 1 << 30, 1 << 28, 1 << 28, senders=2)
    judged = bound["judged_by"]
    assert bound["mode"] == "staged" and judged["within"] is False
    assert judged["bound_bytes"] == (2 << 30) + (1 << 30) + (1 << 28) + 4 * (1 << 28) + vllm_tp.SLACK_BYTES
