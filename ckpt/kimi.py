"""``kimi``: Kimi's ``checkpoint-engine`` (``checkpoint_engine.ps.ParameterServer``), peer-to-peer path.

The path verl 0.9.1 drives (``verl/checkpoint_engine/kimi_checkpoint_engine.py``), in hal's contract:

* the trainer (rank 0) copies the update into pinned host memory with the library's
  ``ParameterServer.register_checkpoint`` (which registers those buffers with its Mooncake ``P2PStore``),
  then every rank runs ``ParameterServer.gather_metas`` (an all-gather of every rank's buffer layout);
* the rollouts (ranks 1..N) cut the trainer's layout into buckets with the library's ``_gen_h2d_buckets``
  (one receiving rollout per network device and host, the others get each bucket from it), the receiving
  rollout pulls each bucket with the library's ``ParameterServer._copy_to_buffer`` (Mooncake
  ``batch_transfer_sync_read`` from the trainer's host memory), and the bucket is broadcast inside the
  rollout group, two device slots alternating so bucket k+1 moves while the consumer reads bucket k;
* when every rollout said it is done, the trainer unregisters the checkpoint and ``send_weights`` returns.

Every call into the library goes through :mod:`ckpt.kimi_library`, hal's adapter around checkpoint-engine
0.4.2: the library's device manager and Mooncake store made from the hal device kind (Mooncake protocol:
the kind's ``mooncake_protocol``, else host memory over ``tcp`` copied host-to-device), its collectives
answered over hal's rendezvous store, its INFO logs quiet while hal calls it (``HAL_KIMI_LOGS=1`` lets
them through). It runs on the device kinds that can pin host memory (``DeviceSpec.supports_pin_memory``): the
library's ``register_checkpoint`` copies the update into pinned buffers. Other checkpoint-engine versions than
those checked are reported unavailable.

Install: the ``kimi`` extra, with ``pip install --no-deps checkpoint-engine==0.4.2`` (its wheel requires
torch, which must stay the build you have) and Mooncake (the ``mooncake`` extra).
"""

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

_MARK = "~hal/"  # names of the marker entries; every weight's name is "<8-digit ordinal>/<name>"


def supported_kinds() -> list[str]:
    """Device kinds Kimi's checkpoint-engine runs on: those that can pin host memory
    (``DeviceSpec.supports_pin_memory``), since its ``ParameterServer.register_checkpoint`` copies the update
    into pinned buffers (checkpoint-engine 0.4.2's ``ps.py``); a host-memory kind (cpu) cannot."""
    from hal.registry import get_spec

    return [k for k in hal.known_kinds() if get_spec(k).supports_pin_memory]


NAMESPACE = "kimi"
"""Prefix of the engine's control keys (:mod:`ckpt.control`): ``kimi/<generation>/...``."""


