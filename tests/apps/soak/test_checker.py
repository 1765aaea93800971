"""hal.apps.soak.checker on histories written by hand: each rule catches what it is for, names the update, and a
failure comes with the shortest command that replays it."""

from __future__ import annotations

import pytest

from hal.apps.soak.checker import History, UpdateRecord, judge, names, replay_command
from hal.apps.soak.faults import CLEAN_START, Fault
from hal.apps.soak.options import SoakOptions

from tests.apps.soak.histories import OPTIONS, SUMS, T0, clean, history, run_of


def test_a_clean_history_holds():
    report = judge(history(run_of()), CLEAN_START)
    assert report["ok"] is True and report["failures"] == [] and report["replay"] is None
    assert (report["updates"], report["updates_ok"], report["wrong_bytes_served"], report["hangs"]) == (30, 30, 0, 0)


def test_wrong_bytes_served_are_caught_even_when_the_job_reported_them():
    bad = clean(12)
    bad.observed[2]["sums"]["b"] = "deadbeef"
    bad.ok = False
    bad.errors = [(T0, "step 12, rollout rank 2: tensor 'b': checksum deadbeef differs from the trainer's 000003f4")]
    report = judge(history(run_of(u12=bad)), CLEAN_START)
    assert report["wrong_bytes_served"] == 1 and report["ok"] is False
    assert report["wrong_servings"] == [{"update": 12, "rollout": 2, "served_step": 12,
                                         "what": "tensor 'b': checksum deadbeef differs from the trainer's 000003f4"}]
    assert report["failures"][0].startswith("update 12: rollout rank 2 serves step 12 with bytes that differ")
    assert report["failures"][0].endswith("(reported by the job's verification)")
    assert report["replay"] == "hal soak --device cpu --engine collective --seed 4 --updates 12"


def test_a_step_never_staged_is_a_wrong_serving():
    bad = clean(5)
    bad.observed[2]["served_step"] = 99
    report = judge(history(run_of(u5=bad)), CLEAN_START)
    assert report["wrong_servings"][0] == {"update": 5, "rollout": 2, "served_step": 99,
                                           "what": "the trainer never staged that step"}


def test_misreported_and_unreported_steps():
    lied = clean(7, served={1: 6, 2: 7})  # rollout 1 said it serves 7 without error, but serves 6
    lied.observed[1]["reported"] = {"update": 7, "served_step": 7, "error": None, "raised": False}
    hidden = clean(9)  # rollout 2 serves 9 but its update raised
    hidden.observed[2]["reported"] = {"update": 9, "served_step": None, "error": "TransferError: x", "raised": True}
    report = judge(history(run_of(u7=lied, u9=hidden)), CLEAN_START)
    assert (report["misreported_steps"], report["unreported_steps"]) == (1, 1)
    assert "update 7: rollout rank 1 reported step 7 without error, but serves step 6 (expected 7)" in report["failures"]
    assert "update 9: rollout rank 2 serves step 9 but reported its update failed (TransferError: x)" in report["failures"]


def faulted(g: int, fault: Fault, error_after: float | None, ok: bool = False, **fields) -> UpdateRecord:
    record = clean(g, served={1: g - 1, 2: g - 1}, **fields)
    for seen in record.observed.values():
        seen["reported"] = {"update": g, "served_step": g - 1, "error": "TransferError: y", "raised": False}
    record.fault, record.ok = fault, ok
    struck_at = record.started_at + 0.5
    record.struck = [(fault, struck_at)]
    if error_after is not None:
        record.errors = [(struck_at + error_after, f"update to global_steps {g} failed: rollout rank 1: TransferError")]
    return record


def test_a_fault_must_end_in_a_named_error_within_its_bound_and_the_next_update_must_succeed():
    kill = Fault(10, "kill", 1, "mid_bucket")
    ok = judge(history(run_of(u10=faulted(10, kill, 0.2, restarted=[1]))), CLEAN_START)
    assert ok["ok"] is True and ok["faults"] == {"kill": 1} and ok["outcomes"] == {"error": 1, "absorbed": 0}
    assert ok["longest_detection_s"] == 0.2 and ok["longest_recovery_s"] == pytest.approx(10.5)
    late = judge(history(run_of(u10=faulted(10, kill, OPTIONS.detection_bound_s + 1, restarted=[1]))), CLEAN_START)
    assert late["hangs"] == 1 and "beyond the bound of 15 s" in late["failures"][0]
    silent = faulted(10, Fault(10, "flip", 1, "mid_bucket"), None, ok=True)
    assert "the update succeeded as if nothing happened" in judge(history(run_of(u10=silent)), CLEAN_START)["failures"][0]
    next_failed = clean(11)
    next_failed.ok, next_failed.errors = False, [(T0, "update to global_steps 11 failed: trainer: TransferError")]
    report = judge(history(run_of(u10=faulted(10, kill, 0.2, restarted=[1]), u11=next_failed)), CLEAN_START)
    assert report["unrecovered"] == 1
    assert report["failures"][0].startswith("update 11: the update after kill rollout rank 1 mid_bucket")
    assert report["replay"].endswith("--updates 11")


