"""``hal sync --launcher ray``: the trainer and the rollouts as Ray actors, placed by the kind's Ray resource.

One trainer actor and ``--rollouts`` rollout actors, each in its own bundle of one placement group
(:func:`hal.ray.place_workers`), each binding the device Ray assigned to it (:func:`hal.ray.bind_assigned_device`).
The step code is :mod:`hal.cli.sync`'s (``_Trainer``, ``checksums``, ``verify``); what differs is who starts
the processes and who drives the checkpoint engine. The driver here drives it as verl's
``CheckpointEngineManager`` does, every update:

1. ``prepare()`` on every worker, gathering their metadata (the trainer hosts the rendezvous store);
2. the engine class's ``build_topology(1, R, metadata)``: per-rank keyword lists;
3. ``init_process_group(**one rank's entries)`` on every worker (the communicator is kept while the
   topology is unchanged);
4. the trainer's ``send_weights`` and every rollout's ``receive_weights`` concurrently;
5. ``finalize()`` on every worker.

A rollout that dies during an update fails that update with :class:`SyncUpdateError` naming the rollout
(within the engine's timeout); the other rollouts keep serving their previous step, and
:meth:`RaySync.replace_rollout` starts a new actor in the dead one's bundle for the next update.

Without ``--address`` a one-node cluster is started for the run (:class:`hal.ray.LocalCluster`, declaring
one device of the kind per worker), and stopped at the end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import hal
from hal import ray as hal_ray
from hal.cli.sync import Sync, _progress, _Trainer, verify


class SyncUpdateError(hal.HalError, RuntimeError):
    """An update did not reach every rollout: names each failed worker (rank, actor, node) and why."""


def _engine(args: Sync, is_master: bool, master_addr: str | None = None):
    import ckpt

    return ckpt.get_checkpoint_engine("collective", bucket_size=int(args.bucket_mb * (1 << 20)), is_master=is_master,
                                      master_addr=master_addr, device=hal.resolve_device(args.device).kind,
                                      timeout=args.timeout)


class _Worker:
    """What both actors share: the bound device and the checkpoint engine's lifecycle calls."""

    binding: hal_ray.DeviceBinding
    engine: Any

    def where(self) -> hal_ray.DeviceBinding:
        """The device this actor bound (node, Ray's ids, visible devices, local index)."""
        return self.binding

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Call one of the engine's synchronous lifecycle methods (verl's worker method of the same name)."""
        if method not in ("prepare", "init_process_group", "finalize", "close"):
            raise ValueError(f"method must be a lifecycle method of the checkpoint engine, got {method!r}")
        return getattr(self.engine, method)(**kwargs)


class TrainerActor(_Worker):
    """Rank 0: :class:`hal.cli.sync._Trainer` (TorchEngine + AdamW) and the sending checkpoint engine.

    Args:
        args: :class:`Sync` as a dict.
    """

    def __init__(self, args: dict[str, Any]) -> None:
        import ckpt

        self.args = Sync(**args)
        self.binding = hal_ray.bind_assigned_device(self.args.device)  # the driver resolved the kind
        self.trainer = _Trainer(self.args)
        self.engine = _engine(self.args, is_master=True, master_addr=self.binding.node_ip)
        self.publisher = ckpt.TrainerWorker(self.trainer.engine, self.engine)

    def train_step(self) -> tuple[dict[str, Any], dict[str, str], int]:
        """One optimizer step and offload; returns ``(row, {name: checksum}, bytes)`` of the weights to send."""
        row = self.trainer.step()
        sums, nbytes = self.trainer.sums()
        hal.synchronize(self.trainer.kind)
        return row, sums, nbytes

    async def update_weights(self, global_steps: int) -> float:
        """Send the weights as ``global_steps``; returns the seconds until every broadcast completed."""
        start = time.perf_counter()
        await self.publisher.update_weights(global_steps)
        return time.perf_counter() - start

    def finish(self, row: dict[str, Any]) -> dict[str, Any]:
        """Onload what the step offloaded; adds onload time and peak memory to ``row``."""
        return self.trainer.finish(row)


class RolloutActor(_Worker):
    """A rollout rank: the receiving checkpoint engine and a server adapter applying updates all-or-nothing.

    Args:
        args: :class:`Sync` as a dict.
        rank: this rollout's rank (1..R), for reports.
        adapter: a factory of the rollout server adapter (``async update_weights(weights, global_steps)``
            and ``served_step``/``state_dict()``); default :class:`ckpt.InMemoryRolloutAdapter`.
    """

    def __init__(self, args: dict[str, Any], rank: int, adapter: Callable[[], Any] | None = None) -> None:
        import ckpt

        self.args = Sync(**args)
        self.rank = rank
        self.binding = hal_ray.bind_assigned_device(self.args.device)  # the driver resolved the kind
        self.engine = _engine(self.args, is_master=False)
        self.adapter = adapter() if adapter is not None else ckpt.InMemoryRolloutAdapter()
        self.worker = ckpt.CheckpointEngineWorker(self.engine, self.adapter)

    async def update_weights(self, global_steps: int, expected: dict[str, str]) -> dict[str, Any]:
        """Receive ``global_steps`` and check it byte for byte against the trainer's ``expected`` checksums.

        Returns:
            ``{"rank", "served_step", "error", "receive_s", "node_ip", "device_id"}``; ``error`` is ``None``
            when the rollout serves the step byte-exact, else the first difference or the transfer's error.
        """
        result: dict[str, Any] = {"rank": self.rank, "served_step": None, "error": None,
                                  "node_ip": self.binding.node_ip, "device_id": self.binding.device_id}
        start = time.perf_counter()
        try:
            await self.worker.update_weights(global_steps)
            result["receive_s"] = time.perf_counter() - start
            result["error"] = verify(self.adapter, global_steps, expected)
        except hal.HalError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["served_step"] = self.adapter.served_step
        return result

    def verify(self, global_steps: int, expected: dict[str, str]) -> str | None:
        """What is wrong with the weights in service against step ``global_steps``'s checksums (``None``: exact)."""
        return verify(self.adapter, global_steps, expected)