class KimiCheckpointEngine(OneToManyEngine):
    """Weights through Kimi's ``checkpoint-engine`` ``ParameterServer`` over Mooncake (see the module doc).

    Construction, standalone (hal's): ``rank`` (0: the trainer; 1..N: rollouts; -1: a trainer rank that does
    not send), ``world_size`` (N + 1), ``master_addr`` / ``master_port`` (where rank 0 hosts the rendezvous
    store) up front. Driven by verl's ``CheckpointEngineManager``: ``bucket_size`` and ``is_master``;
    ``prepare()`` on the master hosts the store (on a port the kernel picks), :meth:`build_topology` hands its
    address to every rank.

    Args:
        bucket_size: bytes per bucket a rollout pulls and broadcasts; a tensor larger than it makes that
            update's buckets as large as the tensor (the library never splits a tensor).
        device: kind name (``"npu"``, ``"cuda"``, ``"npu-sim"``) or ``None`` for hal's resolution.
        timeout: seconds bounding every wait (store, gather, pull, broadcast, the trainer's wait for the rollouts).
        host: the address peers reach this process's Mooncake store at (default: ``master_addr`` on the
            trainer, the local address towards it elsewhere).
        heartbeat_timeout: seconds a rank's heartbeat may stand still before it counts as dead
            (:data:`ckpt.control.HEARTBEAT_DEAD_S` by default; see :class:`ckpt.control.ControlChannel`).

    Memory: the trainer holds the whole update in pinned host memory (the library's design), in the
    library's shared pool, kept between updates and reused while the tensor sizes stay the same (a new
    layout frees it and allocates another); a rollout holds two device slots of the bucket size, plus a
    receiving buffer of one bucket where the kind has no Mooncake protocol (pinned host memory), also kept
    across updates. :meth:`close` frees all of it.

    Order and ownership: ``receive_weights`` yields in send order (the library sorts by name; hal prefixes
    each name with its ordinal and strips it). A yielded tensor is a view into an engine-owned slot, valid
    until the item after the next bucket's first is requested: copy it if it must outlive that.
    ``send_weights`` returns when every rollout finished (the caller may reuse or free its tensors; they were
    copied into host memory before any rollout read them).

    Failures: a rollout that dies or stalls fails the trainer's send within ``timeout`` naming it; a dead
    trainer fails each rollout's receive naming it; a dead rollout fails the others' broadcast. A sender
    whose ``weights`` iterator raises tells the rollouts (:class:`TransferAbortedError`) and stays usable.
    """

    uses_transfer_library = True
    rollout_pulls = True  # the rollouts read from the trainer's registered buckets (Mooncake reads)

    @classmethod
    def bare_transport(cls, rank: int) -> Any:
        """Mooncake over tcp on the loopback, the library Kimi's engine moves bytes with, no engine around it (a
        benchmark's baseline, :meth:`ckpt.p2p.Transport.copy_sync` with ``read=True``: kimi's rollouts pull)."""
        from ckpt.mooncake import MooncakeCheckpointEngine

        return MooncakeCheckpointEngine.bare_transport(rank)

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

    @classmethod
    def availability(cls, device: str | None = None) -> hal.Availability:
        """Ok when the resolved device kind (``device``, else ``$HAL_DEVICE``, else auto) is one of
        :func:`supported_kinds` and is available, and checkpoint-engine 0.4.2 and Mooncake import."""
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
        """The trainer copies the whole update into pinned host memory (bytes)."""
        return {"pinned_update_bytes": published_bytes}

    def _host_rendezvous(self) -> None:
        """On the trainer: host the rendezvous store (once) at ``master_addr:master_port`` (a port the kernel
        picks when unset), so the address ``prepare()`` reports is already served: no port is picked and bound
        later, when another process may have taken it.

        Raises:
            CheckpointConfigError: the trainer's address cannot be bound.
        """
        if self._store is None or self._store_moved():
            self._store = self._store_served = None  # the old one stops first: the new one may take its port
            self._store = self._host_store()

    def is_healthy(self) -> bool:
        """Set up, and the rollout group (if any) in step: a failed broadcast breaks it for good, so the next
        ``prepare()`` reports no group and the manager forms a new one (before ``hal soak`` found it, every
        update after a rollout's stop failed in the old group's broadcast)."""
        return self._ps is not None and not self._group_broken

    def _enter(self, membership) -> None:
        """A new place (rank, world size, store address or generation) gets a new engine and group. The
        trainer's store stays for a newer generation (its keys are the generation's, and verl's manager
        raises it for every new group); a group of a generation the store already served (a standalone
        engine joining generation 0 again) gets a new store, so nobody reads the keys of an update of the
        group before (its metadata and done markers: a send would end at once, with no rollout there)."""
        if self._store_served is not None and membership.generation <= self._store_served:
            self._store = self._store_served = None
        self._release()

    def _leave(self) -> None:
        self._release()

    def finalize(self) -> None:
        """Nothing to release per update: the store, Mooncake engine, group, the rollout's registered slots
        and the trainer's pinned pool stay for the next update while the place is unchanged (:meth:`close`
        releases them)."""

    def close(self) -> None:
        """Release everything: the trainer's pinned pool, the rollout's slots, the group, the Mooncake engine,
        the store the trainer hosts."""
        self._release()
        self._store = self._store_served = None

    def _release(self) -> None:
        """Release the pinned pool, the slots, the group and the Mooncake engine (the trainer's store stays)."""
        if self._pool_layout is not None and self._ps is not None:
            self._ps.unregister(force=True)
        self._pool_layout = None
        self._release_buffers()
        if self._group is not None:
            self._group.close()
        if self._world is not None:
            self._world.channel.close()
        self._group = self._ps = self._world = None
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
        """Tell the trainer this rollout is done with the update (it then unregisters the host buffers)."""
        self._world.channel.post_bytes(f"done/{self._world.calls}/{self.rank}", str(step).encode())

    # ---- trainer --------------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Publish ``weights`` (``(name, tensor)`` pairs, any device, dtype and strides) tagged ``global_steps``;
        returns when every rollout is done with the update.

        Raises:
            CheckpointConfigError: called on a rollout, a bad ``global_steps``, or the trainer's store address
                cannot be bound.
            TransferTimeoutError, TransferError: a rollout is dead or stuck (named), within ``timeout``.
            Whatever ``weights`` raises: the rollouts are told first (:class:`TransferAbortedError`).
        """
        global_steps = check_global_steps(global_steps)
        if self._outside(weights):  # a trainer rank that does not send (verl: every rank iterates its shard)
            return
        if self.rank is None:
            raise CheckpointConfigError("send/receive before init_process_group: this engine has no rank")
        self._check_sender()
        await self._ready_async()
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
        await asyncio.to_thread(self._publish, named, global_steps)
        if failure is not None:
            raise failure

    def _publish(self, named: dict[str, torch.Tensor], step: int | None) -> None:
        """Copy ``named`` into the library's shared pinned pool (reused while the sizes are unchanged, as
        ``register_checkpoint(use_shared_memory_pool=True)`` allows), gather the layouts, wait for the rollouts."""
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
        n = self._world.calls
        self._world.wait({r: f"done/{n}/{r}" for r in range(1, self.world_size)},
                          f"step {step} on the trainer, waiting for the rollouts to pull it")

    # ---- rollouts -------------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of the next update in send order (views: see the class doc).
        ``placement`` is not used: the library writes into this engine's registered slots.

        Raises:
            VersionMismatchError: ``global_steps`` given and another step on offer (before anything is yielded).
            TransferAbortedError: the trainer's ``weights`` iterator raised.
            TransferTimeoutError, TransferError: the trainer or another rollout is dead or stuck (named).
            CheckpointConfigError: called on the trainer.
        """
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
        finally:
            try:
                self._done(step)
            except Exception:  # noqa: BLE001 - the store's host (the trainer) is gone: nobody waits for it
                pass

    async def _pull(self, metas: dict, step: int | None, bucket: int) -> AsyncIterator[NamedTensor]:
        """Pull and broadcast the update in buckets of the trainer's ``bucket`` bytes (at least the largest
        tensor), so every rollout cuts the same buckets."""
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
        """Two device slots of ``size`` bytes; where the kind has no Mooncake protocol, also a pinned host
        buffer the bucket is pulled into (then copied to the device). Registered with the Mooncake store."""
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