def test_a_stop_that_left_the_update_verified_is_absorbed_but_a_death_it_was_not_is_a_failure():
    stop = Fault(10, "stop", 0, "during_finalize")
    absorbed = faulted(10, stop, None, ok=True)
    for seen in absorbed.observed.values():
        seen.update(served_step=10, sums=dict(SUMS[10]),
                    reported={"update": 10, "served_step": 10, "error": None, "raised": False})
    report = judge(history(run_of(u10=absorbed)), CLEAN_START)
    assert report["ok"] is True and report["outcomes"] == {"error": 0, "absorbed": 1}
    shm = faulted(10, Fault(10, "full_shm", 0, "before_send"), 2.0, restarted=[0])
    report = judge(history(run_of(u10=shm)), CLEAN_START)
    assert report["unexpected_deaths"] == 1
    assert report["failures"][0].startswith("update 10: full_shm the trainer before_send of update 10 killed worker(s) [0]")


def test_hangs_and_a_stopped_run_are_failures():
    hung = clean(8, hangs=["observe the rollouts failed: rollout rank 2: no answer within 15 s (after the update ended)"])
    report = judge(history(run_of(u8=hung)), CLEAN_START)
    assert report["hangs"] == 1 and report["failures"] == [
        "update 8: a hang: observe the rollouts failed: rollout rank 2: no answer within 15 s (after the update ended)"]
    stopped = run_of(n=8)
    stopped[8].stopped, stopped[8].hangs = True, ["the step outlived the driver's watchdog (80 s)"]
    report = judge(history(stopped), CLEAN_START)
    assert report["updates"] == 8 and "update 8: the soak stopped here: a worker did not answer at all" in report["failures"]


def sample(pid: int, fds: int, rss: int) -> dict:
    return {"pid": pid, "fds": fds, "rss_bytes": rss}


