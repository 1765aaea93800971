"""The torchrun launcher's message carrying, in this process: rank 0's group and a serving rank's loop on a
thread, over real loopback connections whose port goes through a real TCPStore (typed calls and replies, a raising
call named, stop acknowledged, a bounded wait)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import hal
from ckpt.manager import CheckpointEngineManager, ManagedWorker, UpdateError
from hal.apps.weightsync import channel
from hal.apps.weightsync.launchers import torchrun
from hal.apps.weightsync.launchers.torchrun import TorchrunGroup, accept_calls, connect_calls, serve
from hal.apps.weightsync.messages import Sent
from hal.apps.weightsync.worker import RolloutRole
from tests.apps.weightsync.unloadable import LoadsNowhere


class Echo(ManagedWorker):
    """A serving rank's worker: answers its update with a typed message, or a result that does not travel."""

    async def update_weights(self, global_steps):
        return Sent(t0=float(global_steps), send_s=0.5)

    async def slow_update(self, global_steps):
        await asyncio.sleep(0.5)
        return await self.update_weights(global_steps)

    async def loads_nowhere(self):
        return LoadsNowhere()

    async def lock(self):
        return threading.Lock()


class Local:
    async def invoke(self, method, *args, **kwargs):
        return Sent(t0=-1.0, send_s=0.0)


@pytest.fixture
def store():
    """Rank 0's store (it hosts the server); a serving rank joins with :func:`client` (one client per thread, as
    one per process in a run: a TCPStore client is not shared between threads)."""
    return hal.connect_store("127.0.0.1", 0, 0, 2, timeout=20)


def client(store):
    return hal.connect_store("127.0.0.1", store.port, 1, 2, timeout=20)


def serving_rank(store, timeout, serves=True):
    """Rank 1 on a thread: its end of the call channel (kept in ``ends``), served unless ``serves`` is false;
    what ended the serving goes to ``failed``."""
    ends, failed = [], []

    def rank_1():
        ends.append(accept_calls(client(store), 1, timeout))
        try:
            if serves:
                serve(Echo(), ends[0], 1, timeout)
        except hal.HalError as exc:
            failed.append(str(exc))

    thread = threading.Thread(target=rank_1, daemon=True)
    thread.start()
    return thread, ends, failed


@pytest.fixture
def group(store):
    served, ends, _ = serving_rank(store, 20.0)
    group = TorchrunGroup(Local(), connect_calls(store, 2, 20.0), world_size=2, timeout=20.0)
    yield group
    served.join(timeout=30)
    assert not served.is_alive()  # the test's stop reached it
    group.close()
    ends[0].close()


def test_calls_carry_typed_messages_and_a_raising_call_is_named(group):
    manager = CheckpointEngineManager(object, group, timeout=20.0)

    async def scenario():
        results = await manager.call([0, 1], ManagedWorker.update_weights, [(7,), (7,)])
        with pytest.raises(UpdateError, match=r"^RolloutRole\.check failed: rollout rank 1 \(rank 1\): AttributeError: "
                                              r"RolloutRole\.check: none of \['Echo'\] is a RolloutRole$"):
            await manager.call([1], RolloutRole.check)
        return results

    assert asyncio.run(scenario()) == [Sent(t0=-1.0, send_s=0.0), Sent(t0=7.0, send_s=0.5)]
    group.stop(wait=True)


def test_a_reply_that_does_not_come_is_an_error_within_the_timeout(monkeypatch, store):
    monkeypatch.setattr(torchrun, "REPLY_MARGIN_S", 0.2)
    thread, ends, _ = serving_rank(store, 20.0, serves=False)  # rank 1's end is there, but nobody serves it
    silent = TorchrunGroup(Local(), connect_calls(store, 2, 20.0), world_size=2, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"^ManagedWorker\.update_weights on rank 1: no reply within 0.5 s$"):
        asyncio.run(silent.submit(1, ManagedWorker.update_weights, 1))
    with pytest.raises(TimeoutError, match=r"^the serving ranks did not stop within 0.3 s$"):
        silent.stop(wait=True)
    thread.join(timeout=10)
    silent.close()
    ends[0].close()


