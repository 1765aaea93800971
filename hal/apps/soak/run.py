"""The soak's driver: the weight-sync job for N updates while the plan's faults strike, then the checker.

One run (:func:`soak`) is one engine, wire format and seed. The job is the library's own
(:class:`hal.apps.weightsync.loop.Job`) over the soak's group (:mod:`hal.apps.soak.procs`). Per update ``g``:
arm the plan's fault in its target; run the step under a watchdog, timestamping every ``UpdateError``; undo
what the fault left (continue a stopped process, empty a filesystem, restore a link, restart a killed one);
observe every rollout and, after a clean update, sample every process's descriptors and memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any, Callable, Sequence

from hal.apps.soak import checker
from hal.apps.soak.child import STACKS_SIGNAL
from hal.apps.soak.faults import CLEAN_START, applicable, plan
from hal.apps.soak.options import SoakOptions
from hal.apps.soak.sandbox import Sandbox, machine_support
from hal.apps.soak.strike import Host

# seconds the driver waits, after a hang, for the worker to answer at all before the soak stops
HANG_GRACE_S = 300.0
STACK_LINES = 40  # lines of a hung worker's log kept in the report
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # stop a run cleanly
# bounded calls (timeout + margin each) a step may take before it is a hang
WATCHDOG_CALLS = 5


class Driver:
    """One run's state on the event loop: the job, its group, the sandbox, the history."""

    def __init__(self, options: SoakOptions, sandbox: Sandbox | None, kinds: Sequence[str],
                 progress: Callable[[int], None] | None = None, faults: dict[int, Any] | None = None,
                 model_path: str | None = None) -> None:
        from ckpt.manager import UpdateError
        from hal.apps.weightsync.loop import Job

        self.options, self.sandbox = options, sandbox
        self.faults = dict(faults) if faults is not None else \
            plan(options.seed, options.updates, kinds, options.rollouts, options.fault_rate)
        self.history = checker.History(options=options)
        self.UpdateError = UpdateError
        job_options = options.job_options(sandbox.files_dir if sandbox is not None else None, model_path)
        if sandbox is None:
            from hal.apps.soak.procs import InProcessGroup

            self.group: Any = InProcessGroup(job_options, self.on_notice)
        else:
            from hal.apps.soak.procs import ProcessGroup

            self.group = ProcessGroup(job_options, sandbox, self.on_notice)
        self.job = Job(job_options, self.group)
        self.job.manager.margin = options.margin
        self.errors: list[tuple[float, str]] = []
        self._time_update_errors()
        self.struck: list[tuple[Any, float]] = []
        self.resumed: dict[int, asyncio.Event] = {}
        self.progress = progress

    def _time_update_errors(self) -> None:
        """Timestamp every ``UpdateError`` as the manager raises it (the job catches some and raises later)."""
        manager, settle = self.job.manager, self.job.manager.settle

        async def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return await settle(*args, **kwargs)
            except self.UpdateError as exc:
                self.errors.append((time.time(), str(exc)))
                raise

        manager.settle = timed

    def on_notice(self, index: int, message: tuple) -> None:
        """A worker's notice: a step's published checksums, or a strike (a stop is continued later)."""
        if message[0] == "published":  # names interned: one copy of each across the run's steps
            self.history.published[message[1]] = {sys.intern(n): v for n, v in message[2].items()}
        elif message[0] == "struck":
            fault, at = message[1], message[2]
            self.struck.append((fault, at))
            if fault.kind == "stop":
                self.group.stop_process(index)
                event = self.resumed.setdefault(index, asyncio.Event())
                event.clear()

                def resume() -> None:
                    self.group.resume(index)
                    event.set()

                asyncio.get_running_loop().call_later(max(0.0, at + self.options.stop_s - time.time()), resume)

    async def start(self) -> None:
        """Start the workers and step 0 (the trainer's initial weights into every rollout)."""
        await self.group.start()
        where = await self.job.start()
        self.group.whereabouts = list(where)
        await self.job.warmup()
        await self.observe(0, None, time.time(), time.time(), ok=True, restarted=[])

    @property
    def step_limit_s(self) -> float:
        return WATCHDOG_CALLS * (self.options.timeout + self.options.margin) + self.options.stop_s

    async def update(self, g: int) -> bool:
        """Run update ``g`` with its fault; returns ``False`` when the soak cannot go on (a hang)."""
        fault = self.faults.get(g)
        self.errors, self.struck = [], []
        if fault is not None:
            await self.job.manager.call([fault.target], Host.arm, [(fault,)], what="arm the fault")
        started = time.time()
        row, hung = None, False
        try:
            row = await asyncio.wait_for(self.job.step(g), self.step_limit_s)
        except self.UpdateError:
            pass  # timestamped in self.errors
        except asyncio.TimeoutError:
            hung = True
        ended = time.time()
        if hung:
            await self.stacks(f"update {g}")
            self.history.add(checker.UpdateRecord(
                update=g, fault=fault, struck=list(self.struck), started_at=started, ended_at=ended, ok=False,
                errors=list(self.errors), stopped=True,
                hangs=[f"the step outlived the driver's watchdog ({self.step_limit_s:g} s)"]))
            return False
        ok = row is not None and all(r["error"] is None for r in row["rollouts"])
        if row is not None:
            self.errors += [(ended, f"step {g}, rollout rank {r['rank']}: {r['error']}")
                            for r in row["rollouts"] if r["error"]]
        restarted = await self.recover(fault)
        return await self.observe(g, fault, started, ended, ok, restarted)

    async def recover(self, fault: Any) -> list[int]:
        """Undo the fault's leftovers and restart every worker whose process died; returns the restarted indices."""
        for event in list(self.resumed.values()):
            await asyncio.wait_for(event.wait(), self.options.stop_s + self.options.margin)
        self.resumed.clear()
        if fault is not None and self.sandbox is not None:
            self.sandbox.repair(fault.kind, fault.target)
        restarted = []
        for index in range(1 + self.options.rollouts):
            if self.group.alive(index):
                continue
            restarted.append(index)
            if index == 0:
                await self.replace_trainer()
            else:
                await self.job.replace_rollout(index)
        if fault is not None and not any(f == fault for f, _ in self.struck) and self.group.alive(fault.target):
            with contextlib.suppress(self.UpdateError):  # a fault that never struck stays armed otherwise
                await self.job.manager.call([fault.target], Host.disarm, what="disarm the fault")
        return restarted

    async def replace_trainer(self) -> None:
        """Start a new trainer process in place of a dead one (a new group next update; a delta sender seeds)."""
        manager = self.job.manager
        leftover = manager.unsettled.pop(0, None)
        if leftover is not None:
            leftover.cancel()
        await self.group.replace(0)
        self.job.abandon_pending = False  # the new trainer staged nothing
        self.job.reseed_pending = "the trainer was replaced (a new process)"

    async def observe(self, g: int, fault: Any, started: float, ended: float, ok: bool, restarted: list[int]) -> bool:
        """Record update ``g``: what every rollout serves and reported, and (after a clean update) resources;
        ``False`` when a worker did not answer within the manager's bound (a hang)."""
        record = checker.UpdateRecord(update=g, fault=fault, struck=list(self.struck), started_at=started,
                                      ended_at=ended, ok=ok, errors=list(self.errors), restarted=restarted)
        rollouts = self.job.manager.rollouts
        try:
            try:
                seen = await self.job.manager.call(rollouts, Host.observe, what="observe the rollouts")
            except self.UpdateError as exc:  # a worker still in a call of the update past every bound: a hang
                record.hangs.append(f"{exc} (after the update ended)")
                await self.stacks(f"update {g}")
                seen = await self.job.manager.call(rollouts, Host.observe, what="observe the rollouts again",
                                                   limit=HANG_GRACE_S)
            record.observed = dict(zip(rollouts, seen))
            for observed in record.observed.values():  # the history keeps a digest where the bytes match
                published = self.history.published.get(observed["served_step"])
                observed["digest"] = checker.digest(observed["sums"])
                if published is not None and observed["digest"] == checker.digest(published):
                    observed["sums"] = None
            for index, observed in record.observed.items():  # a rollout's own error, when it ended
                report = observed.get("reported")
                if report and report["update"] == g and report["error"] and index not in restarted:
                    text = f"step {g}, rollout rank {index}: {report['error']}"
                    if all(text != known for _, known in record.errors):
                        record.errors.append((report["ended_at"], text))
            if ok and fault is None and not restarted and not record.hangs and g % self.options.sample_every == 0:
                # in process (colocated) the workers' process is the driver's: sampled once, as the driver
                record.resources = [] if self.sandbox is None else await self.job.manager.call(
                    self.job.everyone, Host.resources, what="sample resources")
        except self.UpdateError as exc:
            record.hangs.append(str(exc))
            record.stopped = True
            self.history.add(record)
            return False
        if record.resources is not None:
            import gc

            from hal.apps.weightsync.memory import held_resident_bytes, resident_bytes, trim_host_heap

            gc.collect()  # as the workers sample themselves (Host.resources)
            trim_host_heap()
            record.resources.append({"pid": os.getpid(), "fds": len(os.listdir("/proc/self/fd")),
                                     "rss_bytes": resident_bytes(), "held_bytes": held_resident_bytes(),
                                     "driver": True})
            if self.sandbox is not None:
                record.shm = self.sandbox.shm_segments()
                record.temp = self.sandbox.temp_entries()
        self.history.add(record)
        return True

    async def stacks(self, when: str) -> None:
        """Have every live worker write its threads' Python stacks to its log (SIGUSR2), for a hang's report."""
        if self.sandbox is None:  # the workers are this process's threads
            import faulthandler
            import tempfile

            with tempfile.TemporaryFile("w+") as out:
                faulthandler.dump_traceback(out, all_threads=True)
                out.seek(0)
                lines = [line.strip() for line in out.read().splitlines() if line.strip()]
            self.history.stacks.append(f"{when}, this process: {' | '.join(lines[-STACK_LINES:])}")
            return
        live = [i for i in range(1 + self.options.rollouts) if self.group.alive(i)]
        for index in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.group.pid(index), STACKS_SIGNAL)
        await asyncio.sleep(1.0)
        from hal.apps.soak.procs import log_tail

        for index in live:
            worker = self.group.workers[index]
            self.history.stacks.append(f"{when}, {self.group.describe(index)}: "
                                       f"{log_tail(worker.log, lines=STACK_LINES, size=32768)}")

    async def run(self) -> None:
        """Start, run every update, close the engines and stop the workers, also after a failure; SIGTERM or SIGHUP
        then raise ``SignalException``."""
        loop, task, got = asyncio.get_running_loop(), asyncio.current_task(), []

        def on_signal(signum: int) -> None:
            got.append(signum)
            task.cancel()

        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await self.start()
            for g in range(1, self.options.updates + 1):
                if not await self.update(g):
                    break
                if self.progress is not None:
                    self.progress(g)
            else:
                await self.job.close()
        except asyncio.CancelledError:
            if not got:
                raise
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"hal soak got {signal.Signals(got[0]).name}", sigval=signal.Signals(got[0])) \
                from None
        finally:
            await self.group.close()
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler)
        if self.sandbox is not None:
            self.history.after_close = {"shm": self.sandbox.shm_segments(), "temp": self.sandbox.temp_entries()}


