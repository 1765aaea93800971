"""hal.apps.multiprocess.run_multiprocess: ranks started from the forkserver see what a spawned rank would."""

import multiprocessing
import os
import signal
import sys
import time

import pytest

from hal.apps import multiprocess as harness


def _report(rank, world_size):
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
    return {"env": os.environ.get("OTHER_PROBE"), "cwd": os.getcwd(), "path": sys.path[0], "rank": os.environ["RANK"],
            "extra": os.environ.get("EXTRA")}


@pytest.fixture
def forkserver_env(monkeypatch):
    """The import environment (HAL_*, TORCH*, ...) the process's forkserver was started with, restored after.

    The forkserver starts once per process, under whatever environment the first multi-process test had
    (an earlier test in this xdist worker may have set HAL_DEVICE or HAL_SIM_* for its run); these tests
    are about a forkserver whose environment matches, so they put the environment back to its."""
    monkeypatch.delenv("HAL_TEST_START_METHOD", raising=False)
    harness._start_method()  # starts the forkserver under the current environment if none runs yet
    started = dict(harness._forkserver_env)
    for key in harness._import_env():
        if key not in started:
            monkeypatch.delenv(key)
    for key, value in started.items():
        monkeypatch.setenv(key, value)
    return started


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="ranks are spawned here")
def test_forkserver_ranks_get_the_callers_current_environment_directory_path_and_stderr(tmp_path, monkeypatch,
                                                                                       forkserver_env):
    harness.run_multiprocess(_report, 1, timeout=120)
    assert harness._start_method() == "forkserver"
    # what torch itself sets in this process while it runs (an in-process torchrun launch, inductor's cache)
    # says nothing about how torch was imported: the forkserver still serves
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert harness._start_method() == "forkserver"
    monkeypatch.setenv("OTHER_PROBE", "changed")  # not read by import torch: the forkserver still serves
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:  # this call's stderr is a new file, not the one the forkserver inherited
        saved = os.dup(2)
        os.dup2(stderr.fileno(), 2)
        try:
            results = harness.run_multiprocess(_report, 2, timeout=120, env={"EXTRA": "1"})
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert results == {rank: {"env": "changed", "cwd": str(tmp_path), "path": str(tmp_path), "rank": str(rank),
                              "extra": "1"} for rank in (0, 1)}
    err = log.read_text()
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err, err
    # a variable read while torch imports (HAL_*, TORCH*, OMP_*, ...) that changed: the group is spawned
    monkeypatch.setenv("HAL_TEST_PROBE", "changed")
    assert harness._start_method() == "spawn"
    monkeypatch.setenv("HAL_TEST_START_METHOD", "spawn")
    monkeypatch.delenv("HAL_TEST_PROBE")
    assert harness._start_method() == "spawn"


def _parent(rank, world_size):
    return os.getppid()


def _parent_spawned(rank, world_size):
    return os.getppid()


_parent_spawned.start_method = "spawn"  # as a rank measuring its own memory declares


@pytest.mark.slow
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="ranks are spawned here")
def test_a_rank_function_can_ask_to_be_spawned(forkserver_env):
    assert harness.run_multiprocess(_parent_spawned, 1, timeout=120) == {0: os.getpid()}  # this process's child
    assert harness.run_multiprocess(_parent, 1, timeout=120) != {0: os.getpid()}  # the forkserver's


def _rank_1_hangs(rank, world_size):
    if rank == 1:
        _waits_for_a_peer_that_never_comes()
    return rank


def _waits_for_a_peer_that_never_comes():
    import time

    time.sleep(600)


@pytest.mark.slow
def test_a_group_past_its_deadline_raises_with_every_running_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(harness.MultiprocessError) as info:
        harness.run_multiprocess(_rank_1_hangs, 2, timeout=10)  # time for both to start under load
    message = str(info.value)
    assert ("did not finish within 10 s (ranks done with a result: [0], still running: [1], alive after their "
            "result: [])") in message, message
    assert info.value.failures == {1: "still running at the deadline of 10 s"}  # which rank, for a caller to name
    stacks = message.split("their stacks:\n", 1)[1]
    assert stacks.startswith("--- rank 1 (pid ") and "--- rank 0" not in stacks, stacks
    # the innermost frames of the hung rank, by function name (faulthandler's format)
    assert "_waits_for_a_peer_that_never_comes" in stacks and "_rank_1_hangs" in stacks, stacks
    assert time.monotonic() - start < 40  # the deadline, the stacks' grace and the kill; never a hang


def _returns_a_megabyte(rank, world_size):
    return bytes([rank]) * (1 << 20)


def test_results_larger_than_a_pipe_buffer_come_back():
    # a rank's put() blocks once the pipe holds 64 KiB until the caller reads: it must read while they run
    out = harness.run_multiprocess(_returns_a_megabyte, 2, timeout=30)
    assert out == {0: b"\x00" * (1 << 20), 1: b"\x01" * (1 << 20)}


