"""hal.apps.soak.faults: the seeded plan (prefix-stable, so a failure replays with fewer updates) and which faults
an engine and a machine can produce (the others skipped with the reason)."""

from __future__ import annotations

import pytest

from hal.apps.soak.faults import CLEAN_START, KINDS, MOMENTS_OF, Fault, applicable, plan

WORKS = {"links": None, "mounts": None}


def test_a_plan_is_a_function_of_the_seed_and_prefix_stable():
    long = plan(7, 300, KINDS, 2, 0.3)
    assert long == plan(7, 300, KINDS, 2, 0.3)
    assert plan(8, 300, KINDS, 2, 0.3) != long
    for cut in (10, 57, 200):  # the first updates of a long run are those of a short one: --updates g replays g
        assert plan(7, cut, KINDS, 2, 0.3) == {g: f for g, f in long.items() if g <= cut}


def test_no_fault_at_the_start_nor_right_after_a_fault_and_each_is_well_formed():
    faults = plan(3, 400, KINDS, 3, 0.5)
    assert len(faults) > 60
    assert min(faults) > CLEAN_START
    assert all(g - 1 not in faults for g in faults)
    for g, fault in faults.items():
        assert fault.update == g and fault.kind in KINDS
        assert fault.moment in MOMENTS_OF[fault.kind][fault.role]
        assert (fault.target == 0) == (fault.role == "trainer") and 0 <= fault.target <= 3
        assert 0.2 <= fault.fraction <= 0.8
    assert {f.kind for f in faults.values()} == set(KINDS)
    assert {f.target for f in faults.values()} == {0, 1, 2, 3}


def test_rate_zero_plans_nothing_and_bad_arguments_are_refused():
    assert plan(1, 100, KINDS, 2, 0.0) == {}
    with pytest.raises(ValueError, match=r"rate must be a probability in \[0, 1\], got 1.5"):
        plan(1, 10, KINDS, 2, 1.5)
    with pytest.raises(ValueError, match="rollouts must be >= 1, got 0"):
        plan(1, 10, KINDS, 0, 0.5)
    with pytest.raises(ValueError, match="fault kind must be one of kill, stop, .* got 'melt'"):
        applicable(["melt"], "collective", WORKS)


def test_what_an_engine_cannot_produce_is_skipped_with_the_reason():
    runs, skipped = applicable(KINDS, "collective", WORKS, "delta")
    assert runs == ["kill", "stop", "flip", "cut_link", "slow_link"]
    assert skipped == {
        "full_disk": "the collective engine writes nothing to a disk (engines that do: file)",
        "full_shm": "the collective engine allocates nothing in /dev/shm (engines that do: ipc)"}
    runs, skipped = applicable(KINDS, "colocated", WORKS, "delta")
    assert runs == ["flip"]
    assert skipped["kill"].startswith("the colocated engine runs the trainer and the rollouts in one process")
    assert applicable(KINDS, "file", WORKS, "delta")[0] == ["kill", "stop", "flip", "full_disk"]
    assert applicable(KINDS, "ipc", WORKS, "delta")[0] == ["kill", "stop", "flip", "full_shm"]


def test_a_flip_runs_only_where_the_wire_format_carries_checksums():
    """A byte flipped in transit can be refused before it is served only where the update carries checksums
    (delta); on the full format (verl's, none) the soak skips it and says why, never counts it as passed."""
    runs, skipped = applicable(KINDS, "ipc", WORKS)  # full by default
    assert runs == ["kill", "stop", "full_shm"]
    assert skipped["flip"].startswith("the full wire format carries no checksum a rollout checks before serving")
    assert applicable(["flip"], "colocated", WORKS, "delta") == (["flip"], {})


def test_what_the_machine_cannot_produce_is_skipped_with_its_reason():
    machine = {"links": "emulated links need root", "mounts": "a private mount namespace needs root"}
    runs, skipped = applicable(KINDS, "file", machine, "delta")
    assert runs == ["kill", "stop", "flip"]
    assert skipped["full_disk"] == "no private filesystem to fill here: a private mount namespace needs root"
    assert applicable(["cut_link"], "nixl", machine)[1] == {"cut_link": "no emulated links here: emulated links need root"}


def test_a_fault_says_what_it_is():
    fault = Fault(update=7, kind="kill", target=2, moment="mid_bucket", fraction=0.4)
    assert fault.describe() == "kill rollout rank 2 mid_bucket (after 40% of the bytes) of update 7"
    assert Fault(3, "stop", 0, "during_finalize").describe() == "stop the trainer during_finalize of update 3"
