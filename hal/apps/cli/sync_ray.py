"""``hal sync --launcher ray``: the trainer and the rollouts as Ray actors, placed by the kind's Ray resource.

One trainer actor and ``--rollouts`` rollout actors, each in its own bundle of one placement group
(:func:`hal.ray.place_workers`), each binding the device Ray assigned to it (:func:`hal.ray.bind_assigned_device`).
The job is :mod:`hal.apps.cli.sync`'s, step for step: the trainer is its ``_Trainer`` (fp32 masters, AdamW,
publishes bf16 for presets), every rollout its ``_Rollout`` (a served model loading updates in place through
``ckpt.ModelRolloutAdapter``, verified by greedy decode and CRC-32 against the trainer's bf16 model), and
a raw broadcast of the same bytes is the reference of the step's throughput; rows and ``--json`` fields are
the same. What differs is who starts the processes and who drives the checkpoint engine. The driver here
drives it as verl's ``CheckpointEngineManager`` does, every update:

1. ``prepare()`` on every worker, gathering their metadata (the trainer hosts the rendezvous store);
2. the engine class's ``build_topology(1, R, metadata)``: per-rank keyword lists;
3. ``init_process_group(**one rank's entries)`` on every worker (the communicator is kept while the
   topology is unchanged);
4. the trainer's ``send_weights`` and every rollout's ``receive_weights`` concurrently;
5. ``finalize()`` on every worker.

Every remote phase (start, prepare, init_process_group, the update, verify, the raw reference and its
group, the trainer's own calls) is awaited by one helper, :meth:`RaySync._settle`: a worker that dies or
raises fails the step with :class:`SyncUpdateError` naming it (role, rank, node, device) as soon as Ray
reports it, not when the engine's timeout has passed. The other workers keep what they served; their part of
a broken collective ends (an error, at most the engine's timeout) before the next step starts, and
:meth:`RaySync.replace_rollout` starts a new actor in a dead one's bundle for the next update.

Without ``--address`` a one-node cluster is started for the run (:class:`hal.ray.LocalCluster`, declaring
one device of the kind per worker), and stopped at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import hal
from hal import ray as hal_ray
from hal.apps.cli.sync import Sync, _bucket_bytes, _progress, _raw_broadcast, _Rollout, _Trainer, verify


ERROR_GRACE_S = 5.0
"""Seconds a phase whose worker raised still waits for the others (at most): a peer's death makes its partners
raise (connection reset) before Ray reports the death itself, and the error should name the dead one."""


class SyncUpdateError(hal.HalError, RuntimeError):
    """An update did not reach every rollout: names each failed worker (rank, actor, node) and why."""


def _engine(args: Sync, is_master: bool, master_addr: str | None = None):
    import ckpt

    return ckpt.get_checkpoint_engine("collective", bucket_size=_bucket_bytes(args), is_master=is_master,
                                      master_addr=master_addr, device=hal.resolve_device(args.device).kind,
                                      timeout=args.timeout)


class _Worker:
    """What both actors share: the bound device, the checkpoint engine's lifecycle calls, the raw group."""

    binding: hal_ray.DeviceBinding
    engine: Any
    args: Sync
    raw_group: Any = None
    raw_store: Any = None

    def where(self) -> hal_ray.DeviceBinding:
        """The device this actor bound (node, Ray's ids, visible devices, local index)."""
        return self.binding

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Call one of the engine's synchronous lifecycle methods (verl's worker method of the same name)."""
        if method not in ("prepare", "init_process_group", "finalize", "close"):
            raise ValueError(f"method must be a lifecycle method of the checkpoint engine, got {method!r}")
        return getattr(self.engine, method)(**kwargs)

    def join_raw_group(self, addr: str, port: int, rank: int, world_size: int, generation: int) -> None:
        """Be rank ``rank`` of generation ``generation`` of the raw-broadcast group (a group of the engine's
        backend beside the engine's own), over the trainer's store at ``addr:port``; blocks until every
        member joined, at most ``--timeout`` seconds (then :class:`hal.DistributedTimeoutError`)."""
        if self.raw_group is not None:
            self.raw_group.close()
            self.raw_group = None
        if self.raw_store is None:
            self.raw_store = hal.connect_store(addr, port, rank, world_size, self.args.timeout)
        kind = hal.resolve_device(self.args.device).kind
        self.raw_group = hal.new_group_from_store(self.raw_store, rank, world_size, kind, self.args.timeout,
                                                  f"raw/{generation}")


class TrainerActor(_Worker):
    """Rank 0: :class:`hal.apps.cli.sync._Trainer` (TorchEngine + AdamW) and the sending checkpoint engine.

    Args:
        args: :class:`Sync` as a dict.
    """

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = Sync(**args)
        self.binding = hal_ray.bind_assigned_device(self.args.device)  # the driver resolved the kind
        self.trainer = _Trainer(self.args)
        self.engine = _engine(self.args, is_master=True, master_addr=self.binding.node_ip)

    def host_raw_store(self) -> tuple[str, int]:
        """Host the raw group's rendezvous store (once) on this node; returns ``(address, port)``."""
        if self.raw_store is None:
            self.raw_store = hal.connect_store(self.binding.node_ip, 0, 0, 1, self.args.timeout)
        return self.binding.node_ip, int(self.raw_store.port)

    def train(self, global_steps: int) -> dict[str, Any]:
        """One optimizer step, offload and cast into the published buffer; returns the step's row."""
        return self.trainer.begin(global_steps)

    def stage(self) -> None:
        """Cast the current (initial) weights into the published buffer, without a training step (step 0)."""
        self.trainer.stage()

    def release(self) -> None:
        """Drop the published buffer (after step 0)."""
        self.trainer.release()

    async def publish(self, global_steps: int, reference: bool = True) -> dict[str, Any]:
        """Send the published buffer as ``global_steps``, then (``reference``) compute the checksums and the
        decode of the trainer's bf16 model the rollouts are checked against.

        Returns:
            ``{"t0": send start (time.time()), "send_s", "sums": {name: crc} | None, "reference": None |
            {"tokens", "logits": (n, vocab) float32}}``.
        """
        t0 = await self.trainer.publish(self.engine, global_steps)
        send_s = time.time() - t0
        sums, ref = self.trainer.reference() if reference else (None, None)
        return {"t0": t0, "send_s": send_s, "sums": sums, "reference": ref}

    async def raw_broadcast(self) -> tuple[float, float]:
        """The raw reference: one broadcast of the published buffer; returns its wall-clock start and end."""
        start = time.time()
        await asyncio.to_thread(_raw_broadcast, self.raw_group, self.trainer.bank)
        return start, time.time()

    def conclude(self, row: dict[str, Any], publish_s: float, raw_s: tuple[float, float],
                 rollouts: list[dict[str, Any]]) -> dict[str, Any]:
        """Figures, onload and memory of the step (:meth:`hal.apps.cli.sync._Trainer.conclude`); returns the row."""
        return self.trainer.conclude(row, publish_s, raw_s, rollouts)

    def abandon(self) -> None:
        """After a failed update: drop the published buffer, onload what the step offloaded."""
        self.trainer.abandon()


class RolloutActor(_Worker):
    """A rollout rank: the receiving checkpoint engine and :class:`hal.apps.cli.sync._Rollout` (its served model).

    Args:
        args: :class:`Sync` as a dict.
        rank: this rollout's rank (1..R), for reports.
        adapter: the server adapter's class, called ``adapter(module, atomic=...)``; default
            :class:`ckpt.ModelRolloutAdapter`.
    """

    def __init__(self, args: dict[str, Any], rank: int, adapter: Any = None) -> None:
        self.args = Sync(**args)
        self.binding = hal_ray.bind_assigned_device(self.args.device)  # the driver resolved the kind
        self.engine = _engine(self.args, is_master=False)
        self.rollout = _Rollout(self.args, self.engine, rank, adapter)

    async def update_weights(self, global_steps: int) -> tuple[dict[str, Any], float, float]:
        """Receive and apply ``global_steps``; returns ``(result, started_at, applied_at)`` (wall-clock
        seconds; see ``_Rollout.receive``), the result naming this actor's node and device."""
        started_at = time.time()
        result, applied_at = await self.rollout.receive(global_steps)
        result.update(node_ip=self.binding.node_ip, device_id=self.binding.device_id)
        return result, started_at, applied_at

    def check(self, global_steps: int, result: dict[str, Any], published: dict[str, Any]) -> dict[str, Any]:
        """Verify what this rollout serves against the trainer's ``published`` checksums and decode."""
        return self.rollout.check(global_steps, result, published["sums"], published["reference"])

    async def raw_broadcast(self) -> tuple[float, float]:
        """Receive the raw reference broadcast (into the staging bank); returns its wall-clock start and end."""
        start = time.time()
        await asyncio.to_thread(_raw_broadcast, self.raw_group, self.rollout.raw_target())
        return start, time.time()

    def verify(self, global_steps: int, expected: dict[str, str]) -> str | None:
        """What is wrong with the weights in service against step ``global_steps``'s checksums (``None``: exact)."""
        return verify(self.rollout.adapter, global_steps, expected)


def _actor_error(exc: BaseException) -> str:
    ray = hal_ray.require_ray()
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"the actor died ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def _died(ray, exc: BaseException) -> bool:
    """Whether ``exc`` says the actor is gone for good (not a task error, not a transient unavailability)."""
    unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
    return isinstance(exc, ray.exceptions.RayActorError) and not isinstance(exc, unavailable)


class RaySync:
    """One trainer actor and R rollout actors in a placement group, driven through verl's update lifecycle.

    Args:
        args: the ``hal sync`` arguments (``engine`` must be ``collective``).
        strategy: placement strategy of the bundles (``PACK``, ``SPREAD``, ...).
        trainer_node, rollout_node: node IPs the trainer / the rollouts must run on (``None``: anywhere).
        adapters: ``{rollout rank: adapter class}`` for rollouts whose server adapter is not
            :class:`ckpt.ModelRolloutAdapter` (called ``cls(module, atomic=...)``).

    Needs a connected Ray driver (``ray.init``). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, args: Sync, strategy: hal_ray.Strategy = "PACK", trainer_node: str | None = None,
                 rollout_node: str | None = None, adapters: dict[int, Any] | None = None) -> None:
        from ckpt.collective import CollectiveCheckpointEngine

        self.ray = hal_ray.require_ray()
        self.args = args
        self.kind = hal.resolve_device(args.device).kind
        self.args_dict = dataclasses.asdict(dataclasses.replace(args, device=self.kind))
        self.engine_cls = CollectiveCheckpointEngine  # build_topology is a classmethod: the driver runs it
        self.adapters = dict(adapters or {})
        self.timeout = args.timeout
        self.start_timeout = max(args.timeout, 120.0) + 30.0
        """Seconds an actor may take to start (import torch and transformers, build its model)."""
        self.checksums: dict[int, dict[str, str]] = {}
        """``{global_steps: {name: checksum}}`` of the last update every rollout received."""
        self._unsettled: dict[int, Any] = {}  # worker index -> its call still in a failed update
        self._raw_generation = 0  # of the raw group every live worker is in (0: none yet)
        self._raw_wanted = 1
        self._abandoned = False  # a failed update's published buffer is still to be dropped
        begin = time.perf_counter()
        self.placement = hal_ray.place_workers(self.kind, args.rollouts, strategy=strategy,
                                               trainer_node=trainer_node, rollout_node=rollout_node,
                                               timeout=min(args.timeout, 120.0))
        try:
            self.trainer = self._remote(TrainerActor, 0, self.args_dict)
            self.rollouts = [self._remote(RolloutActor, rank, self.args_dict, rank, self.adapters.get(rank))
                             for rank in range(1, args.rollouts + 1)]
            self.bindings = self._settle([w.where.remote() for w in self.workers], "start", limit=self.start_timeout)
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

    def _name(self, index: int) -> str:
        b = self.bindings[index] if index < len(getattr(self, "bindings", [])) else None
        role = "trainer" if index == 0 else f"rollout rank {index}"
        where = f" on node {b.node_ip}, {b.resource or 'CPU'} {b.device_id}, pid {b.pid}" if b else ""
        return f"{role}{where}"

    def build_process_group(self) -> None:
        """prepare() on every worker, build_topology from their metadata, init_process_group per rank."""
        metadata = self._settle([w.execute_checkpoint_engine.remote("prepare") for w in self.workers], "prepare")
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

    def _settle(self, refs: list, what: str, workers: list[int] | None = None, limit: float | None = None) -> list:
        """Results of ``refs``, the calls of phase ``what`` on worker indices ``workers`` (default 0, 1, ...),
        waiting at most ``limit`` seconds (default the engine's timeout plus a margin).

        The first failure ends the wait: a worker Ray reports dead at once, a worker that raised after at most
        :data:`ERROR_GRACE_S` more (so a death that made it raise is reported too); every worker whose call
        ended in failure by then is named. The calls still running (the other ranks of a broken collective,
        which end within their own timeout) are kept in ``self._unsettled`` and settled before the next step
        (:meth:`_settle_leftovers`).

        Raises:
            SyncUpdateError: names each worker that failed, died or did not answer within ``limit``.
        """
        indices = list(workers) if workers is not None else list(range(len(refs)))
        limit = self.timeout + 30.0 if limit is None else limit
        deadline = time.monotonic() + limit
        outcome: dict[int, tuple[bool, Any]] = {}
        pending, by_ref = list(refs), dict(zip(refs, indices))
        failed_by: float | None = None  # after a failure: when the wait ends at the latest (its grace)
        dead = False
        while pending and not dead:
            until = deadline if failed_by is None else min(deadline, failed_by)
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break  # the deadline, or the grace after an error, passed
            if pending:  # collect whatever else already ended, so every failure that is known is named
                more, pending = self.ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            for ref in ready:
                try:
                    outcome[by_ref[ref]] = (True, self.ray.get(ref))
                except Exception as exc:  # noqa: BLE001 - every worker's failure is reported, by name
                    outcome[by_ref[ref]] = (False, exc)
                    dead = dead or _died(self.ray, exc)
                    if failed_by is None:
                        failed_by = time.monotonic() + ERROR_GRACE_S
        results, failures = [], []
        for index, ref in zip(indices, refs):
            if index not in outcome:
                results.append(None)
                if failed_by is not None:
                    self._unsettled[index] = ref
                else:
                    failures.append(f"{self._name(index)}: no answer within {limit:g} s")
                continue
            ok, value = outcome[index]
            results.append(value if ok else None)
            if not ok:
                failures.append(f"{self._name(index)}: {_actor_error(value)}")
        if failures:
            raise SyncUpdateError(f"{what} failed: " + "; ".join(failures))
        return results

    def _settle_leftovers(self) -> None:
        """Wait for the calls a failed phase left running (each ends within its own timeout: a peer failed),
        finalizing each worker as its call ends, so a broken engine group is released (its peers' transfers
        then fail at once) and the next update forms a new one; then onload the trainer if a failed step
        left that to do."""
        pending = {ref: index for index, ref in self._unsettled.items()}
        self._unsettled = {}
        deadline = time.monotonic() + self.timeout + 30.0
        while pending and time.monotonic() < deadline:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                self._finalize([pending.pop(ref)])
        if self._abandoned:  # the trainer's part ended: drop its published buffer, onload
            self._abandoned = False
            self._settle([self.trainer.abandon.remote()], "onload")

    def update_weights(self, global_steps: int, reference: bool = True
                       ) -> tuple[dict[str, Any], list[tuple[dict[str, Any], float, float]]]:
        """One update as verl's manager runs it; returns the trainer's :meth:`TrainerActor.publish` result
        and every rollout's ``(result, started_at, applied_at)``.

        Raises:
            SyncUpdateError: a worker died or raised; names each (rank, node, device) and the error, as soon
                as Ray reports it. The workers that ended their part are finalized now, the others once their
                part ended, so the next update can form a new group.
        """
        settled = list(range(len(self.workers)))
        try:
            self.build_process_group()
            refs = [self.trainer.publish.remote(global_steps, reference)]
            refs += [r.update_weights.remote(global_steps) for r in self.rollouts]
            results = self._settle(refs, f"update to global_steps {global_steps}")
        finally:
            self._finalize([i for i in settled if i not in self._unsettled])
        return results[0], results[1:]

    def _finalize(self, indices: list[int]) -> None:
        refs = [self.workers[i].execute_checkpoint_engine.remote("finalize") for i in indices]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead worker has nothing to finalize
                pass

    def _ensure_raw_group(self) -> None:
        """Form the raw-broadcast group (again, after a rollout was replaced) on every worker."""
        if self._raw_generation == self._raw_wanted:
            return
        addr, port = self._settle([self.trainer.host_raw_store.remote()], "raw group")[0]
        world = len(self.workers)
        try:
            self._settle([w.join_raw_group.remote(addr, port, rank, world, self._raw_wanted)
                          for rank, w in enumerate(self.workers)], "raw group")
        except SyncUpdateError:
            self._raw_broken()
            raise
        self._raw_generation = self._raw_wanted

    def _raw_broken(self) -> None:
        """The raw group failed (a member died or timed out): the next step forms a new generation."""
        self._raw_wanted = max(self._raw_wanted, self._raw_generation) + 1

    def _raw_seconds(self) -> float:
        """One raw broadcast of the published bytes to every rollout: seconds from when every worker was in
        it (Ray delivers the calls at different moments; under torchrun every rank waits in it already)
        until the last rollout has the bytes."""
        try:
            spans = self._settle([w.raw_broadcast.remote() for w in self.workers], "raw broadcast")
        except SyncUpdateError:
            self._raw_broken()
            raise
        return max(end for _, end in spans[1:]) - max(start for start, _ in spans)

    @staticmethod
    def _publish_seconds(published: dict[str, Any], received: list[tuple[dict[str, Any], float, float]]) -> float:
        """Seconds from when the trainer and every rollout were in the update until the last rollout applied
        it (under torchrun the rollouts already wait in their receive when the trainer sends; Ray delivers
        the calls at different moments)."""
        begun = max(published["t0"], *(started_at for _, started_at, _ in received))
        return max(applied_at for _, _, applied_at in received) - begun

    def warmup(self) -> dict[str, Any]:
        """Step 0, untimed, as under torchrun: the rollouts load the trainer's initial weights (as an RL job
        syncs its rollouts before their first generation) and the raw reference runs once, so every
        one-time cost (first transfer on each group's connections, first-touched buffers) is paid here.

        Returns:
            ``{"publish_s", "errors": [one sentence per rollout that failed], "raw_s", "wall_s"}``.
        """
        start = time.perf_counter()
        self._settle_leftovers()
        self._ensure_raw_group()
        self._settle([self.trainer.stage.remote()], "stage")
        try:
            published, received = self.update_weights(0, reference=False)
            out = {"publish_s": self._publish_seconds(published, received),
                   "errors": [f"rollout rank {r['rank']}: {r['error']}" for r, _, _ in received if r["error"]]}
            out["raw_s"] = self._raw_seconds()
        except SyncUpdateError:
            self._abandon()
            raise
        self._settle([self.trainer.release.remote()], "release")
        out["wall_s"] = time.perf_counter() - start
        return out

    def step(self, global_steps: int) -> dict[str, Any]:
        """Train one step, publish it as ``global_steps``, verify every rollout, time the raw broadcast of the
        same bytes (just before the publish and after the verification), onload; returns the step's row (the
        fields of :func:`hal.apps.cli.sync.execute`'s rows)."""
        self._settle_leftovers()
        self._ensure_raw_group()
        row = self._settle([self.trainer.train.remote(global_steps)], "train")[0]
        try:
            raw_before = self._raw_seconds()  # the raw reference just before the publish and again after it
            published, received = self.update_weights(global_steps)
            row["send_s"] = published["send_s"]
            publish_s = self._publish_seconds(published, received)
            if published["reference"] is not None:
                row["tokens"] = published["reference"]["tokens"]
            shared = self.ray.put(published)
            results = self._settle([r.check.remote(global_steps, result, shared) for r, (result, _, _) in
                                    zip(self.rollouts, received)], "verify", list(range(1, len(self.workers))))
            raw_after = self._raw_seconds()
        except SyncUpdateError:
            self._abandon()
            raise
        row = self._settle([self.trainer.conclude.remote(row, publish_s, (raw_before, raw_after), results)],
                           "onload")[0]
        self.checksums = {global_steps: published["sums"]}
        return row

    def _abandon(self) -> None:
        """After a failed step: the trainer drops its published buffer and onloads, so it stays usable for
        the next step; now, or once its own call of the failed phase ended (:meth:`_settle_leftovers`)."""
        if 0 in self._unsettled:
            self._abandoned = True
            return
        try:
            self._settle([self.trainer.abandon.remote()], "onload")
        except SyncUpdateError:
            pass  # the trainer itself failed: the step's error says so

    def replace_rollout(self, rank: int, adapter: Any = None) -> hal_ray.DeviceBinding:
        """Start a new rollout actor of rank ``rank`` in its bundle (after the old one died or was killed)."""
        if not 1 <= rank <= len(self.rollouts):
            raise ValueError(f"rank must be in [1, {len(self.rollouts)}], got {rank}")
        self._unsettled.pop(rank, None)
        try:
            self.ray.kill(self.rollouts[rank - 1], no_restart=True)
        except Exception:  # noqa: BLE001 - it is already dead
            pass
        self.rollouts[rank - 1] = self._remote(RolloutActor, rank, self.args_dict, rank, adapter)
        self.bindings[rank] = self._settle([self.rollouts[rank - 1].where.remote()], "start", [rank],
                                           limit=self.start_timeout)[0]
        hal_ray.check_distinct_devices(self.bindings)
        self._raw_wanted = self._raw_generation + 1  # the new actor joins a new raw group
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
    """Run ``hal sync`` with Ray actors; returns what :func:`hal.apps.cli.sync.execute` returns, plus the
    workers' bindings (``"workers"``) and the cluster/actor start-up seconds (``"startup"``)."""
    ray = hal_ray.require_ray()
    begin = time.perf_counter()
    _, cluster = connect(args)
    try:
        cluster_s = time.perf_counter() - begin
        with RaySync(args, strategy=args.placement) as run:
            warmup = run.warmup()
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
    return {"warmup": warmup, "rows": rows, "workers": workers,
            "startup": {"cluster_s": cluster_s if cluster else 0.0, "actors_s": actors_s}}


__all__ = ["SyncUpdateError", "TrainerActor", "RolloutActor", "RaySync", "connect", "execute_ray"]
