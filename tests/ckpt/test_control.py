"""ckpt.control: typed messages over the store, bounded waits, a dead peer named within seconds."""

import asyncio
import multiprocessing
import os
import pathlib
import signal
import threading
import time

import pytest

from ckpt import control
from ckpt.control import Ack, ControlChannel, PeerFailure
from ckpt.errors import CheckpointConfigError, TransferError
from ckpt.wire import Chunk, Segment, TensorEntry, WireMessage

NAMES = {0: "the host (rank 0)", 1: "peer rank 1"}


def _label(rank):
    return NAMES.get(rank, f"rank {rank}")


HEARTBEAT_TIMEOUT = 2.0  # seconds: the host's heartbeat_timeout, shorter than the default to wait less


def _host():
    store = control.host_store("127.0.0.1", None, 10)
    return store, ControlChannel(store, rank=0, namespace="t/0", timeout=10, label=_label,
                                 heartbeat_timeout=HEARTBEAT_TIMEOUT)


def _peer_body(port, ready):
    """A peer (rank 1): connects, says it is up, then idles until it is killed or stopped."""
    store = control.connect_store("127.0.0.1", port, 10, "the host")
    channel = ControlChannel(store, rank=1, namespace="t/0", timeout=10, label=_label)
    channel.send("up", Ack(1))
    ready.wait(60)
    time.sleep(60)


def _host_body(port_out, ready):
    """The host (rank 0) in its own process: hosts the store and idles until it is killed."""
    store, channel = _host()
    port_out.put(store.port)
    ready.wait(60)
    time.sleep(60)


