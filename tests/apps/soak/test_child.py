"""hal.apps.soak.child and the driver's end of its messages: a call or a result that does not travel fails that
one call, and the worker goes on serving (before, a call whose pickle did not load in the worker ended it)."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest

from hal.apps.soak.child import answer
from hal.apps.soak.procs import RemoteError, settle
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
    assert answer(loop, host, 3, _call(Stub.double, LoadsNowhere())) == (
        "reply", 3, False, None, "the call does not load in the worker: ModuleNotFoundError: No module named 'notebook_cell'")
    kind, seq, ok, value, error = answer(loop, host, 4, _call(Stub.double, 21))
    assert (kind, seq, ok, pickle.loads(value), error) == ("reply", 4, True, 42, None)


def test_a_result_that_does_not_pickle_and_a_raising_call_are_their_calls_failures(loop):
    assert answer(loop, Stub(), 5, _call(Stub.lock)) == (
        "reply", 5, False, None, "the result of Stub.lock does not pickle: cannot pickle '_thread.lock' object")
    assert answer(loop, Stub(), 6, _call(Stub.double)) == (
        "reply", 6, False, None, "TypeError: Stub.double() missing 1 required positional argument: 'x'")


def test_a_result_that_does_not_load_in_the_driver_fails_its_call(loop):
    futures = [loop.create_future() for _ in range(2)]
    settle(futures[0], True, pickle.dumps(LoadsNowhere()), None)
    settle(futures[1], True, pickle.dumps([7]), None)
    with pytest.raises(RemoteError, match=r"^its result does not load in the driver: ModuleNotFoundError: "
                                          r"No module named 'notebook_cell'$"):
        futures[0].result()
    assert futures[1].result() == [7]


def test_a_failure_reported_without_a_reason_is_still_a_failure(loop):
    future = loop.create_future()
    settle(future, False, None, None)
    with pytest.raises(RemoteError, match="did not say why"):
        future.result()
