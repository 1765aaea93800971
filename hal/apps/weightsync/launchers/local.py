"""Workers in this process: calls are direct (the colocated launcher; tests build groups of fakes with it)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from hal.apps.weightsync.worker import describe_worker


class LocalGroup:
    """A :class:`ckpt.manager.WorkerGroup` of objects in this process (worker 0 the trainer); ``factory(index)``
    builds a replacement (``None``: replacing is refused)."""

    def __init__(self, workers: Sequence[Any], factory: Callable[[int], Any] | None = None,
                 trainer_world_size: int = 1) -> None:
        self.workers, self.factory = list(workers), factory
        self.trainer_world_size = trainer_world_size
        self.rollout_world_size = len(self.workers) - trainer_world_size

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.ensure_future(self.workers[index].invoke(method, *args, **kwargs))

    def describe(self, index: int) -> str:
        return describe_worker(index, None)

    def is_dead(self, error: BaseException) -> bool:
        return False  # a worker in this process cannot die alone

    def explain(self, error: BaseException) -> str:
        return f"{type(error).__name__}: {error}"

    async def replace(self, index: int) -> None:
        """Build a new worker ``index`` with the factory (ValueError without one)."""
        if self.factory is None:
            raise ValueError("this LocalGroup was built without a factory: it cannot replace a worker")
        self.workers[index] = self.factory(index)


__all__ = ["LocalGroup"]