def _spawn(target, *args):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _stop(pid):
    """SIGSTOP ``pid`` and return once every thread of it is stopped: ``kill`` returns before a thread running
    on another core has stopped, and a loaded CI machine once saw the store host answer a call sent after it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = pathlib.Path(f"/proc/{pid}/task")
    def state(task):  # a thread that ended in the meantime does not hold the stop up
        try:
            return (task / "stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return "T"

    while any(state(t) != "T" for t in tasks.iterdir()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within 10 s of SIGSTOP")
        time.sleep(0.01)


def _reap(proc):
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def test_typed_messages_round_trip_in_order_and_a_wrong_type_is_named():
    store, host = _host()
    peer = ControlChannel(control.connect_store("127.0.0.1", store.port, 10, "the host"), rank=1, namespace="t/0",
                          timeout=10, label=_label)
    sent = [WireMessage(3, 4096, entries=[TensorEntry("w", "bfloat16", [2, 3], 0, 12)], segments=[Segment(0, 12)],
                        slot=1),
            WireMessage(3, 4096, chunk=Chunk("big", "float32", [4096], 16384, 4096, 4096, [8192], 4096)),
            WireMessage(3, 4096, end=True),
            WireMessage(None, 4096, abort="ValueError: boom", fatal=True)]
    try:
        for message in sent:
            host.send("msg/1", message)
        host.send("msg/1", Ack(7))

        async def receive():
            got = [await peer.recv("msg/1", WireMessage, 0, "metadata") for _ in sent]
            with pytest.raises(TransferError, match="expected a WireMessage message, got 'Ack'"):
                await peer.recv("msg/1", WireMessage, 0, "metadata")
            return got
        assert asyncio.run(receive()) == sent
        host.post("closed", Ack(2))
        assert peer.peek("closed", Ack) == Ack(2) and peer.peek("other", Ack) is None
    finally:
        peer.close()
        host.close()


def test_a_post_is_seen_by_another_client_as_soon_as_it_returns():
    # TCPStore's set returns before the server applied it; without the check that follows it, another
    # client's peek missed the key about 11 times in 2000 (and the round-trip test above failed under CI's load)
    store, host = _host()
    peer = ControlChannel(control.connect_store("127.0.0.1", store.port, 10, "the host"), rank=1, namespace="t/0",
                          timeout=10, label=_label, heartbeat=False)
    try:
        missed = []
        for i in range(2000):
            host.post(f"seen/{i}", Ack(i))
            host.post_bytes(f"raw/{i}", str(i).encode())
            if peer.peek(f"seen/{i}", Ack) != Ack(i) or not peer.store.check([peer.key(f"raw/{i}")]):
                missed.append(i)
        assert missed == []
    finally:
        peer.close()
        host.close()


def test_a_wait_times_out_naming_the_peer_the_key_and_the_seconds():
    store, host = _host()
    try:
        start = time.monotonic()
        with pytest.raises(PeerFailure) as info:
            asyncio.run(host.recv("ack/1/1", Ack, 1, "the acknowledgement of message 0", timeout=0.6))
        elapsed = time.monotonic() - start
        host.post_bytes("done/2", b"3")
        with pytest.raises(PeerFailure) as keys:  # key waits name the ranks that did not set theirs
            host.wait_posted({1: "done/1", 2: "done/2", 3: "done/3"}, "the end of step 3", 0.6)
    finally:
        host.close()
    assert keys.value.timed_out and keys.value.peer == "peer rank 1, rank 3", keys.value
    assert "did not answer the end of step 3 within 0.6 s" in str(keys.value), keys.value
    assert info.value.timed_out and info.value.peer == "peer rank 1"
    text = str(info.value)
    assert "peer rank 1" in text and "'t/0/ack/1/1'" in text and "0.6 s" in text and "acknowledgement" in text, text
    assert 0.5 < elapsed < 3, elapsed


def test_a_store_call_stuck_past_its_deadline_fails_the_wait_within_the_bound(monkeypatch):
    """``hal soak`` found a receive over a cut link outliving every bound: the ``TCPStore`` client, its wait
    timed out, waits for the server to acknowledge the cancel, with no bound. Here the blocking half never
    returns in time; the wait fails within its timeout and :data:`~ckpt.control.STORE_OVERRUN_S`, naming the
    peer, and the next wait uses a fresh connection."""
    store, host = _host()
    release = threading.Event()
    stuck = host._waiter
    monkeypatch.setattr(host, "pop", lambda *args: release.wait(60) and b"")

    async def attempt():
        start = time.monotonic()
        try:
            await host.recv("ack/1/1", Ack, 1, "the acknowledgement of message 0", timeout=0.5)
        except PeerFailure as exc:
            return exc, time.monotonic() - start
        finally:
            release.set()  # the stuck thread ends, so the loop can close
        return None, time.monotonic() - start

    try:
        failure, elapsed = asyncio.run(attempt())
    finally:
        host.close()
    assert failure is not None, "the wait returned"
    assert failure.timed_out and failure.peer == "peer rank 1"
    assert "sent no the acknowledgement of message 0 within 0.5 s" in str(failure), failure
    assert 0.5 < elapsed < 0.5 + control.STORE_OVERRUN_S + 1.5, elapsed
    assert stuck is not None and host._waiter is None


# each way to stop (a dead process, a hung one) and each kind of wait (a queue, a key) once: the two are
# independent (the heartbeat thread sees a still counter whatever stopped it; a dead peer wakes either wait)
@pytest.mark.parametrize("how, wait", [(signal.SIGKILL, "queue"), (signal.SIGSTOP, "key")],
                         ids=["killed-queue", "stopped-key"])
def test_a_peer_that_stops_heartbeating_is_named_within_the_deadline(how, wait):
    store, host = _host()
    ready = multiprocessing.get_context("spawn").Event()
    proc = _spawn(_peer_body, store.port, ready)
    try:
        assert asyncio.run(host.recv("up", Ack, None, "the peer's start", timeout=60)) == Ack(1)
        host.watch([1])
        time.sleep(2 * control.HEARTBEAT_S)  # the host has seen its counter move

        async def wait_for_it():
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, os.kill, proc.pid, how)
            killed = time.monotonic() + 0.3
            with pytest.raises(PeerFailure) as info:
                if wait == "queue":  # a receive from the peer's queue
                    await host.recv("msg/1", Ack, 1, "a message of peer 1", timeout=30)
                else:  # a wait for a key the peer is to set (as kimi's gather waits)
                    await asyncio.to_thread(host.wait_posted, {1: "done/1"}, "a message of peer 1", 30)
            return info.value, time.monotonic() - killed
        failure, elapsed = asyncio.run(wait_for_it())
    finally:
        _reap(proc)
        host.close()
    assert not failure.timed_out and failure.peer == "peer rank 1"
    assert "peer rank 1 is dead or hangs" in str(failure) and "a message of peer 1" in str(failure), failure
    assert "heartbeat_timeout=2 s" in str(failure), failure  # the channel's own figure, not the default
    assert elapsed < HEARTBEAT_TIMEOUT + 2 * control.HEARTBEAT_S + 1.0, elapsed
    with pytest.raises(PeerFailure, match="peer rank 1 is dead"):
        host.check_alive(1)


def test_the_store_host_dying_fails_a_wait_at_once_naming_the_host():
    ctx = multiprocessing.get_context("spawn")
    port_out, ready = ctx.Queue(), ctx.Event()
    proc = _spawn(_host_body, port_out, ready)
    try:
        port = port_out.get(timeout=60)
        peer = ControlChannel(control.connect_store("127.0.0.1", port, 10, "the host"), rank=1, namespace="t/0",
                              timeout=30, label=_label)

        async def wait_for_it():
            asyncio.get_running_loop().call_later(0.3, os.kill, proc.pid, signal.SIGKILL)
            killed = time.monotonic() + 0.3
            with pytest.raises(PeerFailure) as info:
                await peer.recv("msg/1", Ack, 0, "the metadata of message 0")
            return info.value, time.monotonic() - killed
        failure, elapsed = asyncio.run(wait_for_it())
        peer.close()
    finally:
        _reap(proc)
    assert not failure.timed_out and "the host (rank 0), which hosts the control store, is gone" in str(failure)
    assert elapsed < 2, elapsed


def test_a_plain_call_to_a_store_host_that_does_not_answer_fails_within_the_bound():
    """``hal soak`` found a rollout's event loop stalled for a whole link outage: ``TCPStore``'s timeout bounds
    its waits, not its plain calls that read an answer (an ``add``, a ``queue_pop`` that does not wait), which
    block until TCP delivers them, or for as long as the host is stopped. Here the host is stopped: each
    call fails within :data:`~ckpt.control.STORE_OVERRUN_S`, naming the host, and the calls after the first fail
    at once."""
    ctx = multiprocessing.get_context("spawn")
    port_out, ready = ctx.Queue(), ctx.Event()
    proc = _spawn(_host_body, port_out, ready)
    outcomes = []
    try:
        port = port_out.get(timeout=60)
        peer = ControlChannel(control.connect_store("127.0.0.1", port, 10, "the host"), rank=1, namespace="t/0", bounded=True,
                              timeout=30, label=_label)
        peer.send("msg/0", Ack(0))  # answered while the host runs
        _stop(proc.pid)
        calls = [lambda: peer.add("given-up/1/1", 0),
                 lambda: asyncio.run(peer.recv("msg/1/1", Ack, None, "the metadata of message 0", timeout=30)),
                 lambda: peer.send("ack/1/1", Ack(1))]

        def make_calls():  # in a thread of its own: a call that blocks for good fails the test, not hangs it
            for call in calls:
                start = time.monotonic()
                try:
                    call()
                    outcomes.append(("returned", time.monotonic() - start))
                except PeerFailure as exc:
                    outcomes.append((exc, time.monotonic() - start))
        caller = threading.Thread(target=make_calls, daemon=True)
        caller.start()
        caller.join(3 * control.STORE_OVERRUN_S + 5)
        peer.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _reap(proc)
    assert len(outcomes) == len(calls), f"a call blocked: {outcomes}"
    (first, first_s), *rest = outcomes
    assert isinstance(first, PeerFailure) and first.timed_out and first.peer == "the host (rank 0)", first
    assert "did not answer" in str(first) and "is its link down" in str(first), first
    assert first_s < control.STORE_OVERRUN_S + 1.0, first_s
    for failure, seconds in rest:  # the client counts as lost: no second wait for the bound
        assert isinstance(failure, PeerFailure) and failure.timed_out and "did not answer" in str(failure), failure
        assert seconds < 0.5, seconds


@pytest.mark.parametrize("bad", [0.5, 0, -1, True, "5", None])
def test_a_heartbeat_timeout_below_two_beats_or_not_a_number_is_refused_naming_it(bad):
    store = control.host_store("127.0.0.1", None, 10)
    with pytest.raises(CheckpointConfigError, match=rf"heartbeat_timeout must be a number of seconds >= 1 .*got {bad!r}"):
        ControlChannel(store, rank=0, namespace="t/0", timeout=10, label=_label, heartbeat_timeout=bad)
