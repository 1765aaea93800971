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


def _connections_to(port: int) -> int:
    """This process's TCP connections to ``port`` (its sockets' inodes found in /proc/net/tcp and tcp6): the
    store connections only, whatever else the test process (a pytest-xdist worker) opens meanwhile."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                count += 1
    return count


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

    def stop_and_continue() -> int:
        """The peer beats, pauses past heartbeat_timeout (dead), beats again (alive); returns the process's
        descriptors after it."""
        for _ in range(4):  # the peer beats (by hand: its heartbeat thread is off, so the test can pause it)
            store.add(beat, 1)
            time.sleep(control.HEARTBEAT_S)
        assert not _dead(host, 1)
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
        return _connections_to(store.port)

    try:
        host.watch([1])
        before = _connections_to(store.port)
        assert before >= 2  # the channels' own connections are counted (the heartbeat's, at least)
        # the connection that read the dead peer's counter is closed once no peer counts as dead (found by hal
        # soak: a descriptor more for good after a stop)
        assert stop_and_continue() <= before
        assert stop_and_continue() <= before
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
