"""ckpt.manager: verl's update sequence over a group of in-process fake workers, and its fault policy."""

from __future__ import annotations

import asyncio
import time

import pytest

from ckpt.manager import CheckpointEngineManager, ManagedWorker, UpdateError, bound_method, method_class

TIMEOUT = 10.0  # the engine's timeout: a policy that waited it out would take this long


class Died(Exception):
    """What the fake group's call raises when its worker is gone (as Ray's RayActorError)."""


class FakeEngine:
    """Records the lifecycle calls; build_topology gives each rank its index."""

    @classmethod
    def build_topology(cls, trainer_world_size, rollout_world_size, metadata):
        n = trainer_world_size + rollout_world_size
        ranks = [m["id"] for m in metadata]
        return {"rank": ranks[:trainer_world_size]}, {"rank": ranks[trainer_world_size:n]}


class FakeWorker(ManagedWorker):
    """A worker whose update can be made to raise, die, or hang (a partner of a broken collective)."""

    def __init__(self, index: int, log: list, fail: str | None = None) -> None:
        self.index, self.log, self.fail = index, log, fail
        self.rank = None

    async def invoke(self, method, *args, **kwargs):
        self.log.append((self.index, method.__name__, args, kwargs))
        return await super().invoke(method, *args, **kwargs)

    def execute_checkpoint_engine(self, method, **kwargs):
        if method == "prepare":
            return {"id": self.index}
        if method == "init_process_group":
            self.rank = kwargs["rank"]
        return None

    async def update_weights(self, global_steps):
        if self.fail == "raise":
            raise ValueError(f"worker {self.index} cannot apply step {global_steps}")
        if self.fail == "die":
            await asyncio.sleep(0.05)
            raise Died()
        if self.fail == "hang":  # waits for a peer that will never come, until its own timeout
            await asyncio.sleep(TIMEOUT)
            raise TimeoutError("peer gone")
        return ("applied", self.index, global_steps)


class FakeGroup:
    def __init__(self, fails: dict[int, str], rollouts: int = 2) -> None:
        self.log: list = []
        self.trainer_world_size, self.rollout_world_size = 1, rollouts
        self.workers = [FakeWorker(i, self.log, fails.get(i)) for i in range(1 + rollouts)]
        self.replaced: list[int] = []

    def submit(self, index, method, *args, **kwargs):
        return self.workers[index].invoke(method, *args, **kwargs)

    def describe(self, index):
        return "trainer" if index == 0 else f"rollout rank {index} on node 10.0.0.{index}"

    def is_dead(self, error):
        return isinstance(error, Died)

    def explain(self, error):
        return "the worker died" if isinstance(error, Died) else f"{type(error).__name__}: {error}"

    async def replace(self, index):
        self.replaced.append(index)
        self.workers[index] = FakeWorker(index, self.log)


def manager(group, grace: float = 5.0) -> CheckpointEngineManager:
    return CheckpointEngineManager(FakeEngine, group, timeout=TIMEOUT, grace=grace, margin=1.0)


def test_an_update_runs_verls_sequence_on_every_worker():
    group = FakeGroup({})
    results = asyncio.run(manager(group).update_weights(7))
    assert results == [("applied", 0, 7), ("applied", 1, 7), ("applied", 2, 7)]
    phases = [(m if m != "execute_checkpoint_engine" else a[0]) for _, m, a, _ in group.log]
    assert phases == ["prepare"] * 3 + ["init_process_group"] * 3 + ["update_weights"] * 3 + ["finalize"] * 3
    assert [w.rank for w in group.workers] == [0, 1, 2]  # each got its own entry of build_topology's lists


def test_a_worker_that_raises_fails_the_update_naming_it_and_the_others_are_settled_later():
    group = FakeGroup({2: "raise", 1: "hang"})
    m = manager(group, grace=0.2)

    async def scenario():
        start = time.monotonic()
        with pytest.raises(UpdateError) as info:
            await m.update_weights(3)
        elapsed = time.monotonic() - start
        assert list(m.unsettled) == [1]  # the hanging partner: settled before the next update
        return elapsed, str(info.value)

    elapsed, message = asyncio.run(scenario())
    assert message == "update to global_steps 3 failed: rollout rank 2 on node 10.0.0.2: ValueError: worker 2 " \
                      "cannot apply step 3"
    assert elapsed < 2.0  # within the grace, not after the engine's timeout