def test_a_rank_that_dies_fails_its_calls_at_once(store):
    thread, ends, _ = serving_rank(store, 20.0, serves=False)
    group = TorchrunGroup(Local(), connect_calls(store, 2, 20.0), world_size=2, timeout=20.0)
    thread.join(timeout=10)

    async def scenario():
        pending = group.submit(1, ManagedWorker.update_weights, 1)
        ends[0].close()  # rank 1's process is gone
        await pending

    started = time.monotonic()
    with pytest.raises(channel.WorkerDied, match=r"^the worker died \(its end of the call channel closed\)$"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 5  # not at the reply's deadline (50 s)
    group.close()


def test_replies_awaited_out_of_order_each_get_their_own(group):
    async def scenario():
        update = ManagedWorker.update_weights
        first, second = group.submit(1, update, 1), group.submit(1, update, 2)
        return await second, await first

    assert asyncio.run(scenario()) == (Sent(t0=2.0, send_s=0.5), Sent(t0=1.0, send_s=0.5))
    group.stop(wait=True)


def test_a_call_posted_while_a_reply_is_awaited_does_not_hide_that_reply(group):
    """A send outside zmq.asyncio left the receive already awaited on the socket unwoken: its reply sat queued
    until the deadline."""

    async def scenario():
        first = asyncio.ensure_future(group.submit(1, ManagedWorker.update_weights, 1))
        await asyncio.sleep(0)  # first's receive is awaited now
        time.sleep(0.3)  # and its reply arrives while this loop is busy
        second = group.submit(1, ManagedWorker.update_weights, 2)
        return await asyncio.wait_for(first, 5), await asyncio.wait_for(second, 5)

    assert asyncio.run(scenario()) == (Sent(t0=1.0, send_s=0.5), Sent(t0=2.0, send_s=0.5))
    group.stop(wait=True)


def test_a_serving_rank_whose_caller_is_gone_ends_within_the_timeout(store):
    served, ends, failed = serving_rank(store, 1.0)
    group = TorchrunGroup(Local(), connect_calls(store, 2, 1.0), world_size=2, timeout=1.0)
    group.callers[1].post(Echo.slow_update, 1)
    time.sleep(0.1)  # the call reached rank 1
    group.close()  # rank 0 is gone before the reply
    served.join(timeout=10)
    assert not served.is_alive()
    assert failed == ["rank 1: the caller is gone (its end of the call channel closed)"]
    ends[0].close()


def test_a_serving_rank_that_gets_no_call_within_the_timeout_raises(store):
    served, ends, failed = serving_rank(store, 0.5)
    group = TorchrunGroup(Local(), connect_calls(store, 2, 0.5), world_size=2, timeout=0.5)
    served.join(timeout=10)
    assert failed == ["rank 1: no call within 0.5 s"]
    group.close()
    ends[0].close()


def test_a_call_by_a_string_is_refused_before_it_is_posted(group):
    with pytest.raises(ValueError, match=r"got 'update_weights'$"):
        asyncio.run(group.submit(1, "update_weights", 1))
    assert group.callers[1].seq == 0  # nothing posted: the serving rank's next call is its first
    group.stop(wait=True)


def test_a_call_or_result_that_does_not_travel_fails_that_call_and_the_rank_serves_on(group):
    # before, a call whose pickle did not load ended the serving rank (its loop raised), and rank 0 waited out
    # the reply's timeout
    async def scenario():
        with pytest.raises(channel.RemoteError, match=r"^the call does not load on rank 1: ModuleNotFoundError: "
                                                      r"No module named 'notebook_cell'$"):
            await group.submit(1, Echo.update_weights, LoadsNowhere())
        with pytest.raises(channel.RemoteError, match=r"^the reply does not load on rank 0: ModuleNotFoundError"):
            await group.submit(1, Echo.loads_nowhere)
        with pytest.raises(channel.RemoteError, match=r"^the result of Echo\.lock on rank 1 does not "
                                                      r"pickle: TypeError: cannot pickle '_thread\.lock' object$"):
            await group.submit(1, Echo.lock)
        with pytest.raises(TypeError, match="cannot pickle"):  # refused here: nothing posted
            await group.submit(1, Echo.update_weights, threading.Lock())
        return await group.submit(1, Echo.update_weights, 3)

    assert asyncio.run(scenario()) == Sent(t0=3.0, send_s=0.5)
    assert group.callers[1].seq == 4
    group.stop(wait=True)