def _actor_error(exc: BaseException) -> str:
    ray = hal_ray.require_ray()
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"the actor died ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


class RaySync:
    """One trainer actor and R rollout actors in a placement group, driven through verl's update lifecycle.

    Args:
        args: the ``hal sync`` arguments (``engine`` must be ``collective``).
        strategy: placement strategy of the bundles (``PACK``, ``SPREAD``, ...).
        trainer_node, rollout_node: node IPs the trainer / the rollouts must run on (``None``: anywhere).
        adapters: ``{rollout rank: adapter factory}`` for rollouts whose server adapter is not the default.

    Needs a connected Ray driver (``ray.init``). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, args: Sync, strategy: hal_ray.Strategy = "PACK", trainer_node: str | None = None,
                 rollout_node: str | None = None, adapters: dict[int, Callable[[], Any]] | None = None) -> None:
        from ckpt.collective import CollectiveCheckpointEngine

        self.ray = hal_ray.require_ray()
        self.args = args
        self.kind = hal.resolve_device(args.device).kind
        self.args_dict = dataclasses.asdict(dataclasses.replace(args, device=self.kind))
        self.engine_cls = CollectiveCheckpointEngine  # build_topology is a classmethod: the driver runs it
        self.adapters = dict(adapters or {})
        self.timeout = args.timeout
        self.checksums: dict[int, dict[str, str]] = {}
        """``{global_steps: {name: checksum}}`` of the last update every rollout received."""
        begin = time.perf_counter()
        self.placement = hal_ray.place_workers(self.kind, args.rollouts, strategy=strategy,
                                               trainer_node=trainer_node, rollout_node=rollout_node,
                                               timeout=min(args.timeout, 120.0))
        try:
            self.trainer = self._remote(TrainerActor, 0, self.args_dict)
            self.rollouts = [self._remote(RolloutActor, rank, self.args_dict, rank, self.adapters.get(rank))
                             for rank in range(1, args.rollouts + 1)]
            self.bindings = self._get([w.where.remote() for w in self.workers], "start")
            hal_ray.check_distinct_devices(self.bindings)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - begin

    @property
    def workers(self) -> list:
        return [self.trainer, *self.rollouts]

    def _remote(self, cls, bundle_index: int, *init_args):
        actor_cls = self.ray.remote(cls)
        return actor_cls.options(**self.placement.options(bundle_index),
                                 max_restarts=0, max_concurrency=4).remote(*init_args)

    def _get(self, refs: list, what: str, workers: list[int] | None = None) -> list:
        """Results of ``refs`` (the calls of worker indices ``workers``, default 0, 1, ...), else
        :class:`SyncUpdateError` naming each worker that failed, died or did not answer in time."""
        return self._settle(refs, what, workers)

    def _name(self, index: int) -> str:
        b = self.bindings[index] if index < len(getattr(self, "bindings", [])) else None
        role = "trainer" if index == 0 else f"rollout rank {index}"
        where = f" on node {b.node_ip}, {b.resource or 'CPU'} {b.device_id}, pid {b.pid}" if b else ""
        return f"{role}{where}"

    def build_process_group(self) -> None:
        """prepare() on every worker, build_topology from their metadata, init_process_group per rank."""
        metadata = self._get([w.execute_checkpoint_engine.remote("prepare") for w in self.workers], "prepare")
        trainer_kwargs, rollout_kwargs = self.engine_cls.build_topology(1, len(self.rollouts), metadata)
        for side, kwargs, n in (("trainer", trainer_kwargs, 1), ("rollout", rollout_kwargs, len(self.rollouts))):
            for key, values in kwargs.items():
                if len(values) != n:
                    raise SyncUpdateError(f"{self.engine_cls.__name__}.build_topology gave {side} key {key!r} "
                                          f"{len(values)} entries for {n} ranks")
        refs = [self.trainer.execute_checkpoint_engine.remote(
            "init_process_group", **{k: v[0] for k, v in trainer_kwargs.items()})]
        refs += [r.execute_checkpoint_engine.remote("init_process_group", **{k: v[i] for k, v in rollout_kwargs.items()})
                 for i, r in enumerate(self.rollouts)]
        self._settle(refs, "init_process_group")

    def _settle(self, refs: list, what: str, workers: list[int] | None = None) -> list:
        """Wait for every ref (at most the engine's timeout plus a margin); raise naming each failed worker."""
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout + 30.0)
        results, failures = [], []
        for index, ref in zip(workers or range(len(refs)), refs):
            if ref not in ready:
                failures.append(f"{self._name(index)}: no answer within {self.timeout + 30.0:g} s")
                results.append(None)
                continue
            try:
                results.append(self.ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - every worker's failure is reported, by name
                failures.append(f"{self._name(index)}: {_actor_error(exc)}")
                results.append(None)
        if failures:
            raise SyncUpdateError(f"{what} failed: " + "; ".join(failures))
        return results

    def update_weights(self, global_steps: int, expected: dict[str, str]) -> tuple[float, list[dict[str, Any]]]:
        """One update as verl's manager runs it; returns ``(trainer's publish seconds, per-rollout results)``.

        Raises:
            SyncUpdateError: a worker died or raised; names each (rank, node, device) and the error. The
                surviving workers' engines are finalized so the next update can form a new group.
        """
        try:
            self.build_process_group()
            refs = [self.trainer.update_weights.remote(global_steps)]
            refs += [r.update_weights.remote(global_steps, expected) for r in self.rollouts]
            results = self._settle(refs, f"update to global_steps {global_steps}")
        finally:
            self._finalize()
        return results[0], results[1:]

    def _finalize(self) -> None:
        refs = [w.execute_checkpoint_engine.remote("finalize") for w in self.workers]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead worker has nothing to finalize
                pass

    def step(self, global_steps: int) -> dict[str, Any]:
        """Train one step, publish it as ``global_steps``, verify every rollout, onload; returns the step's row."""
        row, sums, nbytes = self._get([self.trainer.train_step.remote()], "train")[0]
        row["global_steps"] = global_steps
        try:
            publish_s, results = self.update_weights(global_steps, sums)
        except SyncUpdateError:
            try:  # onload, so the trainer stays usable for the next step
                self._get([self.trainer.finish.remote(row)], "onload")
            except SyncUpdateError:
                pass  # the trainer itself failed: the update's error says so
            raise
        self.checksums = {global_steps: sums}
        row.update(publish_s=publish_s, bytes=nbytes, tensors=len(sums), rollouts=results)
        return self._get([self.trainer.finish.remote(row)], "onload")[0]

    def replace_rollout(self, rank: int, adapter: Callable[[], Any] | None = None) -> hal_ray.DeviceBinding:
        """Start a new rollout actor of rank ``rank`` in its bundle (after the old one died or was killed)."""
        if not 1 <= rank <= len(self.rollouts):
            raise ValueError(f"rank must be in [1, {len(self.rollouts)}], got {rank}")
        try:
            self.ray.kill(self.rollouts[rank - 1], no_restart=True)
        except Exception:  # noqa: BLE001 - it is already dead
            pass
        self.rollouts[rank - 1] = self._remote(RolloutActor, rank, self.args_dict, rank, adapter)
        self.bindings[rank] = self._get([self.rollouts[rank - 1].where.remote()], "start", [rank])[0]
        hal_ray.check_distinct_devices(self.bindings)
        return self.bindings[rank]

    def close(self) -> None:
        """Close the engines, kill the actors and release the placement group."""
        for actor in getattr(self, "rollouts", []) + ([self.trainer] if hasattr(self, "trainer") else []):
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.placement.remove()

    def __enter__(self) -> "RaySync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(args: Sync) -> tuple[Any, hal_ray.LocalCluster | None]:
    """Connect to ``--address`` (``auto`` or ``HOST:PORT``), or start a one-node cluster for the run.

    Returns:
        ``(ray context, the cluster started here or None)``.
    """
    ray = hal_ray.require_ray()
    if args.address:
        return ray.init(address=args.address, log_to_driver=False), None
    kind = hal.resolve_device(args.device).kind
    resource = hal_ray.resource_name(kind)
    workers = 1 + args.rollouts
    cluster = hal_ray.LocalCluster(num_cpus=workers, resources={resource: workers} if resource else {})
    cluster.start()
    try:
        return cluster.connect(), cluster
    except BaseException:
        cluster.stop()
        raise


def execute_ray(args: Sync) -> dict[str, Any]:
    """Run ``hal sync`` with Ray actors; returns what :func:`hal.cli.sync.execute` returns, plus the
    workers' bindings (``"workers"``) and the cluster/actor start-up seconds (``"startup"``)."""
    ray = hal_ray.require_ray()
    begin = time.perf_counter()
    _, cluster = connect(args)
    try:
        cluster_s = time.perf_counter() - begin
        with RaySync(args, strategy=args.placement) as run:
            rows = []
            with _progress() as progress:
                task = progress.add_task("sync (ray)", total=args.steps)
                for step in range(1, args.steps + 1):
                    rows.append(run.step(step))
                    progress.advance(task)
            workers = [dataclasses.asdict(b) for b in run.bindings]
            actors_s = run.start_seconds
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.stop()
    return {"rows": rows, "workers": workers, "startup": {"cluster_s": cluster_s if cluster else 0.0,
                                                          "actors_s": actors_s}}


__all__ = ["SyncUpdateError", "TrainerActor", "RolloutActor", "RaySync", "connect", "execute_ray"]