def test_descriptors_and_resident_memory_must_stay_flat():
    bucket = OPTIONS.bucket_bytes
    records = [clean(g, resources=[sample(1, 20, 100 << 20), sample(2, 30 + (g > 20), (200 << 20) + g * bucket // 10),
                                   {**sample(3, 9, 50 << 20), "driver": True}]) for g in range(0, 31)]
    records[25].resources[0]["fds"] = 27  # one sample right after a recovery: the medians ignore it
    report = judge(history(records), CLEAN_START)
    leaks = report["leaks"]
    assert leaks["processes_judged"] == 3 and leaks["fd_growth_max"] == 1
    assert leaks["rss_growth_max_bytes"] == (28 - 7) * bucket // 10 > bucket  # median of the last 5 - of updates 5..9
    assert [f for f in report["failures"] if "pid 1" in f] == []
    assert "pid 2 held +1 file descriptors (the fewest of updates ..30 against the fewest of 5..)" in \
        report["failures"][0]
    assert "pid 2's resident memory grew by" in report["failures"][1]


def test_sockets_a_cut_link_leaves_open_for_a_while_are_not_a_leak_descriptors_never_given_back_are():
    """A rollout's descriptors in ``hal soak --engine mooncake --device npu-sim --seed 2`` (updates 195..300):
    a cut link at 259 and 283 left three sockets of the trainer's connections open until their FIN came through
    (24, 27, 26, 24, then 27 to the end). A leak gives nothing back."""
    seen = {195: 24, 205: 24, 215: 24, 225: 24, 230: 24, 235: 24, 240: 24, 245: 24, 250: 24, 255: 24, 260: 27,
            265: 26, 270: 26, 275: 26, 280: 24, 285: 27, 295: 27, 300: 27}
    def run(fds_of):
        records = [clean(0), *(clean(g % 10, resources=[sample(1, fds_of(g), 100 << 20)]) for g in seen)]
        for record, g in zip(records[1:], seen):  # updates 195..300, each served and published as itself
            record.update = g
            for observed in record.observed.values():
                observed.update(served_step=g, sums={"a": f"{g:08x}"}, reported={**observed["reported"],
                                                                                  "update": g, "served_step": g})
        published = {0: dict(SUMS[0])} | {g: {"a": f"{g:08x}"} for g in seen}
        return judge(History(options=OPTIONS, published=published, records=records), CLEAN_START)

    report = run(seen.get)
    assert report["leaks"]["fd_growth_max"] == 0 and report["failures"] == []
    report = run(lambda g: 24 + 3 * (g in (240, 245, 255)) + 3 * (g >= 275))  # a cut's 3 in the first window
    assert report["leaks"]["fd_growth_max"] == 3  # and 3 never given back: the fewest of each window compared
    report = run(lambda g: 24 + (g >= 260) + (g >= 270))  # one kept after each of two cuts
    assert report["leaks"]["fd_growth_max"] == 2
    assert report["failures"] == ["update 300: pid 1 held +2 file descriptors (the fewest of updates ..300 against "
                                  "the fewest of 235..)"]


def test_library_pages_touched_once_are_not_judged_held_memory_is():
    """``hal soak`` found every process's ``VmRSS`` 3 to 6 MB up after its first failure by a gloo timeout, with
    ``RssAnon`` flat: the first C++ exception's unwinder reads libtorch's unwind tables (file-backed pages).
    The rule judges resident memory less file-backed pages and reports the whole."""
    bucket = OPTIONS.bucket_bytes

    def with_held(pid, rss, held):
        return {**sample(pid, 20, rss), "held_bytes": held}
    records = [clean(g, resources=[with_held(1, (100 << 20) + (6 << 20) * (g > 20), 60 << 20),
                                   with_held(2, 200 << 20, (150 << 20) + g * bucket // 10)]) for g in range(0, 31)]
    report = judge(history(records), CLEAN_START)
    leaks = report["leaks"]
    assert leaks["processes_judged"] == 2 and leaks["rss_growth_max_bytes"] == 6 << 20
    assert leaks["held_growth_max_bytes"] == (28 - 7) * bucket // 10 > bucket
    assert report["failures"] == ["update 30: pid 2's resident memory less file-backed pages grew by "
                                  f"{(28 - 7) * bucket // 10} bytes (medians) from updates 5.. to ..30, not under one "
                                  f"bucket ({bucket} bytes)"]


def test_segments_and_temporary_entries_left_are_leaks():
    records = run_of()
    for record in records[1:]:
        record.shm, record.temp = [], []
    records[-1].shm = ["hal-ipc-0123"]
    h = history(records)
    h.after_close = {"shm": [], "temp": ["tmpxyz"]}
    report = judge(h, CLEAN_START)
    assert report["leaks"]["shm_segments"] == {"first": 0, "last": 1, "after_close": 0}
    assert "update 30: shm segments grew from 0 to 1: ['hal-ipc-0123']" in report["failures"]
    assert "update 30: temp entries left after the engines closed: ['tmpxyz']" in report["failures"]


def test_errors_name_the_target_or_the_update():
    assert names("update to global_steps 7 failed: trainer: x", 1, 7)
    assert names("rollout rank 2 on node 10.0.0.2: the worker died", 2, 9)
    assert names("step 9, rollout rank 1: TransferError", 2, 9)
    assert not names("rollout rank 2 on node 10.0.0.2: the worker died", 1, 9)
    assert not names("global_steps 17 failed", 1, 7)


def test_the_replay_command_names_only_what_differs_from_the_defaults():
    options = SoakOptions(engine="file", device="npu-sim", seed=2, updates=300, wire_format="delta",
                          faults=("kill", "stop"), timeout=8.0, bucket_bytes=1 << 19)
    assert replay_command(options, 17) == ("hal soak --device npu-sim --engine file --seed 2 --updates 17 "
                                           "--wire-format delta --faults kill stop --timeout 8 --bucket-mb 0.5")


def test_what_the_first_failure_allocates_once_is_warm_up_what_each_failure_adds_is_a_leak():
    bucket = OPTIONS.bucket_bytes
    records = [clean(g) for g in range(0, 41)]
    for g in (8, 20, 32):  # three failed updates; a process grows 3 buckets at the first only, another at each
        records[g] = faulted(g, Fault(g, "kill", 1, "mid_bucket"), 0.1, restarted=[1])
    for record in records:
        if record.fault is None:
            g = record.update
            record.resources = [sample(1, 20, (100 << 20) + (3 * bucket if g > 8 else 0)),
                                sample(2, 20, (100 << 20) + 2 * bucket * sum(g > f for f in (8, 20, 32)))]
    report = judge(history(records), CLEAN_START)
    assert report["leaks"]["processes_judged"] == 2
    assert [f for f in report["failures"] if "resident" in f] == [
        f"update 40: pid 2's resident memory grew by {4 * bucket} bytes (medians) from updates 9.. to ..40, not "
        f"under one bucket ({bucket} bytes)"]


def test_the_history_may_keep_a_digest_where_the_served_bytes_matched():
    from hal.apps.soak.checker import digest

    kept, differs = clean(6), clean(7)
    for record in (kept, differs):
        for seen in record.observed.values():
            seen["digest"], seen["sums"] = digest(seen["sums"]), None
    differs.observed[1]["digest"] = "0badf00d"
    assert digest({"b": "2", "a": "1"}) == digest({"a": "1", "b": "2"}) != digest({"a": "1", "b": "3"})
    report = judge(history(run_of(u6=kept, u7=differs)), CLEAN_START)
    assert report["wrong_servings"] == [{"update": 7, "rollout": 1, "served_step": 7, "what":
                                         f"the served tensors' digest 0badf00d differs from the trainer's "
                                         f"{digest(SUMS[7])}"}]
