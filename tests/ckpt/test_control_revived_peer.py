"""ckpt.control: a watched peer whose heartbeat stood still past ``heartbeat_timeout`` counts as dead, and counts as
alive again once its heartbeat moves (found by ``hal soak``: a rollout stopped for longer than the timeout between
two updates, then continued, was still taken for dead by the trainer's channel, and the next update failed at once
naming it, though it answered)."""

from __future__ import annotations

import os
import time

import pytest

from ckpt import control
from ckpt.control import ControlChannel, PeerFailure

HEARTBEAT_TIMEOUT = 2 * control.HEARTBEAT_S  # the shortest allowed: ten missed beats would make the test wait


def _label(rank: int) -> str:
    return "the host (rank 0)" if rank == 0 else f"peer rank {rank}"


def _wait_for(predicate, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _dead(channel: ControlChannel, peer: int) -> bool:
    try:
        channel.check_alive(peer)
    except PeerFailure:
        return True
    return False


def test_a_peer_whose_heartbeat_moves_again_counts_as_alive_again():
    store = control.host_store("127.0.0.1", None, 10)
    host = ControlChannel(store, rank=0, namespace="t/revived", timeout=10, label=_label,
                          heartbeat_timeout=HEARTBEAT_TIMEOUT)
    peer = ControlChannel(store, rank=1, namespace="t/revived", timeout=10, label=_label, heartbeat=False)
    beat = peer.key("hb", "1")
    try:
        host.watch([1])
        for _ in range(4):  # the peer beats (by hand: its heartbeat thread is off, so the test can pause it)
            store.add(beat, 1)
            time.sleep(control.HEARTBEAT_S)
        assert not _dead(host, 1)
        fds = len(os.listdir("/proc/self/fd"))
        # paused (stopped, starved) for longer than heartbeat_timeout: dead, and a wait on it says so
        assert _wait_for(lambda: _dead(host, 1), HEARTBEAT_TIMEOUT + 4 * control.HEARTBEAT_S)
        with pytest.raises(PeerFailure, match=r"peer rank 1 is dead or hangs: its heartbeat stood still for"):
            host.check_alive(1, "an acknowledgement")

        def beating_again() -> bool:
            store.add(beat, 1)
            return not _dead(host, 1)

        # continued: alive again within a few beats (before the fix it stayed dead for good)
        assert _wait_for(beating_again, 6 * control.HEARTBEAT_S)
        host.check_alive(1, "an acknowledgement")
        # the connection that read the dead peer's counter is closed once no peer counts as dead (found by hal soak:
        # a descriptor more for good after each stop)
        assert len(os.listdir("/proc/self/fd")) <= fds
    finally:
        host.close()
        peer.close()


def test_a_wait_right_after_the_peer_continued_does_not_fail_on_the_stale_verdict():
    store = control.host_store("127.0.0.1", None, 10)
    host = ControlChannel(store, rank=0, namespace="t/revived-now", timeout=10, label=_label,
                          heartbeat_timeout=HEARTBEAT_TIMEOUT)
    peer = ControlChannel(store, rank=1, namespace="t/revived-now", timeout=10, label=_label, heartbeat=False)
    try:
        host.watch([1])
        store.add(peer.key("hb", "1"), 1)
        assert _wait_for(lambda: _dead(host, 1), HEARTBEAT_TIMEOUT + 6 * control.HEARTBEAT_S)
        store.add(peer.key("hb", "1"), 1)  # one beat, and at once a wait on it (before the heartbeat thread looked)
        host.check_alive(1, "an acknowledgement")
        assert not _dead(host, 1)
    finally:
        host.close()
        peer.close()