def model_path(options: SoakOptions, root: str) -> str | None:
    """Write the ``"tensors"`` checkpoint into ``root`` when the run uses it; returns its path (``None``: a preset)."""
    from hal.apps.soak import model

    return model.write(root, options.seed) if options.model == model.NAME else None


def soak(options: SoakOptions, progress: Callable[[int], None] | None = None,
         faults: dict[int, Any] | None = None) -> dict[str, Any]:
    """One soak run; returns its report (:func:`hal.apps.soak.checker.judge`).

    ``progress(g)`` is called as each update ends; ``faults`` (``{update: Fault}``) replaces the seed's plan.
    """
    import ckpt
    import hal

    hal.resolve_device(options.device)
    ok, reason = ckpt.checkpoint_engine_availability(options.engine, options.device)
    if not ok:
        raise ckpt.CheckpointEngineUnavailableError(f"engine {options.engine!r} is unavailable here: {reason}")
    machine = machine_support()
    kinds, skipped = applicable(options.faults, options.engine, machine, options.wire_format)
    began = time.perf_counter()
    in_process = ckpt.checkpoint_engine_says(options.engine, "one_process")
    if in_process:
        from hal.apps.shutdown import scratch_dir

        with scratch_dir("hal-soak-") as root:
            driver = Driver(options, None, kinds, progress, faults, model_path(options, root))
            asyncio.run(driver.run())
    else:
        planned = faults.values() if faults is not None else ()
        links = any(k in kinds for k in ("cut_link", "slow_link")) or any(f.kind.endswith("_link") for f in planned)
        with Sandbox(1 + options.rollouts, mounts=machine["mounts"] is None, links=links) as sandbox:
            driver = Driver(options, sandbox, kinds, progress, faults, model_path(options, sandbox.root))
            asyncio.run(driver.run())
    history = driver.history
    history.skipped = skipped
    history.wall_s = time.perf_counter() - began
    return checker.judge(history, CLEAN_START)


__all__ = ["Driver", "SoakOptions", "soak"]
