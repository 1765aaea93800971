"""verl's weight-update sequence and its fault policy, over any group of workers (one manager for every launcher).

A :class:`CheckpointEngineManager` drives a :class:`WorkerGroup` (trainer ranks first, then rollout ranks) as
verl's ``CheckpointEngineManager`` drives its worker groups, every update:

1. ``prepare()`` on every worker's checkpoint engine, gathering their metadata;
2. the engine class's ``build_topology(trainer_world_size, rollout_world_size, metadata)``: per-rank keyword
   lists;
3. ``init_process_group(**one rank's entries)`` on every worker (hal's engines keep their communicator
   while the topology is unchanged);
4. every trainer's ``update_weights(global_steps)`` (its send) and every rollout's (its receive and apply)
   concurrently;
5. ``finalize()`` on every worker.

Fault policy (every call the manager makes, :meth:`CheckpointEngineManager.call`): the first failure ends
the wait; a worker the group reports dead (:meth:`WorkerGroup.is_dead`) fails the call at once, a worker that
raised after at most ``grace`` more seconds (a peer's death makes its partners raise before the death itself
is reported, and the error should name the dead one). :class:`UpdateError` names every worker that failed
(:meth:`WorkerGroup.describe`: role, rank, node and device when known). The calls still running (the other
ranks of a broken collective, which end within their engine's timeout) are settled, and their workers
finalized, before the next call (:meth:`CheckpointEngineManager.settle_leftovers`); a replacement rollout
(:meth:`CheckpointEngineManager.replace_rollout`) joins at the next update, which forms a new group.

The manager knows nothing of how workers are started: a launcher (processes over a store, Ray actors,
objects in this process) provides the group. It imports only hal's API and ``ckpt``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence, runtime_checkable

from ckpt.errors import CheckpointEngineError

ERROR_GRACE_S = 5.0
"""Seconds a call whose worker raised still waits for the other workers (at most), so a death that made
the raise is reported too."""

LIFECYCLE_METHODS = ("prepare", "init_process_group", "finalize", "close")
"""The checkpoint engine's synchronous methods a worker's ``execute_checkpoint_engine`` runs (verl's names)."""


class UpdateError(CheckpointEngineError, RuntimeError):
    """A call on the workers failed: names each failed worker (role, rank, node, device) and why."""


def rank_kwargs(engine_cls: type, trainers: int, rollouts: int, metadata: list) -> list[dict[str, Any]]:
    """Each global rank's ``init_process_group`` keywords (trainer ranks first, then rollout ranks) from
    ``engine_cls.build_topology(trainers, rollouts, metadata)``, whose sides give one list entry per rank.

    Raises:
        UpdateError: ``build_topology`` gave a side a list of the wrong length.
    """
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
    """Form ``engine``'s group as :class:`CheckpointEngineManager` does, for ranks that meet on a shared
    ``store`` (a ``torch.distributed.Store``, such as :func:`hal.launcher_store`) instead of a manager:
    ``prepare()`` on every rank, the metadata gathered through ``store`` under ``key`` (JSON), then
    ``init_process_group`` with this rank's keywords from ``build_topology(1, world_size - 1, metadata)``.

    Rank 0 is the trainer (its engine made with ``is_master=True``, so its ``prepare()`` says where its
    rendezvous is, hosted on a port the kernel picked), ranks ``1..world_size-1`` the rollouts. Each rank makes
    its engine verl's way first, e.g. ``ckpt.get_checkpoint_engine("collective", is_master=rank == 0,
    master_addr="127.0.0.1", bucket_size=1 << 20)``: ``master_addr`` is where the rollouts reach the trainer
    (loopback on one host; by default the trainer's host address, which must resolve). Every rank calls it with
    the same ``key``, a new one for each group it forms (a rank's metadata under a reused key may be read
    before the rank has written the new one).

    Raises:
        UpdateError: ``build_topology`` gave a side a list of the wrong length.
        ckpt.CheckpointError: what the engine's lifecycle raises.
    """
    store.set(f"{key}/meta/{rank}", json.dumps(engine.prepare()))
    metadata = [json.loads(store.get(f"{key}/meta/{r}")) for r in range(world_size)]
    engine.init_process_group(**rank_kwargs(type(engine), 1, world_size - 1, metadata)[rank])


class ManagedWorker:
    """What :class:`CheckpointEngineManager` calls on every worker of its group: verl's worker-group methods
    of the same names. A launcher's worker class derives from it, and the manager passes these functions
    themselves (``ManagedWorker.update_weights``) to :meth:`WorkerGroup.submit`, so a reader, or a tool,
    follows a call from the manager to the method that runs it (an override runs, as in a method call)."""

    def invoke_targets(self) -> list[Any]:
        """The objects whose methods :meth:`invoke` runs: this worker (a subclass adds its add-ons)."""
        return [self]

    async def invoke(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (a public function of a class, e.g. ``ManagedWorker.update_weights``) on the first of
        :meth:`invoke_targets` of that class (:func:`bound_method`), awaiting it if it is a coroutine function;
        returns its result. The one entry point a launcher calls on a worker.

        Raises:
            ValueError: ``method`` is not a public method of a class (:func:`method_class`).
            AttributeError: no target is of ``method``'s class. Whatever ``method`` raises.
        """
        result = bound_method(self.invoke_targets(), method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Run the checkpoint engine's synchronous lifecycle method ``method`` (one of
        :data:`LIFECYCLE_METHODS`) with ``kwargs``; returns what it returns."""
        raise NotImplementedError

    async def update_weights(self, global_steps: int | None) -> Any:
        """This worker's part of the update tagged ``global_steps``: a trainer's send, a rollout's receive and
        apply; returns what the launcher's job reads of it."""
        raise NotImplementedError


def method_class(method: Callable) -> type:
    """The class whose body defines ``method`` (a function, e.g. ``ManagedWorker.update_weights``), found by
    its module and qualified name, as pickle finds it.

    Raises:
        ValueError: ``method`` is not a public function defined in a module-level class body (a lambda, a
            nested function, a private method, a bound method).
    """
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
    """``method`` (see :func:`method_class`) bound to the first of ``owners`` that is an instance of the
    class defining it, looked up by name so that a subclass's override is the one bound.

    Raises:
        ValueError: ``method`` is not a public method (:func:`method_class`).
        AttributeError: no object of ``owners`` is an instance of that class.
    """
    cls = method_class(method)
    owners = list(owners)
    for owner in owners:
        if isinstance(owner, cls):
            return getattr(owner, method.__name__)
    raise AttributeError(f"{method.__qualname__}: none of {[type(o).__name__ for o in owners]} is a "
                         f"{cls.__name__}")


@runtime_checkable
class WorkerGroup(Protocol):
    """Workers ``0 .. trainer_world_size + rollout_world_size - 1``, trainer ranks first, as a launcher
    provides them; each worker is a :class:`ManagedWorker`."""

    trainer_world_size: int
    rollout_world_size: int

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """Start ``method(*args, **kwargs)`` on worker ``index`` (``method`` a worker class's function, such
        as ``ManagedWorker.update_weights``: :func:`bound_method` binds it there); the awaitable gives its
        result or raises its failure."""

    def describe(self, index: int) -> str:
        """The worker in words, e.g. ``"rollout rank 2 on node 10.0.0.2, NPU 1, pid 42"``."""

    def is_dead(self, error: BaseException) -> bool:
        """Whether ``error`` (a failed call's) says its worker is gone for good."""

    def explain(self, error: BaseException) -> str:
        """One line saying what ``error`` was (``"ValueError: ..."``, ``"the worker died"``)."""

    async def replace(self, index: int) -> None:
        """Start a new worker in place of ``index`` (a rollout whose process died or was killed)."""


class CheckpointEngineManager:
    """verl's update sequence over ``group`` with the fault policy of this module's docstring.

    Args:
        engine_cls: the checkpoint engine's class (its classmethod ``build_topology`` runs here).
        group: the workers (:class:`WorkerGroup`).
        timeout: seconds the engine may take for one phase; a call waits at most ``timeout + margin``.
        grace: see :data:`ERROR_GRACE_S`.
        margin: seconds added to ``timeout`` before a worker that does not answer is a failure.
    """

    def __init__(self, engine_cls: Any, group: WorkerGroup, timeout: float, grace: float = ERROR_GRACE_S,
                 margin: float = 30.0) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.engine_cls, self.group = engine_cls, group
        self.timeout, self.grace, self.margin = float(timeout), float(grace), float(margin)
        self.unsettled: dict[int, asyncio.Future] = {}
        """``{worker index: its call}`` still running from a failed call, settled by :meth:`settle_leftovers`."""

    @property
    def world_size(self) -> int:
        return self.group.trainer_world_size + self.group.rollout_world_size

    @property
    def rollouts(self) -> list[int]:
        """The rollout workers' indices."""
        return list(range(self.group.trainer_world_size, self.world_size))

    async def call(self, indices: Sequence[int], method: Callable, args: Sequence[tuple] | None = None, *,
                   what: str | None = None, limit: float | None = None) -> list[Any]:
        """``method`` (a worker class's function, e.g. ``ManagedWorker.update_weights``: see
        :meth:`WorkerGroup.submit`) on every worker of ``indices`` (with ``args[i]`` as the positional arguments
        of the ``i``-th), concurrently; returns their results in order.

        Raises:
            ValueError: ``method`` is not a public method of a class (:func:`method_class`), before any call.
            UpdateError: names each worker that failed, died or did not answer within ``limit`` seconds
                (default ``timeout + margin``), as soon as the policy allows (see the module docstring).
        """
        method_class(method)
        args = list(args) if args is not None else [()] * len(indices)
        if len(args) != len(indices):
            raise ValueError(f"args must give one tuple per worker: {len(args)} for {len(indices)} workers")
        futures = [asyncio.ensure_future(self.group.submit(i, method, *a)) for i, a in zip(indices, args)]
        return await self.settle(futures, what or method.__qualname__, list(indices), limit)

    async def settle(self, futures: list[asyncio.Future], what: str, indices: list[int],
                     limit: float | None = None) -> list[Any]:
        """Results of ``futures`` (the calls of phase ``what`` on workers ``indices``) under the fault policy.

        Raises:
            UpdateError: see :meth:`call`.
        """
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
        """Wait (at most ``timeout + margin``) for the calls a failed call left running, finalizing each
        worker as its call ends, so a broken engine group is released and the next update forms a new one.

        Returns:
            The indices of the workers whose leftover call ended (a call that did not end is abandoned).
        """
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
        """``finalize()`` on the engines of ``indices``; a worker that cannot (dead) is skipped."""
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
        """``prepare()`` on every worker, ``build_topology`` from their metadata, ``init_process_group`` per
        rank with its entries.

        Raises:
            UpdateError: a worker failed, or ``build_topology`` gave a side a list of the wrong length.
        """
        everyone = list(range(self.world_size))
        metadata = await self.call(everyone, ManagedWorker.execute_checkpoint_engine, [("prepare",)] * self.world_size,
                                   what="prepare")
        per_rank = rank_kwargs(self.engine_cls, self.group.trainer_world_size, self.group.rollout_world_size,
                               metadata)
        init = ManagedWorker.execute_checkpoint_engine
        futures = [asyncio.ensure_future(self.group.submit(i, init, "init_process_group", **kwargs))
                   for i, kwargs in enumerate(per_rank)]
        await self.settle(futures, "init_process_group", everyone)

    async def update_weights(self, global_steps: int | None) -> list[Any]:
        """One update as verl's manager runs it; returns every worker's ``update_weights`` result, trainer
        ranks first.

        Calls left running by an earlier failure are settled first. The workers whose part ended are
        finalized now, the others once their part ended (:meth:`settle_leftovers`).

        Raises:
            UpdateError: a worker died or raised; names each, as soon as the policy allows.
        """
        await self.settle_leftovers()
        everyone = list(range(self.world_size))
        try:
            await self.build_process_group()
            results = await self.call(everyone, ManagedWorker.update_weights, [(global_steps,)] * self.world_size,
                                      what=f"update to global_steps {global_steps}")
        finally:
            await self.finalize([i for i in everyone if i not in self.unsettled])
        return results

    async def replace_rollout(self, index: int) -> None:
        """Start a new worker in place of rollout ``index`` (:meth:`WorkerGroup.replace`); its leftover
        call, if any, is forgotten. It joins at the next update.

        Raises:
            ValueError: ``index`` is not a rollout worker's.
        """
        if index not in self.rollouts:
            raise ValueError(f"index must be a rollout worker's ({self.rollouts}), got {index!r}")
        future = self.unsettled.pop(index, None)
        if future is not None:
            future.cancel()
        await self.group.replace(index)


__all__ = ["CheckpointEngineManager", "ERROR_GRACE_S", "LIFECYCLE_METHODS", "ManagedWorker", "UpdateError",
           "WorkerGroup", "bound_method", "join_engine", "method_class", "rank_kwargs"]