class _Frozen:
    """Pickling it stops the rank for good (SIGSTOP), in the middle of handing its result back."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGSTOP)
        return int, ()


class _Unreadable:
    """Pickles in the rank; unpickling it (in the caller) raises."""

    def __reduce__(self):
        return _refuse_to_load, ()


def _refuse_to_load():
    raise RuntimeError("this result does not load here")


def _odd_endings(rank, world_size, how):
    if rank == 1:
        if how == "exits":
            os._exit(0)  # no result, exit code 0
        if how == "stops while sending":  # as a rank frozen (SIGSTOP) halfway through handing its result back
            return _Frozen()
        if how == "unreadable":
            return _Unreadable()
        if how == "unpicklable":
            return lambda: None
    return rank


@pytest.mark.slow
@pytest.mark.parametrize("how, message", [
    ("exits", r"ranks \[1\] exited \(exit codes \[0\]\) without a result"),
    ("stops while sending", r"did not finish within 10 s \(ranks done with a result: \[0\], still running: \[1\]"),
    ("unreadable", r"rank 1 failed: rank 1's result could not be read in the calling process: "
                   r"RuntimeError: this result does not load here"),
    ("unpicklable", r"rank 1 failed: rank 1's result could not be sent: .*pickle"),
], ids=["exits", "stops-while-sending", "unreadable", "unpicklable"])
def test_a_rank_without_a_usable_result_is_named_and_nothing_blocks(how, message):
    # the deadline is the outcome only for the frozen rank; the others get room for two torch imports on a
    # loaded machine (10 s was not always enough under xdist)
    with pytest.raises(harness.MultiprocessError, match=message):
        harness.run_multiprocess(_odd_endings, 2, how, timeout=10 if how == "stops while sending" else 60)
    if how == "stops while sending":
        return  # the deadline, within its time: there is nothing to return
    out = harness.run_multiprocess(_odd_endings, 2, how, timeout=30, expect_failure=True)
    assert out[0] == 0
    if how == "exits":
        assert 1 not in out  # left out, as the callers that kill a rank on purpose expect
    else:
        assert "rank 1's result could not be" in out[1]


def _returns_then_peer_exits_non_zero(rank, world_size):
    if rank == 0:
        return "sent"
    time.sleep(1.0)  # rank 0 has written its result by now
    os._exit(3)


def test_a_non_zero_exit_is_named_and_what_the_other_ranks_raised_is_reported():
    with pytest.raises(harness.MultiprocessError) as info:
        harness.run_multiprocess(_returns_then_peer_exits_non_zero, 2, timeout=30)
    assert "exit code 3" in str(info.value) and info.value.failures == {1: "exited with code 3 without a result"}
    with pytest.raises(harness.MultiprocessError) as info:  # a rank that raises exits non-zero after its report
        harness.run_multiprocess(_rank_0_raises_rank_1_waits, 2, timeout=60)
    message = str(info.value)
    assert "exit code 1" in message and "rank 0 failed: ValueError: the real cause" in message, message


def _meets(rank, world_size):
    import hal

    store = hal.launcher_store(timeout=30)  # the caller's: no rank hosts one
    store.set(f"seen/{rank}", str(os.getpid()))
    return int(os.environ["MASTER_PORT"]), sorted(int(store.get(f"seen/{r}")) for r in range(world_size))


def test_ranks_meet_on_the_store_the_caller_hosts_on_a_port_the_kernel_picked():
    import hal

    out = harness.run_multiprocess(_meets, 3, timeout=120)
    (port,) = {p for p, _ in out.values()}
    assert [seen for _, seen in out.values()] == [out[0][1]] * 3 and len(set(out[0][1])) == 3  # three ranks met
    with pytest.raises(hal.DistributedTimeoutError, match=str(port)):  # served only while the group ran
        hal.connect_store("127.0.0.1", port, 1, 2, timeout=1, is_master=False)



def _rank_0_raises_rank_1_waits(rank, world_size):
    if rank == 0:
        raise ValueError("the real cause")
    _waits_for_a_peer_that_never_comes()


def test_a_rank_that_raises_stops_its_peers_at_once_and_is_named():
    start = time.monotonic()
    with pytest.raises(harness.MultiprocessError) as info:
        harness.run_multiprocess(_rank_0_raises_rank_1_waits, 2, timeout=120)
    assert time.monotonic() - start < 60  # not the deadline: the peer is stopped when rank 0 fails
    assert list(info.value.failures) == [0] and info.value.failures[0].startswith("ValueError: the real cause")


def _rank_1_is_killed(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_rank_killed_by_a_signal_is_named_in_the_failures():
    with pytest.raises(harness.MultiprocessError) as info:
        harness.run_multiprocess(_rank_1_is_killed, 2, timeout=60)
    assert info.value.failures == {1: "was killed by SIGKILL without a result"}


def test_a_function_the_ranks_cannot_import_is_refused_before_any_rank_starts():
    def local(rank, world_size):
        return rank

    for fn in (local, lambda rank, world_size: rank):
        with pytest.raises(ValueError, match="fn must be a module-level function"):
            harness.run_multiprocess(fn, 2, timeout=10)
