"""The collective engine resharding from 2 trainer ranks into a tensor-parallel rollout of 2 ranks, through verl's
lifecycle, with faults injected (tests/ckpt/reshard_fault_workers.py)."""

import pytest

from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import reshard_fault_workers as rw


def _run(faults, updates=2, agree=False):
    return run_multiprocess(rw.faulty, 4, 2, updates, faults, 8.0, agree, timeout=240)


@pytest.mark.multiprocess
def test_a_trainer_iterator_that_raises_aborts_the_rollouts_at_once():
    """send_weights' promise holds resharding: a trainer's weights that raise abort the rollouts at once (they
    waited out the 8 s timeout before) and the next update goes through."""
    results = _run({(1, 0): ("raise", None)})
    assert "RuntimeError" in results[0][0]["error"]
    for rank in (2, 3):
        first = results[rank][0]
        assert first["error"].startswith("TransferAbortedError"), first
        assert first["elapsed"] < 4, first
        assert results[rank][1]["error"] is None and results[rank][1]["served_step"] == 2


@pytest.mark.multiprocess
def test_an_early_aclose_drains_before_it_returns_and_the_senders_finish():
    """An early aclose() drains the rest before it returns, so the senders finish (the inner stream was left to
    the garbage collector, whose aclose() task asyncio.run() cancelled)."""
    results = _run({(1, 2): ("aclose", None)})
    for rank in (0, 1):
        assert results[rank][0]["error"] is None, results[rank][0]
    assert results[3][0]["error"] is None and results[3][0]["served_step"] == 1
    for rank in (2, 3):
        assert results[rank][1]["error"] is None and results[rank][1]["served_step"] == 2, results[rank][1]


@pytest.mark.multiprocess
def test_one_tp_rank_refusing_leaves_the_server_able_to_take_the_next_update():
    """Rank 3 refuses step 1 (it asks for 99); rank 2 receives all of step 1, slowly (10 x 1 s, each wait well
    within the engines' timeout, the whole update past the TP group's). Neither applies step 1 (agree): right.
    Then step 2 goes well on every rank and must be applied."""
    results = _run({(1, 3): ("ask", 99), (1, 2): ("slow", 1.0)}, agree=True, updates=2)
    assert "VersionMismatchError" in results[3][0]["error"]
    assert results[2][0]["served_step"] is None and results[3][0]["served_step"] is None
    for rank in (2, 3):
        second = results[rank][1]
        assert second["error"] is None and second["served_step"] == 2 and second["exact"] == 7, second
