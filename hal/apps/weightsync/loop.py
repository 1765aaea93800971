"""The weight-sync job's one step loop, the same under every launcher.

Each step: the trainer trains, offloads and casts; the update runs as verl's
:class:`ckpt.manager.CheckpointEngineManager` runs it (prepare, build_topology, init_process_group, send and
receives concurrently, finalize); every rollout checks what it serves against the trainer's reference; the
trainer onloads and judges its peak. Step 0, untimed, loads the initial weights. Hooks (:class:`StepHook`)
measure around each publish. A failed call raises :class:`ckpt.manager.UpdateError` naming the worker; the
trainer drops its buffer and onloads, so the next step starts clean (with ``--wire-format delta``, as a seed).
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

# seconds a worker may take to start (imports, its model) besides the timeout
START_MARGIN_S = 150.0


async def attach_everywhere(manager: CheckpointEngineManager, attached: set[int], addon_cls: type,
                            what: str) -> list[int]:
    """Attach an ``addon_cls`` on every worker of ``manager`` not yet in ``attached``; returns every worker's index."""
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
    """What a run produced: the warmup (step 0), a row per step, and what the launcher adds (``extra``)."""

    warmup: dict[str, Any]
    rows: list[dict[str, Any]]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        """One sentence per rollout that failed a step, and per rank whose peak exceeded its stated bound."""
        errors = [f"step 0 (initial weights): {e}" for e in self.warmup.get("errors", [])]
        for row in self.rows:
            errors += [f"step {row['global_steps']}, rollout rank {r['rank']}: {r['error']}"
                       for r in row["rollouts"] if r["error"]]
            errors += [f"step {row['global_steps']}, {failure}" for failure in memory_failures(row)]
            errors += [f"step {row['global_steps']}, weight check, {who}: {'; '.join(found)}"
                       for who, found in ((row.get("check") or {}).get("mismatches") or {}).items()]
        return errors

    def report(self, steps: int) -> dict[str, Any]:
        """The ``--json`` fields of the run: ``warmup``, ``rows`` (each with ``ok``), ``verified``, ``errors``, ..."""
        for row in self.rows:
            row["ok"] = row_ok(row)
        return {"warmup": self.warmup, **self.extra, **summary(self.rows), "rows": self.rows,
                "verified": not self.errors and len(self.rows) == steps, "errors": self.errors}


def engine_class(options: JobOptions) -> Any:
    """The class of ``options.engine`` (its ``build_topology`` runs where the loop runs)."""
    import ckpt

    return ckpt.checkpoint_engine_factory(options.engine)


