"""The Ray launcher: the trainer and the rollouts as Ray actors, placed by the kind's Ray resource.

Each worker is an actor in its own bundle of one placement group, binding the device Ray assigned it. The step
loop runs in the driver over :class:`RayGroup`; a worker Ray reports dead fails the call at once, naming it.
Without ``options.address`` a one-node cluster is started for the run and stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Callable, Sequence

from hal import ray as hal_ray
from hal.apps.weightsync.loop import START_MARGIN_S, Job, JobResult, StepHook
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout
from hal.apps.weightsync.trainer import Trainer
from hal.apps.weightsync.worker import Where, Worker, describe_worker, make_engine

# seconds an interrupted step may take to unwind before the driver stops the actors
CANCEL_S = 10.0


class RayWorker:
    """An actor hosting worker ``index`` (0: the trainer, else rollout rank ``index``) on the device Ray
    assigned it."""

    def __init__(self, options: JobOptions, index: int, adapter_cls: Any = None) -> None:
        self.binding = hal_ray.bind_assigned_device(options.device)  # the driver resolved the kind
        b = self.binding
        where = Where(index, b.node_ip, b.pid, options.device, b.resource or "CPU", b.device_id)
        engine = make_engine(options, index, b.node_ip)
        self.worker = Trainer(options, engine, where) if index == 0 else \
            Rollout(options, engine, index, adapter_cls, where)

    def device_binding(self) -> hal_ray.DeviceBinding:
        """The device this actor bound (node, Ray's ids, visible devices, local index)."""
        return self.binding

    async def invoke(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """The worker's :meth:`~hal.apps.weightsync.worker.Worker.invoke`."""
        return await self.worker.invoke(method, *args, **kwargs)


def died(ray: Any, error: BaseException) -> bool:
    """Whether ``error`` says the actor is gone for good (not a task error, not a transient unavailability)."""
    unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, unavailable)


class RayGroup:
    """A :class:`ckpt.manager.WorkerGroup` of :class:`RayWorker` actors in one placement group; needs a connected
    Ray driver. ``trainer_node``/``rollout_node`` pin node IPs; ``adapters`` maps rollout ranks to adapter classes."""

    def __init__(self, options: JobOptions, strategy: hal_ray.Strategy = "PACK", trainer_node: str | None = None,
                 rollout_node: str | None = None, adapters: dict[int, Any] | None = None) -> None:
        self.ray = hal_ray.require_ray()
        self.options, self.adapters = options, dict(adapters or {})
        self.trainer_world_size, self.rollout_world_size = 1, options.rollouts
        self.whereabouts: list[Where | None] = [None] * (1 + options.rollouts)
        self.placement = hal_ray.place_workers(options.device, options.rollouts, strategy=strategy,
                                               trainer_node=trainer_node, rollout_node=rollout_node,
                                               timeout=min(options.timeout, 120.0))
        self.actors = [self.start_actor(i, self.adapters.get(i)) for i in range(1 + options.rollouts)]

    def start_actor(self, index: int, adapter_cls: Any = None) -> Any:
        actor_cls = self.ray.remote(RayWorker)
        return actor_cls.options(**self.placement.options(index), max_restarts=0,
                                 max_concurrency=4).remote(self.options, index, adapter_cls)

    def submit(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.wrap_future(self.actors[index].invoke.remote(method, *args, **kwargs).future())

    def describe(self, index: int) -> str:
        return describe_worker(index, self.whereabouts[index])

    def is_dead(self, error: BaseException) -> bool:
        return died(self.ray, error)

    def explain(self, error: BaseException) -> str:
        ray = self.ray
        if isinstance(error, ray.exceptions.RayTaskError):
            cause = error.cause if getattr(error, "cause", None) is not None else error
            return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if isinstance(error, ray.exceptions.RayActorError):
            return f"the actor died ({type(error).__name__})"
        return f"{type(error).__name__}: {error}"

    def bindings(self) -> list[hal_ray.DeviceBinding]:
        """Every actor's device binding (trainer first); RayLaunchError when two workers bound one device."""
        found = self.ray.get([a.device_binding.remote() for a in self.actors],
                             timeout=self.options.timeout + START_MARGIN_S)
        hal_ray.check_distinct_devices(found)
        return found

    async def replace(self, index: int) -> None:
        """Kill actor ``index`` (it may be dead already) and start a new one in its bundle."""
        try:
            self.ray.kill(self.actors[index], no_restart=True)
        except Exception:  # noqa: BLE001 - it is already dead
            pass
        self.adapters.pop(index, None)
        self.actors[index] = self.start_actor(index)
        self.whereabouts[index] = await self.submit(index, Worker.where)

    def close(self) -> None:
        """Kill the actors and release the placement group."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.placement.remove()


class RayJob:
    """The job over Ray actors, step by step from synchronous code, on one event loop kept for the job's life."""

    def __init__(self, options: JobOptions, hooks: Sequence[StepHook] = (), **placement: Any) -> None:
        begin = time.perf_counter()
        self.loop = asyncio.new_event_loop()
        self.group = RayGroup(options, **placement)
        try:
            self.job = Job(options, self.group, hooks)
            self.group.whereabouts = self.sync(self.job.start())
            self.bindings = self.group.bindings()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - begin

    def sync(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the job's loop; interrupted or failed, it is cancelled and given :data:`CANCEL_S`
        seconds to unwind."""
        task = self.loop.create_task(coroutine)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(asyncio.wait([task], timeout=CANCEL_S))
            if task.done() and not task.cancelled():
                task.exception()  # seen: or asyncio logs "Task exception was never retrieved" when it is collected
            raise

    @property
    def checksums(self) -> dict[int, dict[str, str]]:
        return self.job.checksums

    def warmup(self) -> dict[str, Any]:
        return self.sync(self.job.warmup())

    def step(self, global_steps: int) -> dict[str, Any]:
        return self.sync(self.job.step(global_steps))

    def call(self, index: int, method: Callable, *args: Any) -> Any:
        """``method`` on worker ``index`` under the job's fault policy; returns its result."""
        return self.sync(self.job.manager.call([index], method, [args]))[0]

    def replace_rollout(self, index: int) -> hal_ray.DeviceBinding:
        """Start a new rollout actor of rank ``index`` in its bundle (after the old one died or was killed)."""
        self.sync(self.job.replace_rollout(index))
        self.bindings = self.group.bindings()
        return self.bindings[index]

    def close(self) -> None:
        """Kill the actors, release the placement group, close the event loop."""
        if hasattr(self, "group"):
            self.group.close()
        self.loop.close()

    def __enter__(self) -> RayJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(options: JobOptions) -> tuple[Any, hal_ray.LocalCluster | None]:
    """Connect to ``options.address`` or start a one-node cluster; returns ``(ray context, the cluster or None)``.
    RayLaunchError when the cluster does not answer or start."""
    if options.address:
        return hal_ray.connect_cluster(options.address, log_to_driver=False), None
    resource = hal_ray.resource_name(options.device)
    workers = 1 + options.rollouts
    cluster = hal_ray.LocalCluster(num_cpus=workers, resources={resource: workers} if resource else {})
    cluster.start()
    try:
        return cluster.connect(), cluster
    except BaseException:
        cluster.stop()
        raise


def launch(options: JobOptions, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Run the job with Ray actors; ``extra`` has the workers' bindings and the start-up seconds."""
    ray = hal_ray.require_ray()
    begin = time.perf_counter()
    _, cluster = connect(options)
    try:
        cluster_s = time.perf_counter() - begin
        with RayJob(options, hooks, strategy=options.placement) as job:
            result = job.sync(job.job.run_steps())
            workers = [dataclasses.asdict(b) for b in job.bindings]
            actors_s = job.start_seconds
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.stop()
    result.extra = {"workers": workers, "startup": {"cluster_s": cluster_s if cluster else 0.0, "actors_s": actors_s}}
    return result


__all__ = ["RayGroup", "RayJob", "RayWorker", "connect", "died", "launch"]
