"""A failed rank of ``hal sync``/``hal launch`` is reported by role and cause, in one message, no traceback."""

from __future__ import annotations

import json
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hal.apps.errors import WorkerFailedError, describe_failure, worker_failed
from hal.errors import HalError


def _failure(tmp_path, rank: int, exitcode: int, message: str | None = None, timestamp: int = 0) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    if message is not None:  # the shape torch's ErrorHandler writes for an exception in the worker
        error_file.write_text(json.dumps({"message": {"message": message,
                                                      "extraInfo": {"timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_killed_trainer_is_named_with_the_out_of_memory_hint_and_peers_follow(tmp_path):
    killed = _failure(tmp_path, 0, -signal.SIGKILL)
    peer = _failure(tmp_path, 1, 1, "DistNetworkError: failed to recv, got 0 bytes", timestamp=int(time.time()) + 60)  # after the kill
    exc = ChildFailedError("hal sync", {0: killed, 1: peer})
    err = worker_failed(exc, lambda r: "trainer (rank 0)" if r == 0 else f"rollout {r} (rank {r})", "hal sync")
    assert isinstance(err, WorkerFailedError) and isinstance(err, HalError) and isinstance(err, RuntimeError)
    first, then = str(err).splitlines()
    assert first.startswith("hal sync: the trainer (rank 0) was killed by SIGKILL (")
    assert "out-of-memory" in first and "--model qwen2.5-tiny" in first
    assert then == "  then the rollout 1 (rank 1) exited with code 1: DistNetworkError: failed to recv, got 0 bytes"


def test_exception_text_is_kept_and_the_docs_pointer_dropped(tmp_path):
    raised = _failure(tmp_path, 2, 1, "Traceback (most recent call last):\n...\nValueError: bucket too small")
    assert describe_failure(raised) == "exited with code 1: ValueError: bucket too small"
    silent = _failure(tmp_path, 3, 4)  # no error file: torch fills in a pointer to its docs
    assert describe_failure(silent) == "exited with code 4"
    assert describe_failure(_failure(tmp_path, 4, -signal.SIGSEGV)) == "was killed by SIGSEGV"