class Job:
    """The job over a launcher's ``group`` (worker 0 the trainer, 1..R the rollouts)."""

    def __init__(self, options: JobOptions, group: WorkerGroup, hooks: Sequence[StepHook] = ()) -> None:
        self.options, self.group, self.hooks = options, group, list(hooks)
        self.manager = CheckpointEngineManager(engine_class(options), group, options.timeout)
        # {global_steps: {name: checksum}} of the last step every rollout verified
        self.checksums: dict[int, dict[str, str]] = {}
        self.shape: tuple[int, int] = (0, 0)
        self.abandon_pending = False
        # why the next update must be a full seed (delta), sent to the trainer by settle()
        self.reseed_pending: str | None = None

    @property
    def everyone(self) -> list[int]:
        return list(range(self.manager.world_size))

    @property
    def trainers(self) -> list[int]:
        """The trainer ranks' indices (``[0]`` unless the trainer is sharded)."""
        return list(range(self.group.trainer_world_size))

    async def on_trainers(self, method: Callable, args: tuple = (), what: str | None = None) -> list[Any]:
        """``method(*args)`` on every trainer rank at once (a sharded trainer's calls are collectives)."""
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
        if self.reseed_pending is not None and (self.options.delta or self.options.lora_adapters):
            await self.on_trainers(Trainer.reseed, (self.reseed_pending,))
        self.reseed_pending = None
        if self.abandon_pending:
            self.abandon_pending = False
            await self.on_trainers(Trainer.abandon, what="onload")

    async def abandon(self) -> None:
        """After a failed step: the trainer drops its published buffer and onloads, now or in :meth:`settle`."""
        self.reseed_pending = "the last update failed"  # a rollout may hold part of it
        if any(i in self.manager.unsettled for i in self.trainers):
            self.abandon_pending = True
            return
        with contextlib.suppress(UpdateError):  # the trainer itself failed: the step's error says so
            await self.on_trainers(Trainer.abandon, what="onload")

    async def reseed_if_needed(self, received: Sequence[Any]) -> None:
        """Make the trainer re-seed the next update when a rollout's receiver needs a seed (delta) or holds no base
        (LoRA adapters)."""
        if self.options.delta:
            from hal.apps.weightsync.delta import reseed_reason
        elif self.options.lora_adapters:
            from hal.apps.weightsync.lora import rebase_reason as reseed_reason
        else:
            return
        reason = reseed_reason(received)
        if reason is not None:
            await self.on_trainers(Trainer.reseed, (reason,))

    async def warmup(self) -> dict[str, Any]:
        """Step 0, untimed: returns ``{"publish_s", "errors", "wall_s"}`` and the hooks' fields."""
        start = time.perf_counter()
        await self.settle()
        await self.on_trainers(Trainer.stage)
        try:
            sent, received = self.split(await self.manager.update_weights(0, **await self.update_kwargs()))
            await self.reseed_if_needed(received)
            nbytes = sent.nbytes or self.shape[0]
            out = {"publish_s": publish_seconds(sent, received), **wire_figures(sent, nbytes),
                   "errors": [f"rollout rank {r.rank}: {r.error}" for r in received if r.error]}
            for hook in self.hooks:
                await hook.after_publish(self, 0)
                out.update(hook.figures(0, nbytes, out["publish_s"]))
            if sent.lora is not None:
                out["lora"] = sent.lora
        except UpdateError:
            await self.abandon()
            raise
        await self.on_trainers(Trainer.release)
        out["wall_s"] = time.perf_counter() - start
        return out

    async def step(self, global_steps: int) -> dict[str, Any]:
        """Train, publish as ``global_steps``, verify every rollout, onload; returns the step's row (UpdateError:
        the trainer onloads now or before the next step)."""
        await self.settle()
        trained, *_ = await self.on_trainers(Trainer.train, (global_steps,))
        rollouts = self.manager.rollouts
        try:
            for hook in self.hooks:
                await hook.before_publish(self, global_steps)
            sent, received = self.split(await self.manager.update_weights(global_steps,
                                                                          **await self.update_kwargs()))
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
        row = step_row(trained, sent, received, checked, concluded, sent.nbytes or self.shape[0],
                       sent.tensors or self.shape[1], reference.tokens)
        if reference.adapter_logits_shift is not None:
            row["lora"]["adapter_logits_shift"] = reference.adapter_logits_shift
        for hook in self.hooks:
            row.update(hook.figures(global_steps, row["bytes"], row["publish_s"]))
        self.checksums = {global_steps: reference.sums}
        return row

    async def update_kwargs(self) -> dict[str, Any]:
        """The rollouts' ``update_weights`` keywords for the staged publish (LoRA adapters: ``peft_config``,
        ``base_sync_done``)."""
        if not self.options.lora_adapters:
            return {}
        return (await self.on_trainers(Trainer.update_kwargs))[0]

    def split(self, results: Sequence[Any]) -> tuple[Sent, list[Any]]:
        """An update's results as ``(the trainer's send, [each rollout's receive])``."""
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
    """A rich progress bar on stderr where it is a terminal; elsewhere none (one line per step instead)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal)


async def run(options: JobOptions, group: WorkerGroup, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Start the job on ``group`` and run it; the one loop every launcher runs (UpdateError names a failed worker)."""
    job = Job(options, group, hooks)
    await job.start()
    return await job.run_steps()


__all__ = ["Job", "JobResult", "StepHook", "engine_class", "progress_bar", "run"]