def test_a_dead_worker_fails_the_update_at_once_not_after_the_timeout():
    group = FakeGroup({1: "die", 2: "hang"})
    m = manager(group)  # grace 5 s: a death does not wait for it

    async def scenario():
        start = time.monotonic()
        with pytest.raises(UpdateError, match=r"^update to global_steps 1 failed: rollout rank 1 on node "
                                              r"10\.0\.0\.1: the worker died$"):
            await m.update_weights(1)
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 1.0


def test_a_replacement_rollout_joins_the_next_update():
    group = FakeGroup({2: "die"})
    m = manager(group)

    async def scenario():
        with pytest.raises(UpdateError, match="rollout rank 2"):
            await m.update_weights(1)
        await m.replace_rollout(2)
        return await m.update_weights(2)

    assert asyncio.run(scenario()) == [("applied", 0, 2), ("applied", 1, 2), ("applied", 2, 2)]
    assert group.replaced == [2]
    with pytest.raises(ValueError, match=r"index must be a rollout worker's \(\[1, 2\]\), got 0"):
        asyncio.run(m.replace_rollout(0))


def test_a_worker_that_does_not_answer_within_the_limit_is_named():
    group = FakeGroup({1: "hang"})
    m = manager(group)
    with pytest.raises(UpdateError, match=r"^slow failed: rollout rank 1 on node 10\.0\.0\.1: no answer within 0\.2 s$"):
        asyncio.run(m.call([1], ManagedWorker.update_weights, [(1,)], what="slow", limit=0.2))


def test_a_topology_with_a_list_of_the_wrong_length_is_refused():
    class Wrong(FakeEngine):
        @classmethod
        def build_topology(cls, trainer_world_size, rollout_world_size, metadata):
            return {"rank": [0]}, {"rank": [1]}  # one entry for two rollouts

    m = CheckpointEngineManager(Wrong, FakeGroup({}), timeout=TIMEOUT)
    with pytest.raises(UpdateError, match="Wrong.build_topology gave rollout key 'rank' 1 entries for 2 ranks"):
        asyncio.run(m.update_weights(1))


class Base:
    def name(self):
        return "base"


class Override(Base):
    def name(self):
        return "override"

    def _private(self):
        return "private"


def test_a_call_names_the_method_itself_and_runs_the_subclass_override():
    assert method_class(Base.name) is Base
    assert method_class(ManagedWorker.update_weights) is ManagedWorker
    assert bound_method([object(), Override()], Base.name)() == "override"
    with pytest.raises(AttributeError, match=r"^Base\.name: none of \['FakeWorker'\] is a Base$"):
        bound_method([FakeWorker(0, [])], Base.name)


@pytest.mark.parametrize("method", [lambda self: None, Override._private, Override().name, print, "update_weights"],
                         ids=["lambda", "private", "bound", "builtin", "string"])
def test_a_call_of_something_that_is_not_a_public_method_of_a_class_is_refused(method):
    with pytest.raises(ValueError, match=r"^method must be a public function of a module-level class \(e\.g\. "
                                         r"ManagedWorker\.update_weights\), got "):
        method_class(method)


def test_a_failed_call_without_words_is_named_by_its_method():
    m = CheckpointEngineManager(FakeEngine, FakeGroup({1: "raise"}), timeout=TIMEOUT, grace=0.1)
    with pytest.raises(UpdateError, match=r"^ManagedWorker\.update_weights failed: rollout rank 1 on node "
                                          r"10\.0\.0\.1: ValueError: worker 1 cannot apply step 3$"):
        asyncio.run(m.call([1], ManagedWorker.update_weights, [(3,)]))


def test_a_call_by_a_string_is_refused_before_any_worker_is_called():
    group = FakeGroup({})
    m = CheckpointEngineManager(FakeEngine, group, timeout=TIMEOUT)
    with pytest.raises(ValueError, match=r"got 'update_weights'$"):
        asyncio.run(m.call([0, 1, 2], "update_weights", [(1,)] * 3))
    assert group.log == []
