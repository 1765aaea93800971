"""verl's weight-update sequence and its fault policy, over any group of workers (one manager for every launcher).

A :class:`CheckpointEngineManager` drives a :class:`WorkerGroup` (trainer ranks first) as verl's does, every
update: ``prepare()`` on every engine; the class's ``build_topology``; ``init_process_group`` per rank; every
trainer's and rollout's ``update_weights(global_steps)`` concurrently; ``finalize()`` on every worker.

Fault policy (:meth:`CheckpointEngineManager.call`): a worker the group reports dead fails the call at once,
one that raised after at most ``grace`` more seconds (so the error names the dead peer that made it raise).
:class:`UpdateError` names every failed worker. Calls still running are settled, and their workers finalized,
before the next call; a replacement rollout joins at the next update, which forms a new group.
The manager knows nothing of how workers are started: a launcher provides the group."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence, runtime_checkable

from ckpt.errors import CheckpointEngineError

# Seconds a call whose worker raised still waits for the others, so a death that made the raise is reported.
ERROR_GRACE_S = 5.0

# The engine's synchronous methods a worker's execute_checkpoint_engine runs (verl's names).
LIFECYCLE_METHODS = ("prepare", "init_process_group", "finalize", "close")


class UpdateError(CheckpointEngineError, RuntimeError):
    """A call on the workers failed: names each failed worker (role, rank, node, device) and why."""


def rank_kwargs(engine_cls: type, trainers: int, rollouts: int, metadata: list) -> list[dict[str, Any]]:
    """Return each global rank's ``init_process_group`` keywords from ``engine_cls.build_topology``."""
    sides = engine_cls.build_topology(trainers, rollouts, metadata)
    per_rank: list[dict[str, Any]] = []
    for (side, n), kwargs in zip((("trainer", trainers), ("rollout", rollouts)), sides):
        for key, values in kwargs.items():
            if len(values) != n:
                raise UpdateError(f"{engine_cls.__name__}.build_topology gave {side} key {key!r} "
                                  f"{len(values)} entries for {n} ranks")
        per_rank += [{k: v[i] for k, v in kwargs.items()} for i in range(n)]
    return per_rank


def join_engine(engine: Any, rank: int, world_size: int, store: Any, key: str) -> None:
    """Form ``engine``'s group as the manager does, for ranks that meet on a shared ``store`` under ``key``.

    Rank 0 is the trainer (``is_master=True``), ranks ``1..world_size-1`` the rollouts. Use a new ``key`` for
    each group formed: metadata under a reused key may be read before it is rewritten."""
    store.set(f"{key}/meta/{rank}", json.dumps(engine.prepare()))
    metadata = [json.loads(store.get(f"{key}/meta/{r}")) for r in range(world_size)]
    engine.init_process_group(**rank_kwargs(type(engine), 1, world_size - 1, metadata)[rank])


