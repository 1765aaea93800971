"""The weight-sync job's one step loop, the same under every launcher.

Each step: the trainer trains, offloads and casts (``train``); the update runs as verl's manager runs it
(:class:`ckpt.manager.CheckpointEngineManager`: prepare, build_topology, init_process_group, the trainer's send
and every rollout's receive concurrently, finalize); the trainer computes its reference (``reference``:
checksums and its own bf16 model's decode) and every rollout checks what it serves against it (``check``);
the trainer onloads and judges its peak (``conclude``). A step's row is :func:`~hal.apps.weightsync.figures.step_row`'s.
Step 0, untimed, loads the trainer's initial weights into the rollouts (as an RL job syncs its rollouts
before their first generation), so one-time costs are paid before step 1 is timed.

Hooks (:class:`StepHook`) add a measurement around each publish (the raw-broadcast reference of ``hal sync``
is one: :class:`hal.apps.weightsync.raw.RawReference`). A failed call raises :class:`ckpt.manager.UpdateError`
naming the worker; the trainer then drops its published buffer and onloads, and the next step starts clean
(the calls still running are settled first).

With ``--wire-format delta`` the loop keeps the delta fault policy (:mod:`hal.apps.weightsync.delta`): a rollout
whose receiver needs a seed after an update (it refused it, its transfer failed), a failed step and a replaced
rollout make the trainer re-seed the next update (:meth:`Job.reseed_if_needed`, :meth:`Job.settle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

from ckpt.manager import CheckpointEngineManager, ManagedWorker, UpdateError, WorkerGroup
from hal.apps.weightsync.figures import memory_failures, publish_seconds, row_ok, step_row, summary, wire_figures
from hal.apps.weightsync.messages import Sent, merge_references, merge_sent
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import RolloutRole, Worker

START_MARGIN_S = 150.0
"""Seconds a worker may take to start (import torch and transformers, build its model) besides the timeout."""


async def attach_everywhere(manager: CheckpointEngineManager, attached: set[int], addon_cls: type,
                            what: str) -> list[int]:
    """Attach an ``addon_cls`` (see :meth:`Worker.attach`) on every worker of ``manager`` not yet in
    ``attached``, and record them there; returns every worker's index (the hooks' measurements span all).

    Raises:
        UpdateError: a worker failed or died in the call (names it; ``what`` names the phase).
    """
    everyone = list(range(manager.world_size))
    missing = [i for i in everyone if i not in attached]
    if missing:
        await manager.call(missing, Worker.attach, [(addon_cls,)] * len(missing), what=what)
        attached.update(missing)
    return everyone


class StepHook(Protocol):
    """A measurement the job runs around each publish, on its workers (through ``job.manager``)."""

    async def before_publish(self, job: Job, global_steps: int) -> None:
        """Just before the update of ``global_steps`` (after the trainer staged it); not for step 0."""

    async def after_publish(self, job: Job, global_steps: int) -> None:
        """After every rollout verified ``global_steps`` (step 0: after the rollouts applied it)."""

    def figures(self, global_steps: int, nbytes: int, publish_s: float) -> dict[str, Any]:
        """The fields this hook adds to the row of ``global_steps`` (0: to the warmup's)."""

    def members_changed(self, index: int) -> None:
        """Worker ``index`` was replaced by a new one."""


@dataclasses.dataclass
class JobResult:
    """What a run produced: the warmup (step 0: ``publish_s``, ``errors``, ``wall_s``, hooks' fields), a row
    per step (:func:`~hal.apps.weightsync.figures.step_row`), and what the launcher adds (``extra``)."""

    warmup: dict[str, Any]
    rows: list[dict[str, Any]]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        """One sentence per rollout that failed a step (step 0 included), and per rank whose peak exceeded
        its stated bound (:func:`~hal.apps.weightsync.figures.memory_failures`)."""
        errors = [f"step 0 (initial weights): {e}" for e in self.warmup.get("errors", [])]
        for row in self.rows:
            errors += [f"step {row['global_steps']}, rollout rank {r['rank']}: {r['error']}"
                       for r in row["rollouts"] if r["error"]]
            errors += [f"step {row['global_steps']}, {failure}" for failure in memory_failures(row)]
        return errors

    def report(self, steps: int) -> dict[str, Any]:
        """The ``--json`` fields of the run: ``warmup``, the launcher's, :func:`summary`'s, ``rows``,
        ``verified`` (no error and ``steps`` rows) and ``errors``; each row gets ``ok``
        (:func:`~hal.apps.weightsync.figures.row_ok`)."""
        for row in self.rows:
            row["ok"] = row_ok(row)
        return {"warmup": self.warmup, **self.extra, **summary(self.rows), "rows": self.rows,
                "verified": not self.errors and len(self.rows) == steps, "errors": self.errors}


def engine_class(options: JobOptions) -> Any:
    """The class of ``options.engine`` (its ``build_topology`` runs where the loop runs)."""
    import ckpt

    return ckpt.checkpoint_engine_factory(options.engine)


class Job:
    """The job over a launcher's ``group`` (worker 0 the trainer, 1..R the rollouts); see the module docstring.

    Args:
        options: the job's options.
        group: the workers (:class:`ckpt.manager.WorkerGroup`).
        hooks: measurements around each publish.
    """

    def __init__(self, options: JobOptions, group: WorkerGroup, hooks: Sequence[StepHook] = ()) -> None:
        self.options, self.group, self.hooks = options, group, list(hooks)
        self.manager = CheckpointEngineManager(engine_class(options), group, options.timeout)
        self.checksums: dict[int, dict[str, str]] = {}
        """``{global_steps: {name: checksum}}`` of the last step every rollout verified."""
        self.shape: tuple[int, int] = (0, 0)
        self.abandon_pending = False
        self.reseed_pending: str | None = None
        """Why the next update must be a full seed (``--wire-format delta``), sent to the trainer by :meth:`settle`."""

    @property
    def everyone(self) -> list[int]:
        return list(range(self.manager.world_size))

    @property
    def trainers(self) -> list[int]:
        """The trainer ranks' indices (``[0]`` unless the trainer is sharded)."""
        return list(range(self.group.trainer_world_size))

    async def on_trainers(self, method: Callable, args: tuple = (), what: str | None = None) -> list[Any]:
        """``method(*args)`` (a :class:`Trainer` method) on every trainer rank at once (a sharded trainer's
        calls are collectives)."""
        return await self.manager.call(self.trainers, method, [args] * len(self.trainers), what=what)

    async def start(self) -> list[Any]:
        """Wait until every worker is up; returns where each runs (``Worker.where``)."""
        where = await self.manager.call(self.everyone, Worker.where, what="start",
                                        limit=self.options.timeout + START_MARGIN_S)
        shapes = await self.on_trainers(Trainer.published_shape)
        self.shape = (sum(nbytes for nbytes, _ in shapes), max(tensors for _, tensors in shapes))
        return where

    async def settle(self) -> None:
        """Settle what a failed step left running; then, if that step could not yet, the trainer onloads."""
        await self.manager.settle_leftovers()
        if self.reseed_pending is not None and self.options.delta:
            await self.on_trainers(Trainer.reseed, (self.reseed_pending,))
        self.reseed_pending = None
        if self.abandon_pending:
            self.abandon_pending = False
            await self.on_trainers(Trainer.abandon, what="onload")

    async def abandon(self) -> None:
        """After a failed step: the trainer drops its published buffer and onloads, now or once its own call
        of the failed phase ended (:meth:`settle`)."""
        self.reseed_pending = "the last update failed"  # a rollout may hold part of it
        if any(i in self.manager.unsettled for i in self.trainers):
            self.abandon_pending = True
            return
        with contextlib.suppress(UpdateError):  # the trainer itself failed: the step's error says so
            await self.on_trainers(Trainer.abandon, what="onload")

    async def reseed_if_needed(self, received: Sequence[Any]) -> None:
        """The delta fault policy (:func:`hal.apps.weightsync.delta.reseed_reason`): a rollout whose receiver
        needs a seed (it refused the update, its transfer failed) makes the trainer re-seed the next update."""
        if not self.options.delta:
            return
        from hal.apps.weightsync.delta import reseed_reason

        reason = reseed_reason(received)
        if reason is not None:
            await self.on_trainers(Trainer.reseed, (reason,))

    async def warmup(self) -> dict[str, Any]:
        """Step 0, untimed: returns ``{"publish_s", "errors": [one sentence per rollout that failed], "wall_s"}``
        and the hooks' fields."""
        start = time.perf_counter()
        await self.settle()
        await self.on_trainers(Trainer.stage)
        try:
            sent, received = self.split(await self.manager.update_weights(0))
            await self.reseed_if_needed(received)
            out = {"publish_s": publish_seconds(sent, received), **wire_figures(sent, self.shape[0]),
                   "errors": [f"rollout rank {r.rank}: {r.error}" for r in received if r.error]}
            for hook in self.hooks:
                await hook.after_publish(self, 0)
                out.update(hook.figures(0, self.shape[0], out["publish_s"]))
        except UpdateError:
            await self.abandon()
            raise
        await self.on_trainers(Trainer.release)
        out["wall_s"] = time.perf_counter() - start
        return out

    async def step(self, global_steps: int) -> dict[str, Any]:
        """Train, publish as ``global_steps``, verify every rollout, onload; returns the step's row.

        Raises:
            UpdateError: a worker failed or died (named); the trainer onloads (now or before the next step).
        """
        await self.settle()
        trained, *_ = await self.on_trainers(Trainer.train, (global_steps,))
        rollouts = self.manager.rollouts
        try:
            for hook in self.hooks:
                await hook.before_publish(self, global_steps)
            sent, received = self.split(await self.manager.update_weights(global_steps))
            await self.reseed_if_needed(received)
            reference = merge_references(await self.on_trainers(Trainer.reference))
            checked = await self.manager.call(rollouts, RolloutRole.check, [(global_steps, reference)] * len(rollouts),
                                              what="verify")
            for hook in self.hooks:
                await hook.after_publish(self, global_steps)
        except UpdateError:
            await self.abandon()
            raise
        # colocated: the rollouts' banks are in the trainer's process, so in its peak
        extra = ({"rollout_banks_bytes": sum(r.held_bytes for r in received)},
                 "the rollouts' banks" + (" and delta receivers" if self.options.delta else "")) \
            if self.options.colocated else (None, "")
        concluded = await self.on_trainers(Trainer.conclude, extra, what="onload")
        row = step_row(trained, sent, received, checked, concluded, *self.shape, reference.tokens)
        for hook in self.hooks:
            row.update(hook.figures(global_steps, row["bytes"], row["publish_s"]))
        self.checksums = {global_steps: reference.sums}
        return row

    def split(self, results: Sequence[Any]) -> tuple[Sent, list[Any]]:
        """An update's results as ``(the trainer's send, [each rollout's receive])`` (several trainer ranks'
        sends merged: :func:`~hal.apps.weightsync.messages.merge_sent`)."""
        trainers = len(self.trainers)
        return merge_sent(results[:trainers]), list(results[trainers:])

    async def replace_rollout(self, index: int) -> None:
        """Start a new rollout in place of ``index``; it joins at the next step."""
        await self.manager.replace_rollout(index)
        self.reseed_pending = f"rollout {index} was replaced (a new member: the topology changed)"
        for hook in self.hooks:
            hook.members_changed(index)

    async def run_steps(self) -> JobResult:
        """Warm up, run ``options.steps`` steps (``global_steps`` 1..steps) and close the engines."""
        warmup = await self.warmup()
        rows = []
        with progress_bar() as progress:
            steps = self.options.steps
            task = progress.add_task("sync", total=steps)
            for step in range(1, steps + 1):
                progress.update(task, description=f"step {step}/{steps}")
                if not progress.console.is_terminal:
                    progress.console.print(f"hal sync: step {step}/{steps}")
                rows.append(await self.step(step))
                progress.advance(task)
        await self.close()
        return JobResult(warmup, rows)

    async def close(self) -> None:
        """End of the run: ``close()`` every worker's checkpoint engine (the group too)."""
        await self.manager.settle_leftovers()
        everyone = self.everyone
        await self.manager.call(everyone, ManagedWorker.execute_checkpoint_engine, [("close",)] * len(everyone),
                                what="close")


def progress_bar():
    """A rich progress bar on stderr where stderr is a terminal; elsewhere none (the loop prints one line per
    step instead, and no bar is drawn at the end, nor after an interrupt)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal)


async def run(options: JobOptions, group: WorkerGroup, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Start the job on ``group`` and run it (:meth:`Job.run_steps`); the one loop every launcher runs.

    Raises:
        UpdateError: a worker failed or died; the message names it (role, rank, node and device when known).
    """
    job = Job(options, group, hooks)
    await job.start()
    return await job.run_steps()


__all__ = ["Job", "JobResult", "StepHook", "engine_class", "progress_bar", "run"]
