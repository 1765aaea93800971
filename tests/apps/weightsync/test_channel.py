"""The call channel to a worker process (hal.apps.weightsync.channel): a call or a result that does not travel
fails that one call, and the worker goes on serving (before, a call whose pickle did not load in the worker ended
it); a worker whose end closes fails every call in flight, naming how it ended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import socket
import threading
from multiprocessing.connection import Connection

import pytest

import hal
from hal.apps.weightsync.channel import Caller, CallerGone, RemoteError, WorkerDied, answer, serve, settle
from tests.apps.weightsync.unloadable import LoadsNowhere


class Stub:
    """A worker's host: runs the function it is sent on itself."""

    async def invoke(self, method, *args, **kwargs):
        return await method(self, *args, **kwargs)

    async def double(self, x):
        return 2 * x

    async def lock(self):
        return threading.Lock()


def _call(method, *args) -> bytes:
    return pickle.dumps((method, args, {}))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_a_call_that_does_not_load_in_the_worker_is_that_calls_failure_and_the_next_call_runs(loop):
    host = Stub()
    assert answer(loop, host, 3, _call(Stub.double, LoadsNowhere()), "worker 1") == (
        "reply", 3, False, None, "the call does not load on worker 1: ModuleNotFoundError: No module named 'notebook_cell'")
    kind, seq, ok, value, error = answer(loop, host, 4, _call(Stub.double, 21), "worker 1")
    assert (kind, seq, ok, pickle.loads(value), error) == ("reply", 4, True, 42, None)


def test_a_result_that_does_not_pickle_and_a_raising_call_are_their_calls_failures(loop):
    assert answer(loop, Stub(), 5, _call(Stub.lock), "rank 1") == (
        "reply", 5, False, None, "the result of Stub.lock on rank 1 does not pickle: TypeError: cannot pickle "
                                 "'_thread.lock' object")
    assert answer(loop, Stub(), 6, _call(Stub.double), "rank 1") == (
        "reply", 6, False, None, "TypeError: Stub.double() missing 1 required positional argument: 'x'")


def test_a_result_that_does_not_load_in_the_driver_fails_its_call():
    futures = [concurrent.futures.Future() for _ in range(3)]
    settle(futures[0], True, pickle.dumps(LoadsNowhere()), None)
    settle(futures[1], True, pickle.dumps([7]), None)
    futures[2].cancel()
    settle(futures[2], True, pickle.dumps([7]), None)  # a call nobody waits for any more: filed quietly
    with pytest.raises(RemoteError, match=r"^the reply does not load on the driver: ModuleNotFoundError: "
                                          r"No module named 'notebook_cell'$"):
        futures[0].result()
    assert futures[1].result() == [7]


def test_a_failure_reported_without_a_reason_is_still_a_failure():
    future = concurrent.futures.Future()
    settle(future, False, None, None)
    with pytest.raises(RemoteError, match="did not say why"):
        future.result()


@pytest.fixture
def pair():
    """A worker serving :class:`Stub` on a thread over a socket pair (as the soak's), and the driver's Caller."""
    ours, theirs = socket.socketpair()
    worker_end, ended = Connection(theirs.detach()), []
    served = threading.Thread(target=lambda: ended.append(_serve(worker_end)), daemon=True)
    served.start()
    caller = Caller(Connection(ours.detach()), ended=lambda why: f"ended: {why or 'its end closed'}")
    yield caller, worker_end, served, ended
    caller.close()
    served.join(timeout=10)
    worker_end.close()


def _serve(conn):
    try:
        serve(conn, Stub(), "worker 1", timeout=10)
    except CallerGone as exc:
        return str(exc)
    return "stopped"


def test_calls_run_in_order_and_the_stop_is_answered(pair):
    caller, _, served, ended = pair
    first, second = caller.post(Stub.double, 1), caller.post(Stub.double, 2)
    assert (second.result(10), first.result(10)) == (4, 2)
    with pytest.raises(RemoteError, match=r"^the call does not load on worker 1: ModuleNotFoundError"):
        caller.post(Stub.double, LoadsNowhere()).result(10)
    with pytest.raises(TypeError, match="cannot pickle"):  # refused here: nothing sent
        caller.post(Stub.double, threading.Lock()).result(0)
    with pytest.raises(ValueError, match="got 'double'$"):
        caller.post("double", 1).result(0)
    assert caller.seq == 3
    assert caller.stop().result(10) is None
    served.join(timeout=10)
    assert ended == ["stopped"]


def test_a_worker_whose_end_closes_fails_every_call_in_flight_and_later(pair):
    caller, worker_end, served, ended = pair
    assert caller.post(Stub.double, 4).result(10) == 8
    caller.stop().result(10)
    served.join(timeout=10)
    worker_end.close()  # the worker's process is gone
    caller.reader.join(timeout=10)
    assert caller.dead == "ended: its end closed"
    with pytest.raises(WorkerDied, match=r"^the worker died \(ended: its end closed\)$"):
        caller.post(Stub.double, 1).result(0)


def test_a_worker_whose_caller_is_gone_says_so(pair):
    caller, _, served, ended = pair
    caller.close()
    served.join(timeout=10)
    assert ended == ["worker 1: the caller is gone (its end of the call channel closed)"]


def test_a_worker_that_gets_no_call_within_its_timeout_raises():
    ours, theirs = socket.socketpair()
    with pytest.raises(hal.DistributedTimeoutError, match=r"^worker 1: no call within 0.2 s$"):
        serve(Connection(theirs.detach()), Stub(), "worker 1", timeout=0.2)
    ours.close()