class ManagedWorker:
    """What :class:`CheckpointEngineManager` calls on every worker: verl's worker-group methods of those names.

    The manager passes these functions themselves to :meth:`WorkerGroup.submit`; an override runs."""

    def invoke_targets(self) -> list[Any]:
        """Return the objects whose methods :meth:`invoke` runs: this worker (a subclass adds its add-ons)."""
        return [self]

    async def invoke(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (e.g. ``ManagedWorker.update_weights``) on the first target of its class; await if needed."""
        result = bound_method(self.invoke_targets(), method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run the engine's lifecycle method ``method`` (one of :data:`LIFECYCLE_METHODS`); return its result."""
        raise NotImplementedError

    async def update_weights(self, global_steps: int | None) -> Any:
        """Run this worker's part of the update: a trainer's send, a rollout's receive and apply."""
        raise NotImplementedError


def method_class(method: Callable) -> type:
    """Return the class whose body defines ``method``, found by module and qualified name as pickle does.

    Raises ``ValueError`` for a lambda, a nested, private or bound function."""
    qualname = getattr(method, "__qualname__", "")
    owner, _, name = qualname.rpartition(".")
    if not owner or "<" in qualname or name.startswith("_") or hasattr(method, "__self__"):
        raise ValueError(f"method must be a public function of a module-level class (e.g. "
                         f"ManagedWorker.update_weights), got {method!r}")
    cls: Any = sys.modules[method.__module__]
    for part in owner.split("."):
        cls = getattr(cls, part)
    return cls


def bound_method(owners: Iterable[Any], method: Callable) -> Callable:
    """Bind ``method`` by name to the first of ``owners`` that is an instance of its class (overrides win)."""
    cls = method_class(method)
    owners = list(owners)
    for owner in owners:
        if isinstance(owner, cls):
            return getattr(owner, method.__name__)
    raise AttributeError(f"{method.__qualname__}: none of {[type(o).__name__ for o in owners]} is a "
                         f"{cls.__name__}")


@runtime_checkable
class WorkerGroup(Protocol):
    """Workers ``0 .. trainer_world_size + rollout_world_size - 1``, trainer ranks first, as a launcher gives them."""

    trainer_world_size: int
    rollout_world_size: int

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """Start ``method(*args, **kwargs)`` on worker ``index``; the awaitable gives its result or raises."""

    def describe(self, index: int) -> str:
        """The worker in words, e.g. ``"rollout rank 2 on node 10.0.0.2, NPU 1, pid 42"``."""

    def is_dead(self, error: BaseException) -> bool:
        """Whether ``error`` says its worker is gone for good."""

    def explain(self, error: BaseException) -> str:
        """One line saying what ``error`` was."""

    async def replace(self, index: int) -> None:
        """Start a new worker in place of ``index``."""


class CheckpointEngineManager:
    """verl's update sequence over ``group`` with the fault policy of the module overview.

    ``timeout``: seconds the engine may take for one phase; a call waits at most ``timeout + margin`` seconds."""

    def __init__(self, engine_cls: Any, group: WorkerGroup, timeout: float, grace: float = ERROR_GRACE_S,
                 margin: float = 30.0) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.engine_cls, self.group = engine_cls, group
        self.timeout, self.grace, self.margin = float(timeout), float(grace), float(margin)
        self.unsettled: dict[int, asyncio.Future] = {}  # {worker index: its call} left running by a failed call

    @property
    def world_size(self) -> int:
        return self.group.trainer_world_size + self.group.rollout_world_size

    @property
    def rollouts(self) -> list[int]:
        return list(range(self.group.trainer_world_size, self.world_size))

    async def call(self, indices: Sequence[int], method: Callable, args: Sequence[tuple] | None = None, *,
                   what: str | None = None, limit: float | None = None,
                   kwargs: Sequence[dict[str, Any]] | None = None) -> list[Any]:
        """Run ``method`` on every worker of ``indices`` concurrently (``args[i]`` and ``kwargs[i]`` for the i-th);
        return results in order.

        Raises :class:`UpdateError` naming each worker that failed or did not answer within ``limit`` seconds."""
        method_class(method)
        args = list(args) if args is not None else [()] * len(indices)
        kwargs = list(kwargs) if kwargs is not None else [{}] * len(indices)
        if len(args) != len(indices) or len(kwargs) != len(indices):
            raise ValueError(f"args and kwargs must give one entry per worker: {len(args)} and {len(kwargs)} for "
                             f"{len(indices)} workers")
        futures = [asyncio.ensure_future(self.group.submit(i, method, *a, **k))
                   for i, a, k in zip(indices, args, kwargs)]
        return await self.settle(futures, what or method.__qualname__, list(indices), limit)

    async def settle(self, futures: list[asyncio.Future], what: str, indices: list[int],
                     limit: float | None = None) -> list[Any]:
        """Return the results of ``futures`` under the fault policy."""
        limit = self.timeout + self.margin if limit is None else limit
        deadline = time.monotonic() + limit
        by_future = dict(zip(futures, indices))
        pending = set(futures)
        failed_by: float | None = None
        dead = False
        while pending and not dead:
            until = deadline if failed_by is None else min(deadline, failed_by)
            done, pending = await asyncio.wait(pending, timeout=max(0.0, until - time.monotonic()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the deadline, or the grace after a failure, passed
            for future in done:
                error = future.exception()
                if error is not None:
                    dead = dead or self.group.is_dead(error)
                    if failed_by is None:
                        failed_by = time.monotonic() + self.grace
        results, failures = [], []
        for future in futures:
            index = by_future[future]
            if not future.done():
                results.append(None)
                if failed_by is not None:
                    self.unsettled[index] = future
                else:
                    future.cancel()
                    failures.append(f"{self.group.describe(index)}: no answer within {limit:g} s")
            elif future.exception() is not None:
                results.append(None)
                failures.append(f"{self.group.describe(index)}: {self.group.explain(future.exception())}")
            else:
                results.append(future.result())
        if failures:
            raise UpdateError(f"{what} failed: " + "; ".join(failures))
        return results

    async def settle_leftovers(self) -> list[int]:
        """Wait for calls a failed call left running, finalizing each worker; return the indices that ended."""
        pending = {future: index for index, future in self.unsettled.items()}
        self.unsettled = {}
        ended = []
        deadline = time.monotonic() + self.timeout + self.margin
        while pending and time.monotonic() < deadline:
            done, _ = await asyncio.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                future.exception()  # retrieved: its failure was reported with the call that left it
                ended.append(pending.pop(future))
            await self.finalize(ended[-len(done):])
        for future in pending:
            future.cancel()
        return sorted(ended)

    async def finalize(self, indices: Sequence[int]) -> None:
        """Run ``finalize()`` on the engines of ``indices``, skipping dead workers."""
        finalize = ManagedWorker.execute_checkpoint_engine
        futures = [asyncio.ensure_future(self.group.submit(i, finalize, "finalize")) for i in indices]
        if futures:
            await asyncio.wait(futures, timeout=self.timeout)
        for future in futures:
            if future.done():
                future.exception()  # a dead worker has nothing to finalize
            else:
                future.cancel()

    async def build_process_group(self) -> None:
        """Run ``prepare()``, ``build_topology`` and ``init_process_group`` on every worker."""
        everyone = list(range(self.world_size))
        metadata = await self.call(everyone, ManagedWorker.execute_checkpoint_engine, [("prepare",)] * self.world_size,
                                   what="prepare")
        per_rank = rank_kwargs(self.engine_cls, self.group.trainer_world_size, self.group.rollout_world_size,
                               metadata)
        init = ManagedWorker.execute_checkpoint_engine
        futures = [asyncio.ensure_future(self.group.submit(i, init, "init_process_group", **kwargs))
                   for i, kwargs in enumerate(per_rank)]
        await self.settle(futures, "init_process_group", everyone)

    async def update_weights(self, global_steps: int | None, **rollout_kwargs: Any) -> list[Any]:
        """Run one update as verl's manager does; return every worker's result, trainer ranks first.

        ``rollout_kwargs`` go to every rollout's ``update_weights`` (verl's ``peft_config``, ``base_sync_done``)."""
        await self.settle_leftovers()
        everyone = list(range(self.world_size))
        kwargs = [{}] * self.group.trainer_world_size + [rollout_kwargs] * self.group.rollout_world_size
        try:
            await self.build_process_group()
            results = await self.call(everyone, ManagedWorker.update_weights, [(global_steps,)] * self.world_size,
                                      what=f"update to global_steps {global_steps}", kwargs=kwargs)
        finally:
            await self.finalize([i for i in everyone if i not in self.unsettled])
        return results

    async def replace_rollout(self, index: int) -> None:
        """Start a new worker in place of rollout ``index``; it joins at the next update."""
        if index not in self.rollouts:
            raise ValueError(f"index must be a rollout worker's ({self.rollouts}), got {index!r}")
        future = self.unsettled.pop(index, None)
        if future is not None:
            future.cancel()
        await self.group.replace(index)


__all__ = ["CheckpointEngineManager", "ERROR_GRACE_S", "LIFECYCLE_METHODS", "ManagedWorker", "UpdateError",
           "WorkerGroup", "bound_method", "join_engine", "method_class", "rank_kwargs"]
