"""The colocated launcher: the trainer and ``options.rollouts`` rollouts in this process, sharing one
colocated checkpoint engine."""

from __future__ import annotations

import asyncio

from hal.apps.weightsync.launchers.local import LocalGroup
from typing import Sequence

from hal.apps.weightsync.loop import JobResult, StepHook, run
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import make_engine


def local_group(options: JobOptions) -> LocalGroup:
    """The trainer and the rollouts of ``options`` in this process (the colocated engine is one shared object)."""
    shared = make_engine(options, 0, "127.0.0.1") if options.colocated else None

    def build(index: int):
        engine = shared if shared is not None else make_engine(options, index, "127.0.0.1")
        return Trainer(options, engine) if index == 0 else Rollout(options, engine, index)

    return LocalGroup([build(i) for i in range(1 + options.rollouts)], factory=build)


def launch(options: JobOptions, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Run the job with every worker in this process; ``hooks`` run around each publish."""
    return asyncio.run(run(options, local_group(options), hooks))


__all__ = ["launch", "local_group"]
