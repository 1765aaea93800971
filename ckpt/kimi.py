"""``kimi``: Kimi's ``checkpoint-engine`` (``checkpoint_engine.ps.ParameterServer``), peer-to-peer path.

The path verl 0.9.1 drives, in hal's contract: the trainer (rank 0) copies the update into pinned host
memory with ``ParameterServer.register_checkpoint`` and every rank runs ``gather_metas``; the rollouts cut
the trainer's layout into buckets, one receiving rollout per network device and host pulls each bucket
(Mooncake ``batch_transfer_sync_read``) and broadcasts it inside the rollout group, two device slots
alternating; when every rollout is done the trainer unregisters and ``send_weights`` returns.

Every library call goes through :mod:`ckpt.kimi_library`, hal's adapter around checkpoint-engine 0.4.2. Runs
on device kinds that can pin host memory; other library versions are reported unavailable.

Install: the ``kimi`` extra, with ``pip install --no-deps checkpoint-engine==0.4.2`` (its wheel requires
torch, which must stay the build you have) and Mooncake (the ``mooncake`` extra)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable

import torch

import hal
from ckpt.base import NamedTensor, ReceivePlacement, check_global_steps, check_step, named_tensors
from ckpt.control import HEARTBEAT_DEAD_S, ControlChannel, check_heartbeat_timeout
from ckpt.errors import (CheckpointConfigError, CheckpointEngineUnavailableError, TransferAbortedError,
                         TransferError, TransferTimeoutError)
from ckpt.kimi_library import (CHECKED_VERSIONS, HOST_PROTOCOL, LOGS_ENV, ParameterServerAdapter, World,
                               library_problem, mooncake_protocol)
from ckpt.one_to_many import DEFAULT_BUCKET_SIZE, OneToManyEngine, local_address_towards
from ckpt.checker import Digester
from ckpt.outcome import Reports, ReportsOnBoard, StoreBoard

_MARK = "~hal/"  # names of the marker entries; every weight's name is "<8-digit ordinal>/<name>"


def supported_kinds() -> list[str]:
    """Return the device kinds that can pin host memory, which ``register_checkpoint`` needs."""
    from hal.registry import get_spec

    return [k for k in hal.known_kinds() if get_spec(k).supports_pin_memory]


NAMESPACE = "kimi"  # Prefix of the engine's control keys: kimi/<generation>/...


class KimiCheckpointEngine(ReportsOnBoard, OneToManyEngine):
    """Weights through Kimi's ``checkpoint-engine`` ``ParameterServer`` over Mooncake (see the module overview).

    Built standalone (``rank``, ``world_size``, ``master_addr`` / ``master_port``) or verl's way. A tensor
    larger than ``bucket_size`` makes that update's buckets as large (the library never splits a tensor).
    ``timeout`` (seconds) bounds every wait.

    Memory: the trainer holds the whole update in the library's pinned pool, reused while tensor sizes stay the
    same; a rollout two device slots of a bucket, plus a pinned host bucket where the kind has no Mooncake
    protocol. All kept across updates until :meth:`close`.
    Order and ownership: tensors arrive in send order; a yielded tensor is a view into an engine-owned slot,
    valid until the item after the next bucket's first is requested. ``send_weights`` returns when every
    rollout finished. A failing ``weights`` iterator raises :class:`TransferAbortedError` on the rollouts."""

    uses_transfer_library = True
    rollout_pulls = True  # the rollouts read from the trainer's registered buckets (Mooncake reads)

    def __init__(self, bucket_size: int = DEFAULT_BUCKET_SIZE, is_master: bool = False, *, rank: int | None = None,
                 world_size: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                 store_addr: str | None = None, device: str | None = None, timeout: float = hal.DEFAULT_TIMEOUT_S,
                 host: str | None = None, heartbeat_timeout: float = HEARTBEAT_DEAD_S, **extra: Any) -> None:
        self._check_extra(extra, KimiCheckpointEngine.__init__, "__init__")
        self.heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)
        super().__init__(bucket_size=bucket_size, is_master=is_master, rank=rank, world_size=world_size,
                         master_addr=master_addr, master_port=master_port, store_addr=store_addr, device=device,
                         timeout=timeout, host=host)
        state = self.availability(device)
        if not state:
            raise CheckpointEngineUnavailableError(f"checkpoint engine 'kimi' is unavailable here: {state.reason}")
        self._ps: ParameterServerAdapter | None = None
        self._world: World | None = None
        self._group: hal.StoreGroup | None = None
        self._group_broken = False  # a broadcast of the rollout group failed: it is out of step, never reused
        self._slots: torch.Tensor | None = None
        self._h2d: torch.Tensor | None = None
        self._device: torch.device | None = None
        self._protocol, self._in_place = HOST_PROTOCOL, False
        self._pool_layout: tuple[int, ...] | None = None  # sizes of what the trainer's pinned pool holds
        self._store: Any = None  # the rendezvous store the trainer hosts (kept until close()), else None
        self._store_served: int | None = None  # the highest generation whose keys that store holds
        self._reports = Reports(self._label)  # the rollouts' words on each update, on the control channel's keys

    @classmethod
    def availability(cls, device: str | None = None) -> hal.Availability:
        """Ok when the resolved kind is one of :func:`supported_kinds`, and checkpoint-engine 0.4.2 and Mooncake import."""
        kinds = supported_kinds()
        try:
            spec = hal.resolve_device(device)
        except hal.HalError as exc:
            return hal.Availability.unavailable(f"no usable device kind: {exc}")
        if spec.kind not in kinds:
            return hal.Availability.unavailable(
                f"Kimi's checkpoint-engine runs only on device kinds {kinds} (its ParameterServer needs a device "
                "with pinned host memory, DeviceSpec.supports_pin_memory); "
                f"the device kind asked for is {spec.kind!r} (select one with HAL_DEVICE or --device)")
        problem = library_problem()
        return hal.Availability.unavailable(problem) if problem else hal.Availability.available()

    # ---- configuration and lifecycle ----------------------------------------------------------------
    min_bucket_size = 1024
    min_world_size = 2
    send_buffer_words = "the whole update, pinned in host memory"

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        return {"pinned_update_bytes": published_bytes}

    def _host_rendezvous(self) -> None:
        """On the trainer: host the rendezvous store once, so the address ``prepare()`` reports is already served."""
        if self._store is None or self._store_moved():
            self._store = self._store_served = None  # the old one stops first: the new one may take its port
            self._store = self._host_store()

    def is_healthy(self) -> bool:
        """Return whether set up with the rollout group in step (a failed broadcast breaks it for good)."""
        return self._ps is not None and not self._group_broken

    def _enter(self, membership) -> None:
        """Release for a new place; a generation the store already served also gets a new store (no stale keys)."""
        if self._store_served is not None and membership.generation <= self._store_served:
            self._store = self._store_served = None
        self._release()

    def _leave(self) -> None:
        self._release()

    def finalize(self) -> None:
        """Nothing per update: everything stays while the place is unchanged (:meth:`close` releases it)."""

    def close(self) -> None:
        """Release everything: pinned pool, slots, group, Mooncake engine, the trainer's store."""
        self._release()
        self._store = self._store_served = None

    def _release(self) -> None:
        if self._pool_layout is not None and self._ps is not None:
            self._ps.unregister(force=True)
        self._pool_layout = None
        self._release_buffers()
        if self._group is not None:
            self._group.close()
        if self._world is not None:
            self._world.channel.close()
        self._group = self._ps = self._world = None
        self._reports.unbind()
        self._group_broken = False
        self._joined = None

    def _release_buffers(self) -> None:
        if self._slots is not None and self._ps is not None:
            try:
                self._ps.unregister_buffer()
            except Exception:  # noqa: BLE001 - a failed engine; the buffer is dropped either way
                pass
        self._h2d = self._slots = None

    def _ready(self) -> None:
        """Make the store, the parameter server and (rollouts) the rollout group; blocking, bounded."""
        if self._ps is not None:
            return
        self._bind()
        if self.rank is None:
            raise CheckpointConfigError("send/receive before init_process_group: this engine has no rank")
        if self.master_addr is None or self.master_port is None:
            raise CheckpointConfigError(f"kimi needs master_addr and master_port (rank 0's store), got "
                                        f"{self.master_addr!r}, {self.master_port!r}")
        spec = self.local.spec
        device = self.local.bind()
        self._device = device
        generation = self._membership.generation if self._membership else 0
        if self.rank == 0:
            self._host_rendezvous()
            store = self._store
            self._store_served = max(self._store_served or 0, generation)  # generations are >= 0
        else:
            store = hal.connect_store(self.master_addr, int(self.master_port), self.rank, self.world_size,
                                      self.timeout, is_master=False)
        host = self.host or (self.master_addr if self.rank == 0 else local_address_towards(self.master_addr))
        self._protocol, self._in_place = mooncake_protocol(spec)
        namespace = f"{NAMESPACE}/{generation}"
        channel = ControlChannel(store, rank=self.rank, namespace=namespace,
                                 timeout=self.timeout, label=self._label, heartbeat_timeout=self.heartbeat_timeout)
        channel.watch([r for r in range(self.world_size) if r != self.rank])
        world = World(channel, self.world_size)
        self._reports.bind(StoreBoard(channel), self.rank)
        ps = ParameterServerAdapter(spec, self._protocol, device.index or 0, self.rank, self.world_size, host, world)
        self._world = world
        if self.rank > 0 and self.world_size > 2:
            self._group = hal.new_group_from_store(store, self.rank - 1, self.world_size - 1, device=spec,
                                                   timeout=self.timeout, prefix=f"{namespace}/rollouts")
        self._ps = ps
        if self._membership is not None:
            self._joined_now(self._membership)

    async def _ready_async(self) -> None:
        try:
            await asyncio.to_thread(self._ready)
        except hal.DistributedTimeoutError as exc:
            raise TransferTimeoutError(f"{self._label(self.rank)} could not join the engine's rendezvous within "
                                       f"{self.timeout:g} s (a peer is dead or missing): {exc}") from None

    def _done(self, step: int | None) -> None:
        self._world.channel.post_bytes(f"done/{self._world.calls}/{self.rank}", str(step).encode())

    # ---- trainer --------------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: Any = False) -> None:
        """Publish ``weights`` tagged ``global_steps``; return when every rollout is done with the update and every
        reporting one applied it (:mod:`ckpt.outcome`; ``check``: and serves it, :mod:`ckpt.checker`)."""
        global_steps = check_global_steps(global_steps)
        if self._outside(weights):  # a trainer rank that does not send (verl: every rank iterates its shard)
            return
        if self.rank is None:
            raise CheckpointConfigError("send/receive before init_process_group: this engine has no rank")
        self._check_sender()
        await self._ready_async()
        digester = Digester() if check else None
        if digester is not None:
            weights = digester.watch(weights)
        named: dict[str, torch.Tensor] = {}
        failure: BaseException | None = None
        try:
            for i, (name, tensor) in enumerate(named_tensors(weights)):
                named[f"{i:08d}/{name}"] = tensor.detach().contiguous()
        except Exception as exc:  # noqa: BLE001 - told to the rollouts, then raised
            failure, named = exc, {}
        # the marker carries the step and the trainer's bucket size: every rollout cuts the update into the
        # same buckets (their broadcast inside the rollout group must agree), whatever each was built with
        named[f"{_MARK}step={global_steps};bucket={self.bucket_size}"
              + (f"/aborted={type(failure).__name__}: {failure}" if failure else "")] = \
            torch.zeros(1, dtype=torch.uint8)
        pending = []  # the update's reports, begun once every rollout promised (they do before gather_metas)

        def begin() -> None:
            pending.append(self._reports.begin(range(1, self.world_size), global_steps, digester or False))

        await asyncio.to_thread(self._publish, named, global_steps, begin)
        if failure is not None:
            raise failure
        self.outcomes = await pending[0].collect(self.timeout)

    def _publish(self, named: dict[str, torch.Tensor], step: int | None, gathered: Any) -> None:
        """Copy ``named`` into the library's pinned pool, gather the layouts, call ``gathered()``, wait for the rollouts."""
        self._bind()  # a worker thread (asyncio.to_thread): on this rank's device
        ps = self._ps
        layout = tuple(t.numel() * t.element_size() for t in named.values())  # in name order: ordinal, marker
        if self._pool_layout is not None:  # the previous update's registration: keep its pool if sizes match
            ps.unregister(force=self._pool_layout != layout)
            self._pool_layout = None
        self.local.synchronize()
        ps.register(named)
        self._pool_layout = layout
        named.clear()
        try:
            ps.gather_metas()
        except TransferError as exc:
            raise type(exc)(f"step {step}: {exc}") from None
        gathered()
        n = self._world.calls
        self._world.wait({r: f"done/{n}/{r}" for r in range(1, self.world_size)},
                          f"step {step} on the trainer, waiting for the rollouts to pull it")

    # ---- rollouts -------------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the next update's ``(name, tensor)`` pairs in send order, as views (``placement`` is not used)."""
        asked = check_global_steps(global_steps)
        self._check_receiver()
        await self._ready_async()
        metas = await asyncio.to_thread(self._ps.gather_metas)
        step: Any = "unknown"
        try:
            marks = [m.name for owner in metas.values() for buf in owner.memory_buffer_metas_list
                     for m in buf.metas if m.name.startswith(_MARK)]
            if len(marks) != 1:
                raise TransferError(f"rollout rank {self.rank}: the update on offer carries {len(marks)} step "
                                    f"markers, expected 1 (is every trainer rank but rank 0 at rank -1?)")
            head, _, aborted = marks[0][len(_MARK):].partition("/aborted=")
            fields = dict(field.partition("=")[::2] for field in head.split(";"))
            step = None if fields.get("step") == "None" else int(fields["step"])
            bucket = int(fields.get("bucket", self.bucket_size))
            if aborted:
                raise TransferAbortedError(f"step {step}: the trainer gave the update up ({aborted}); rollout rank "
                                           f"{self.rank} keeps its previous weights")
            check_step(asked, step, f"rollout rank {self.rank}")
            self.received_global_steps = step
            async for item in self._pull(metas, step, bucket):
                yield item
        finally:  # the trainer's record of the update is posted by now (after its gather_metas)
            self._reports.take(None if step == "unknown" else step)
            try:
                self._done(step)
            except Exception:  # noqa: BLE001 - the store's host (the trainer) is gone: nobody waits for it
                pass

    async def _pull(self, metas: dict, step: int | None, bucket: int) -> AsyncIterator[NamedTensor]:
        """Pull and broadcast the update in buckets of the trainer's ``bucket`` bytes (at least the largest tensor)."""
        ps = self._ps
        largest = max(m.aligned_size for owner in metas.values() for b in owner.memory_buffer_metas_list
                      for m in b.metas)
        size = max(bucket, largest)
        rollouts = list(range(1, self.world_size))
        buckets = ps.buckets(metas, size, rollouts)
        self._buffers(size)
        loop = asyncio.get_running_loop()

        def move(k: int) -> None:
            self._bind()  # an executor thread: on this rank's device
            receiver, owner, bucket = buckets[k]
            slot = self._slots[(k % 2) * size:(k % 2) * size + bucket.size]
            if receiver == self.rank:
                target = self._h2d if self._h2d is not None else slot
                try:
                    ps.pull(bucket, target, owner)
                except TransferError as exc:
                    raise TransferError(f"rollout rank {self.rank} pulling bucket {k} of step {step} from "
                                        f"{self._label(owner)}: {exc}") from None
                if target is not slot:
                    slot.copy_(target[:bucket.size])
                    self.local.synchronize()
            if self._group is not None:
                self._group.broadcast(slot, receiver - 1)

        async def finish(k: int, pending) -> None:
            done, _ = await asyncio.wait({pending}, timeout=self.timeout)
            if not done:
                self._group_broken = self._group is not None  # its broadcast may still be in flight
                raise TransferTimeoutError(f"step {step} on rollout rank {self.rank}: bucket {k} did not arrive "
                                           f"within {self.timeout:g} s ({self._label(0)} or a rollout is stuck)")
            try:
                pending.result()
            except hal.DistributedTimeoutError as exc:
                self._group_broken = True
                others = [r for r in rollouts if r != self.rank]
                raise TransferTimeoutError(
                    f"step {step} on rollout rank {self.rank}: the rollout group's broadcast of bucket {k} (from "
                    f"rollout rank {buckets[k][0]}) failed, one of rollout ranks {others} is dead or stuck: {exc}"
                ) from None
            except BaseException:  # a pull failed before its broadcast: the other rollouts wait for it in vain
                self._group_broken = self._group is not None
                raise

        pending = loop.run_in_executor(None, move, 0) if buckets else None
        for k in range(len(buckets)):
            await finish(k, pending)
            pending = loop.run_in_executor(None, move, k + 1) if k + 1 < len(buckets) else None
            slot = self._slots[(k % 2) * size:]
            try:
                for item in ps.items(buckets[k][2]):
                    name = item["name"]
                    if name.startswith(_MARK):
                        continue
                    dtype, shape = item["dtype"], torch.Size(item["shape"])
                    n = dtype.itemsize * shape.numel()
                    yield name.partition("/")[2], slot[item["offset"]:item["offset"] + n].view(dtype).view(shape)
            except BaseException:
                if pending is not None:  # its slot must not be freed while a thread still writes it
                    await asyncio.wait([pending], timeout=self.timeout)
                    # the other rollouts' broadcasts of the buckets left are not matched here: out of step
                    self._group_broken = self._group is not None
                raise

    def _buffers(self, size: int) -> None:
        """Allocate two device slots of ``size`` bytes (and a pinned host bucket without a Mooncake protocol)."""
        if self._slots is not None and self._slots.numel() == 2 * size:
            return
        self._release_buffers()
        self._slots = torch.empty(2 * size, dtype=torch.uint8, device=self._device)
        if not self._in_place:
            self._h2d = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._ps.register_buffer(self._h2d if self._h2d is not None else self._slots)


__all__ = ["KimiCheckpointEngine", "supported_kinds",
           # the library adapter's names, importable from here as before it was its own module
           "CHECKED_VERSIONS", "HOST_PROTOCOL", "LOGS_ENV", "mooncake_protocol"]
