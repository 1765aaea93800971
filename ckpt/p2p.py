"""Weights over a transfer library (NIXL, Mooncake): one-sided writes into the rollouts' registered buffers.

The shape every transfer-library engine shares, after verl's NIXL engine (``verl/checkpoint_engine``), with
the library behind a small :class:`Transport` (register a buffer, describe it to a peer, write a byte range
into a peer's buffer, wait for that write):

* **data plane**: the trainer (rank 0) packs bucket *k* into one of its two registered send slots while the
  library writes bucket *k-1* from the other; it writes each bucket straight into slot ``k % 2`` of every
  rollout's registered receive region (one write per rollout, issued together);
* **control plane**: :mod:`ckpt.control` over the ``TCPStore`` the trainer hosts at ``master_addr`` (no
  socket code of hal's; nothing bound to an event loop, so an engine survives several ``asyncio.run``
  calls). A rollout says :class:`Hello` (its rank, its connection's epoch, bucket size and what its transport
  needs: agent metadata, session, buffer address); the trainer sends each message's metadata
  (:class:`ckpt.wire.WireMessage`: entries, chunk, ``step``, end or abort) only after that message's write
  completed, and a rollout acknowledges every message (:class:`ckpt.control.Ack`) once it is done with its
  slot, which is the trainer's credit to write slot ``k % 2`` again. When an update fails the trainer gives
  every connection up and marks it so in the store; a rollout reads the mark before its next update and
  connects again.

Every wait (the store, hello, credit, write, metadata) is bounded by ``timeout``. Every rank heartbeats
through the store: a dead or hung rollout fails the trainer's send naming that rollout within
``heartbeat_timeout`` (:data:`ckpt.control.HEARTBEAT_DEAD_S` by default) plus a heartbeat, and a dead trainer
(the store's host) fails a rollout's receive naming the trainer at once. Nothing a receiver yields is
applied by the engine: a rollout that gets an error keeps serving its previous step (``ckpt.workers``
applies updates all-or-nothing).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import functools
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable

import torch

import hal
from ckpt.base import NamedTensor, ReceivePlacement, check_global_steps, check_step
from ckpt.bucket import Message, plan_messages
from ckpt.layout import byte_view
from ckpt.wire import WireMessage, check_bucket_size
from ckpt.errors import (CheckpointConfigError, TransferAbortedError, TransferError, TransferTimeoutError,
                         VersionMismatchError)
from ckpt.one_to_many import DEFAULT_BUCKET_SIZE, OneToManyEngine, local_address_towards
from ckpt.control import (HEARTBEAT_DEAD_S, STORE_OVERRUN_S, Ack, ControlChannel, PeerFailure, check_heartbeat_timeout,
                          connect_store)

META_BUDGET = 1 << 20
"""Bytes of JSON metadata per bucket at most (a bucket of many small tensors closes early)."""
NAMESPACE = "ckpt-p2p"
"""Prefix of the engine's store keys; the group's generation follows (``ckpt-p2p/<generation>/...``)."""


class Transport(abc.ABC):
    """What an engine needs of a transfer library: registered memory and one-sided writes to peers.

    One instance per engine, made by :meth:`P2PCheckpointEngine.make_transport` once the engine knows its
    host address. All methods but :meth:`wait` are synchronous and quick.
    """

    library = "transfer library"
    addr: int | None = None
    """The address of the region :meth:`register` registered (``None`` before)."""
    max_in_flight = 1
    """Messages whose writes may be in flight at once (1 or 2): 2 lets the write of bucket k start while
    k-1's completes, where the library gains from concurrent writes."""

    @abc.abstractmethod
    def register(self, buffer: torch.Tensor) -> dict[str, Any]:
        """Register ``buffer`` (flat ``uint8``, on the engine's buffer device) for transfers; returns the
        JSON-ready description a peer needs to address it (sent in the hello)."""

    @abc.abstractmethod
    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        """Learn peer ``peer``'s registered region from its hello ``info`` (replaces an earlier one).

        Raises:
            TransferError: the library cannot use ``info`` (the peer's agent is unreachable or closed).
        """

    @abc.abstractmethod
    def register_source(self, tensor: torch.Tensor) -> Any:
        """Register the bytes of ``tensor`` (a flat ``uint8`` view of a weight's storage) so that a write can
        read them in place; returns a handle for :meth:`release_source`."""

    @abc.abstractmethod
    def release_source(self, handle: Any) -> None:
        """Deregister what :meth:`register_source` registered (its writes have completed)."""

    @abc.abstractmethod
    def start_write(self, peer: int, pieces: list[tuple[int, int, int]]) -> Any:
        """Begin writing ``pieces`` ``(local address, offset in the peer's region, nbytes)`` (local addresses
        in registered memory) to ``peer``, as one transfer; returns a handle for :meth:`wait`."""

    @abc.abstractmethod
    def poll(self, handle: Any) -> bool:
        """Whether the write ``handle`` is complete, without blocking (:meth:`wait` still releases it).

        Raises:
            TransferError: the library reports a failure.
        """

    async def wait(self, handle: Any, timeout: float, alive: Callable[[], None] | None = None) -> None:
        """Wait until the write completed at the target: :meth:`poll` with a backoff from 20 us to 1 ms,
        yielding to the event loop between polls; ``alive()`` (if given) is called between polls and raises
        when the target is known dead.

        Raises:
            TransferError: the library reports a failure; TransferTimeoutError: not done in ``timeout`` s;
            whatever ``alive`` raises.
        """
        deadline = time.monotonic() + timeout
        delay = 0.0
        while not self.poll(handle):
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{self.library} write not done within {timeout:g} s")
            await asyncio.sleep(delay)
            delay = min(1e-3, delay * 2 or 2e-5)

    def copy_sync(self, peer: int, nbytes: int, timeout: float, *, read: bool = False) -> None:
        """Copy the first ``nbytes`` of the region :meth:`register` registered to the start of ``peer``'s
        (``read``: from ``peer``'s into this one) as one transfer, blocking until done: the library's best
        between two processes, the baseline :mod:`hal.apps.benchmarks.bench_p2p` holds an engine against.

        Raises:
            NotImplementedError: ``read`` where the library's engine only writes (the default here).
            TransferError: the library reports a failure; TransferTimeoutError: not done in ``timeout`` s.
        """
        if read:
            raise NotImplementedError(f"{self.library}: hal's transport only writes")
        asyncio.run(self.wait(self.start_write(peer, [(self.addr, 0, nbytes)]), timeout))

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory and release the library's resources; idempotent. Once it returns the library
        writes nothing more into memory this transport registered: a peer's write still on its way (a
        failed update's, over a cut link) fails instead of landing."""


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rollout's first message on a connection (control queue ``"hello"``): who it is and what its transport
    needs.

    Attributes:
        rank: its rank (1..N).
        epoch: the number of this connection of that rank (1, 2, ... in the group's generation): the trainer
            keeps the newest, and the connection's queues are named by it, so nothing of an older one is read.
        bucket_size: the bytes its receive slots are laid out for.
        transport: :meth:`Transport.register`'s description of its receive region.
        host: the address its transport is reached at (for messages).
    """

    rank: int
    epoch: int
    bucket_size: int
    transport: dict[str, Any]
    host: str


def _queues(rank: int, epoch: int) -> tuple[str, str]:
    """The control queues of rollout ``rank``'s connection ``epoch``: the trainer's messages, its acks."""
    return f"msg/{rank}/{epoch}", f"ack/{rank}/{epoch}"


def _give_up_connection(ctl: ControlChannel, rank: int, epoch: int) -> None:
    """Mark rollout ``rank``'s connection ``epoch`` given up: by the trainer, which no longer writes to it, or by
    the rollout, which closed its agent (see :meth:`P2PCheckpointEngine._connect`)."""
    ctl.add(f"given-up/{rank}/{epoch}", 1)


def _connection_given_up(ctl: ControlChannel, rank: int, epoch: int) -> bool:
    """Whether rollout ``rank``'s connection ``epoch`` was given up (:func:`_give_up_connection`)."""
    return ctl.add(f"given-up/{rank}/{epoch}", 0) > 0


@dataclasses.dataclass
class Registered:
    """A storage registered with the library for direct writes: its handle and how many in-flight messages
    use it (it is deregistered when the last one completed)."""

    handle: Any
    users: int = 0


@dataclasses.dataclass
class _Peer:
    rank: int
    label: str
    epoch: int  # its connection's number (names its queues)
    sent: int = 0  # messages announced to it in this update
    acked: int = 0  # of those, acknowledged

    @property
    def queues(self) -> tuple[str, str]:
        return _queues(self.rank, self.epoch)


class P2PCheckpointEngine(OneToManyEngine):
    """Base of the transfer-library engines: bucketed one-sided writes, 1 trainer to N rollouts.

    Construction, standalone (hal's): ``rank`` (0: the trainer; 1..N: rollouts), ``world_size`` (N + 1) and
    the address of the control store the trainer hosts, ``master_addr`` / ``master_port`` (or
    ``store_addr="host:port"``; port ``None`` on the trainer: a free one), up
    front; the lifecycle then runs lazily on the first send or receive. Driven by verl's
    ``CheckpointEngineManager``: construct with ``bucket_size`` and ``is_master``; ``prepare()`` returns the
    trainer master's address, :meth:`build_topology` hands it to every rank, ``init_process_group(rank=,
    world_size=, master_addr=, master_port=)`` sets each rank's place (trainer ranks other than the master
    get ``rank=-1``: their ``send_weights`` consumes the iterator and returns). The library's agent, the
    registered slots and the connections (control channels over the store) outlive ``finalize()`` (which verl
    calls after every update) while the topology stays the same; a new topology or :meth:`close` releases
    them. The trainer's store keeps its port across topologies until :meth:`close`.

    Args:
        bucket_size: bytes per bucket (per slot); tensors above it travel in chunks of it.
        device: kind name (``"cpu"``, ``"npu-sim"``, ...) or ``None`` for hal's resolution. The buffers live
            on that device when the library moves its memory in place (the kind's device-spec fact, see
            :meth:`in_place_value`: host memory on cpu, the simulated device's memory on npu-sim, VRAM where
            NIXL registers it), else in host memory (tensors are staged through it); a rollout receives
            tensors on the buffer device.
        timeout: seconds bounding every wait (the store, hello, credit, write, metadata).
        host: the address peers reach this process at (default: ``master_addr`` on the trainer; on a rollout
            the local address it reaches the trainer from).
        direct_threshold: tensors on the buffer device of at least this many bytes (and runs of tensors
            lying back to back in one storage) are registered with the library for the update and written
            from their own memory, without a copy into a slot (default ``bucket_size // 8``; 0 packs all; else an
            int >= 0, or :class:`CheckpointConfigError`).
        heartbeat_timeout: seconds a peer's heartbeat may stand still before it counts as dead
            (:data:`ckpt.control.HEARTBEAT_DEAD_S` by default; see :class:`ckpt.control.ControlChannel`).

    Memory: the trainer holds three registered slots of ``bucket_size`` (each tensor is copied into bucket k's
    slot when it is yielded while k-1 and k-2 may still be written; only tensors of a collection are
    written from their own memory, see :func:`ckpt.bucket.plan_messages`), a rollout two slots (the trainer
    writes k+1 while the consumer reads k) plus, when a tensor larger than a bucket arrives, one buffer of
    that tensor's size (kept for the next one of the update). Both sides must be built with the same
    ``bucket_size``: the trainer refuses a rollout whose slots are laid out for another, before any write.

    Ownership: ``send_weights`` returns once every rollout acknowledged every message (the caller may reuse
    or free its tensors). A tensor yielded by ``receive_weights`` is a view into an engine-owned slot,
    valid until the next item is requested: copy it before advancing if it must outlive that.

    Failures: a dead or hung rollout fails the trainer's send with :class:`TransferError` naming it (its
    rank and address) within ``heartbeat_timeout`` (:data:`ckpt.control.HEARTBEAT_DEAD_S` by default) plus a
    heartbeat or two (its heartbeat stopped), one that does not answer while alive within ``timeout``; the
    other rollouts are told (they raise :class:`TransferAbortedError`) and every connection is dropped, so
    the next update reconnects whoever is alive. A dead trainer fails each rollout's receive naming it. A
    sender whose ``weights`` iterator raises tells the rollouts (``TransferAbortedError``) and stays usable.
    """

    @staticmethod
    def in_place_value(spec: hal.DeviceSpec) -> str | None:
        """The kind's fact naming what the library does with its memory in place (its NIXL memory type, its
        Mooncake protocol), ``None`` where the library stages it through host memory (set by subclasses)."""
        return None

    min_bucket_size = 1024
    min_world_size = 2
    bytes_cross_a_network = True  # the library's one-sided writes between the processes
    uses_transfer_library = True

    def __init__(self, bucket_size: int = DEFAULT_BUCKET_SIZE, is_master: bool = False, *, rank: int | None = None,
                 world_size: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                 store_addr: str | None = None, device: str | None = None, timeout: float = hal.DEFAULT_TIMEOUT_S,
                 host: str | None = None, direct_threshold: int | None = None,
                 heartbeat_timeout: float = HEARTBEAT_DEAD_S, **extra: Any) -> None:
        self._check_extra(extra, P2PCheckpointEngine.__init__, "__init__")
        self.heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)
        super().__init__(bucket_size=bucket_size, is_master=is_master, rank=rank, world_size=world_size,
                         master_addr=master_addr, master_port=master_port, store_addr=store_addr, device=device,
                         timeout=timeout, direct_threshold=direct_threshold, host=host)
        self._store = None  # the control store: the trainer hosts it (kept until close()), a rollout's client
        self._control: ControlChannel | None = None  # this rank's control channel in the current generation
        self._epoch = 0  # rollout: the number of its connection (names its queues)
        self._sources: dict[tuple[int, int], Registered] = {}  # storages registered for direct writes
        self._peers: dict[int, _Peer] = {}
        self._transport: Transport | None = None
        self._region: torch.Tensor | None = None
        self._large: torch.Tensor | None = None
        self._buffer_device: torch.device | None = None
        self._device: torch.device | None = None

    # ---- the library ------------------------------------------------------------------------------
    @classmethod
    def availability(cls) -> hal.Availability:
        """Whether the library imports here (``ok``) or why not."""
        raise NotImplementedError

    @abc.abstractmethod
    def make_transport(self, host: str, in_place: str | None) -> Transport:
        """The library's transport for this process, reachable at ``host``; ``in_place`` is the kind's
        spec value (memory type / protocol) when the buffers are on the device, else ``None`` (host)."""

    # ---- configuration ----------------------------------------------------------------------------
    def _kind_value(self) -> str | None:
        return self.in_place_value(self.local.spec)

    # ---- lifecycle --------------------------------------------------------------------------------
    def _host_rendezvous(self) -> None:
        """On the trainer: host the control store (once) at ``master_addr:master_port`` (a free port when unset).

        Raises:
            CheckpointConfigError: the trainer's address cannot be bound.
        """
        if self._store is None or self._store_moved():
            self._store = None  # the old one stops first: the new one may take its port
            self._store = self._host_store()

    def _namespace(self) -> str:
        return f"{NAMESPACE}/{self._membership.generation if self._membership is not None else 0}"

    def _peer_label(self, rank: int) -> str:
        """How messages name ``rank``: the trainer with its address, a rollout with its transport's host."""
        peer = self._peers.get(rank)
        return peer.label if peer is not None and rank != self.src_rank else self._label(rank)

    def is_healthy(self) -> bool:
        # joined, and not released; an agent closed after a failed update on purpose is made again on next need
        return self._joined is not None

    def _enter(self, membership) -> None:
        self._release()

    def _leave(self) -> None:
        self._release()

    def finalize(self) -> None:
        """End of one update (verl calls it after every one): frees the per-update buffer of a tensor larger
        than a bucket. The agent, the registered slots and the connections are kept for the next update
        while the topology is unchanged (they are released by :meth:`init_process_group` with another
        topology, by :meth:`close`, or after a peer failed)."""
        self._large = None

    def close(self) -> None:
        """Drop every connection, stop the control store the trainer hosts, deregister and free the buffers;
        idempotent (the engine can be set up again by a later send / receive)."""
        self._release()
        self._store = None

    def _release(self) -> None:
        """Drop the connections and the control channel, the library's agent and the buffers (the trainer's
        store stays: its port does not change across generations)."""
        self._drop_connections()
        if self._control is not None:
            self._control.close()
            self._control = None
        self._close_transport()
        self._large = None
        self._joined = None

    def _close_transport(self) -> None:
        """Close the library's agent, then free the region it wrote into: closing stops the library's own
        threads, so no write can land in that memory afterwards (Mooncake's tcp server, for one, writes
        wherever a request's header points, registered or not)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._region = None
        self._sources = {}

    def _drop_connections(self) -> None:
        """Forget every rollout's connection (its queues drained; it connects again with a new epoch), or, on
        a rollout, the connection to the trainer."""
        if self.is_sender:
            for peer in self._peers.values():
                self._forget(peer)
            self._peers = {}
        elif self._control is not None:
            try:  # the trainer may not have read this connection's hello yet: it must not take it up later
                _give_up_connection(self._control, self.rank, self._epoch)
            except Exception:  # noqa: BLE001 - the store is gone: so is the trainer's use of this connection
                pass
            self._control.close()
            self._control = self._store = None
            # A write of the update that failed may still be on its way here (a cut link's TCP retransmits
            # it minutes later): it must land in no slot a later update reads. So the next connection gets a
            # new agent and new slots, and this agent is closed before its slots are freed (found by
            # ``hal soak``: mooncake served bytes no trainer published for that step).
            self._close_transport()

    def _forget(self, peer: _Peer) -> None:
        if self._control is not None:
            self._give_up(peer)
            for queue in peer.queues:
                self._control.drain(queue)
            self._control.unwatch([peer.rank])

    def _forget_given_up(self) -> bool:
        """Forget the kept connections given up since they were accepted, by this trainer or by their rollout
        (which dropped it, e.g. after a wait that timed out, and connects again: a hello it sent on that
        connection may only now have been read); returns whether there were any (their new hellos are then
        waited for, :meth:`_accept_all`)."""
        stale = [peer for peer in self._peers.values()
                 if _connection_given_up(self._control, peer.rank, peer.epoch)]
        for peer in stale:
            self._forget(peer)
            del self._peers[peer.rank]
        return bool(stale)

    def _give_up(self, peer: _Peer) -> None:
        """Tell ``peer``'s rollout that the trainer no longer writes to its connection (it reads that before its
        next update and connects again, :meth:`_connect`)."""
        try:
            _give_up_connection(self._control, peer.rank, peer.epoch)
        except Exception:  # noqa: BLE001 - the store is gone: the rollout finds that instead
            pass

    def _setup_buffers(self, host: str) -> None:
        if self._transport is not None:
            return
        self._device = self.local.bind()  # this rank's device: its index, else LOCAL_RANK's
        in_place = self._kind_value()
        self._buffer_device = self._device if in_place is not None else torch.device("cpu")
        slots = 3 if self.is_sender else 2  # the trainer's send slots, a rollout's receive slots
        self._region = torch.zeros(slots * self.bucket_size, dtype=torch.uint8, device=self._buffer_device)
        self._transport = self.make_transport(host, in_place)
        self._region_info = self._transport.register(self._region)
        if self._membership is not None:
            self._joined_now(self._membership)

    def _slot(self, k: int) -> torch.Tensor:
        """A rollout's receive slot ``k % 2`` (flat ``uint8`` of ``bucket_size``)."""
        return self._region[(k % 2) * self.bucket_size:(k % 2 + 1) * self.bucket_size]

    def _send_slot(self, k: int) -> torch.Tensor:
        """The trainer's send slot ``k % 3`` (flat ``uint8`` of ``bucket_size``, registered memory)."""
        return self._region[(k % 3) * self.bucket_size:(k % 3 + 1) * self.bucket_size]

    def _register_source(self, source: torch.Tensor, msg: Message, offset: int, nbytes: int) -> tuple[int, int]:
        """Register the storage ``source`` lies in, once however many views of it an update sends (two
        overlapping registrations of one memory range are refused by Mooncake); returns its key for
        :meth:`_release_source`.

        Raises:
            TransferError: the library refused; the message names the tensors and the sizes.
        """
        storage = source.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        registered = self._sources.get(key)
        if registered is None:
            whole = torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage, 0, (storage.nbytes(),), (1,))
            try:
                registered = Registered(self._transport.register_source(whole))
            except TransferError as exc:
                if msg.meta.chunk is not None:
                    names = [msg.meta.chunk.name]
                else:
                    names = [e.name for e in msg.meta.entries if offset <= e.offset < offset + nbytes]
                raise TransferError(f"{self._transport.library} refused to register the {storage.nbytes()}-byte "
                                    f"storage (at {key[0]:#x}) holding {', '.join(map(repr, names))} ({nbytes} "
                                    f"bytes of it to send at once): {exc}") from exc
            self._sources[key] = registered
        registered.users += 1
        return key

    def _release_source(self, key: tuple[int, int]) -> None:
        registered = self._sources[key]
        registered.users -= 1
        if registered.users == 0:
            del self._sources[key]
            self._transport.release_source(registered.handle)

    def _sync(self) -> None:
        if self._buffer_device is not None and not hal.is_host(self._buffer_device):
            self.local.synchronize()

    # ---- trainer ----------------------------------------------------------------------------------
    def _trainer_control(self) -> ControlChannel:
        """The trainer's control channel of the current generation (made on first need)."""
        namespace = self._namespace()
        if self._control is None or self._control.namespace != namespace:
            self._drop_connections()
            if self._control is not None:
                self._control.close()
            self._control = ControlChannel(self._store, rank=self.src_rank, namespace=namespace,
                                           timeout=self.timeout, label=self._peer_label,
                                           heartbeat_timeout=self.heartbeat_timeout)
        return self._control

    async def _accept_all(self) -> list[_Peer]:
        """Every rollout's connection: those kept from earlier updates, replaced by a newer one where a rollout
        connected again, and the missing ones waited for (their :class:`Hello`) until ``timeout``."""
        self._host_rendezvous()
        self._setup_buffers(self.master_addr)
        ctl = self._trainer_control()
        want = set(range(1, self.world_size))
        deadline = time.monotonic() + self.timeout
        bucket_sizes: dict[int, Any] = {}
        unusable: dict[int, str] = {}  # a rollout whose last hello could not be used: why (for the timeout's text)
        while set(self._peers) != want or ctl.pending("hello") or self._forget_given_up():
            try:
                hello = await ctl.recv("hello", Hello, None, "hello", max(0.01, deadline - time.monotonic()))
            except PeerFailure as exc:
                if not exc.timed_out:
                    raise
                missing = sorted(want - set(self._peers))
                why = "".join(f"; rollout rank {r}'s last hello could not be used: {unusable[r]}"
                              for r in missing if r in unusable)
                raise TransferTimeoutError(
                    f"the trainer (rank 0 at {self.master_addr}:{self.master_port}) waited {self.timeout:g} s for "
                    f"rollout rank(s) {missing} to connect; they are dead, missing or misconfigured{why}") from None
            old = self._peers.get(hello.rank)
            if hello.rank not in want or (old is not None and hello.epoch <= old.epoch):
                continue  # a stray hello, or one of a connection already replaced
            if _connection_given_up(ctl, hello.rank, hello.epoch):
                continue  # its rollout dropped that connection (and closed its agent): a newer hello follows
            try:
                self._transport.add_peer(hello.rank, hello.transport)
            except (KeyError, TypeError, ValueError, TransferError) as exc:
                unusable[hello.rank] = f"{type(exc).__name__}: {exc}"[:500]
                continue  # a broken hello: wait for a good one until the deadline
            if old is not None:
                self._forget(old)
            self._peers[hello.rank] = _Peer(hello.rank, f"rollout rank {hello.rank} (at {hello.host})", hello.epoch)
            ctl.watch([hello.rank])
            bucket_sizes[hello.rank] = hello.bucket_size
        wrong = {r: n for r, n in bucket_sizes.items() if n != self.bucket_size}
        if wrong:  # the rollouts' slots are laid out for another bucket size: refuse before any byte moves
            text = ", ".join(f"{self._label(r)} has bucket_size={n}" for r, n in sorted(wrong.items()))
            reason = (f"bucket_size mismatch: the trainer (rank 0) lays updates out in buckets of {self.bucket_size} "
                      f"bytes, {text}; build every side with the same bucket_size")
            await self._abort_all(None, reason, fatal=True)  # each rollout refuses too (the record's bucket_size)
            raise CheckpointConfigError(reason)
        return [self._peers[r] for r in sorted(want)]

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Write ``weights`` (iterable of ``(name, tensor)``, any device/dtype/strides) to every rollout,
        tagged ``global_steps``; returns when every rollout acknowledged the whole update.

        Raises:
            CheckpointConfigError: called on a rollout rank, or bad ``global_steps`` / pairs.
            TransferTimeoutError, TransferError: a rollout is dead, stuck or never connected (named).
            Whatever ``weights`` raises: the rollouts are told (:class:`TransferAbortedError`) first.
        """
        global_steps = check_global_steps(global_steps)
        if self._outside(weights):  # a trainer rank that does not send (verl: every rank iterates its shard)
            return
        self._check_sender()
        try:
            peers = await self._accept_all()
            await self._send(peers, weights, global_steps)
        except PeerFailure as exc:
            await self._abort_all(global_steps, f"{exc.peer} failed: {exc}", fatal=True)
            # every rollout connects again with a new agent: a new one here too, so writes this update left
            # running die with the old one, and a long-lived trainer keeps no state of agents that are gone
            # (Mooncake keeps each peer's segment and pooled sockets: +8 fds and MBs over a 150-update soak)
            self._close_transport()
            error = TransferTimeoutError if exc.timed_out else TransferError
            raise error(f"step {global_steps} failed on the trainer: {exc}") from None

    async def _send(self, peers: list[_Peer], weights: Iterable[NamedTensor], step: int | None) -> None:
        for peer in peers:
            peer.sent = peer.acked = 0
        # messages whose writes were started and that are not announced yet, oldest first (at most 2: the
        # slots). A message is announced as soon as its writes are complete, so the rollout consumes it and
        # acknowledges while the next bucket is packed and written: the credit for slot k % 2 (the ack of
        # message k-2) is then normally in before write k starts, and no round trip sits between writes.
        pending: collections.deque = collections.deque()
        k = 0
        try:
            # three local send slots in rotation: the planner copies message k's tensors into slot k % 3 once
            # message k-1 was handed over, and by then message k-3 (which used it) has completed
            for msg in plan_messages(weights, step, self.bucket_size, META_BUDGET, self._buffer_device,
                                     self.direct_threshold, buffer_for=self._send_slot):
                if len(pending) == 2:  # slot k % 2 was message k-2's: its writes must be done first
                    await self._complete(peers, *pending.popleft())
                base = (k % 2) * self.bucket_size  # the rollouts' receive slot k % 2
                pieces, sources = [], []
                for (offset, nbytes, data), source in zip(msg.segment_bytes(), msg.sources):
                    if nbytes == 0:
                        continue
                    if source is not None:  # a run of tensors (or a chunk of one) written from its own storage
                        sources.append(self._register_source(source, msg, offset, nbytes))
                    pieces.append((data.data_ptr(), base + offset, nbytes))
                self._sync()
                while len(pending) >= self._transport.max_in_flight:
                    await self._complete(peers, *pending.popleft())
                handles = []
                pending.append((handles, dataclasses.replace(msg.meta, slot=k % 2), sources))
                if pieces:
                    for peer in peers:
                        await self._credit(peer, k - 1)  # the rollout is done with its slot k % 2
                        handles.append((peer, self._start_write(peer, pieces)))
                msg = None
                k += 1
                while pending and self._written(pending[0][0]):  # announce what is already written
                    await self._complete(peers, *pending.popleft())
            while pending:
                await self._complete(peers, *pending.popleft())
            for peer in peers:
                await self._credit(peer, peer.sent)
        except PeerFailure:
            raise
        except Exception as exc:  # the weights iterator or a pair failed here: tell the rollouts, stay usable
            while pending:
                await self._complete(peers, *pending.popleft())
            for peer in peers:
                self._control.send(peer.queues[0], WireMessage(step, self.bucket_size,
                                                               abort=f"{type(exc).__name__}: {exc}"[:2000]))
                peer.sent += 1
            for peer in peers:
                await self._credit(peer, peer.sent)
            raise

    def _written(self, handles: list) -> bool:
        """Whether every write of a message is complete (a failed one counts: :meth:`_complete` reports it)."""
        for _, handle in handles:
            try:
                if not self._transport.poll(handle):
                    return False
            except TransferError:
                return True
        return True

    def _start_write(self, peer: _Peer, pieces: list[tuple[int, int, int]]) -> Any:
        try:
            return self._transport.start_write(peer.rank, pieces)
        except TransferError as exc:
            raise PeerFailure(peer.label, f"the {self._transport.library} write to {peer.label} could not start: "
                                          f"{exc}") from exc

    async def _complete(self, peers: list[_Peer], handles: list, record: WireMessage, sources: list) -> None:
        """Wait for a message's writes, release the storage registered for them, then announce the message
        to every rollout."""
        ctl = self._control
        try:
            for peer, handle in handles:
                what = f"the {self._transport.library} write of message {peer.sent}"
                try:
                    await self._transport.wait(handle, self.timeout, functools.partial(ctl.check_alive, peer.rank, what))
                except PeerFailure:
                    raise
                except TransferError as exc:
                    raise PeerFailure(peer.label, f"the {self._transport.library} write to {peer.label} failed: {exc}",
                                      isinstance(exc, TransferTimeoutError)) from exc
        finally:
            for source in sources:
                self._release_source(source)
        for peer in peers:
            ctl.send(peer.queues[0], record)
            peer.sent += 1

    async def _credit(self, peer: _Peer, count: int) -> None:
        """Read acknowledgements from ``peer`` until it acknowledged ``count`` messages."""
        while peer.acked < count:
            ack = await self._control.recv(peer.queues[1], Ack, peer.rank,
                                           f"the acknowledgement of message {peer.acked}")
            if ack.index != peer.acked:
                raise PeerFailure(peer.label, f"{peer.label} acknowledged message {ack.index}, expected message "
                                              f"{peer.acked}")
            peer.acked += 1

    async def _abort_all(self, step: int | None, reason: str, fatal: bool) -> None:
        """Tell every rollout still reachable that this update is off, wait (a few seconds at most) until each
        live one took the word (so that a trainer closing next does not take it away with its store), then
        drop every connection."""
        ctl = self._control
        if ctl is None:
            return
        peers = list(self._peers.values())
        for peer in peers:
            if fatal:  # before the abort: a rollout that read the whole update already reads this next time
                self._give_up(peer)
            ctl.send(peer.queues[0], WireMessage(step, self.bucket_size, abort=reason[:2000], fatal=fatal))
        deadline = time.monotonic() + min(self.timeout, 5.0)
        for peer in peers:
            while time.monotonic() < deadline:
                try:
                    ctl.check_alive(peer.rank)
                    if not ctl.pending(peer.queues[0]):
                        break
                except PeerFailure:
                    break
                await asyncio.sleep(0.01)
        self._drop_connections()

    # ---- rollout ----------------------------------------------------------------------------------
    async def _connect(self) -> ControlChannel:
        """The rollout's connection to the trainer: its control channel (the store reached, the buffers
        registered, :class:`Hello` sent), made on first need and after a dropped one.

        A kept connection the trainer gave up (it drops every connection when an update fails, and drains their
        queues) is dropped and made again: a rollout that received that update whole before the trainer gave it
        up (late, but every record still queued) would otherwise wait on a queue no one writes, while the
        trainer waits for its hello, and the next update would fail on both sides after ``timeout``.

        Raises:
            CheckpointConfigError: no trainer address; TransferTimeoutError: the trainer's store did not
            answer within ``timeout``.
        """
        if self._control is not None:
            if not self._given_up():
                return self._control
            self._drop_connections()
        if self.master_addr is None or self.master_port is None:
            raise CheckpointConfigError("a rollout needs master_addr and master_port (the trainer's control "
                                        f"address), got {self.master_addr!r}, {self.master_port!r}")
        store, ctl = await self._open_channel()
        try:
            host = self.host or local_address_towards(self.master_addr)
            self._setup_buffers(host)
            epoch = ctl.add(f"join/{self.rank}", 1)
            if epoch > 1:  # the connection before (a lost client may not have said so): the trainer skips its hello
                _give_up_connection(ctl, self.rank, epoch - 1)
            ctl.watch([self.src_rank])
            ctl.send("hello", Hello(self.rank, epoch, self.bucket_size, self._region_info, host))
        except BaseException:
            ctl.close()
            self._close_transport()  # a hello that went out late must find no agent writing into memory in use
            raise
        self._control, self._store, self._epoch = ctl, store, epoch
        return ctl

    async def _open_channel(self) -> tuple[Any, ControlChannel]:
        """Connect to the trainer's store and open this rollout's control channel, in a worker thread (the store
        may be hosted by a trainer on this very event loop, not up yet; a channel's connections block on a
        stopped host), waited for at most ``timeout + STORE_OVERRUN_S``.

        Raises:
            TransferTimeoutError: the trainer's store did not answer in time (named).
        """
        lock, opened, abandoned = threading.Lock(), [], []

        def open_channel() -> tuple[Any, ControlChannel]:
            store = connect_store(self.master_addr, int(self.master_port), self.timeout, self._label(0))
            ctl = ControlChannel(store, rank=self.rank, namespace=self._namespace(), timeout=self.timeout,
                                 label=self._peer_label, heartbeat_timeout=self.heartbeat_timeout, bounded=True)
            with lock:
                if abandoned:  # the wait below gave up on this thread: nobody else closes the channel
                    ctl.close()
                opened.append(ctl)
            return store, ctl

        try:
            return await asyncio.wait_for(asyncio.to_thread(open_channel), self.timeout + STORE_OVERRUN_S)
        except TransferTimeoutError as exc:
            raise TransferTimeoutError(f"rollout rank {self.rank}: {exc}") from None
        except asyncio.TimeoutError:
            with lock:
                abandoned.append(True)
                for ctl in opened:  # opened just as the wait ended
                    ctl.close()
            raise TransferTimeoutError(f"rollout rank {self.rank}: {self._label(0)}'s store at {self.master_addr}:"
                                       f"{self.master_port} did not answer within {self.timeout + STORE_OVERRUN_S:g} s "
                                       "(is its link down or its host stopped?)") from None

    def _given_up(self) -> bool:
        """Whether the trainer gave this rollout's connection up (:meth:`_give_up`); an unreachable store counts
        as given up (connecting again then names the trainer)."""
        try:
            return _connection_given_up(self._control, self.rank, self._epoch)
        except Exception:  # noqa: BLE001 - a store that does not answer: connect again, which says why
            return True

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of the next update in send order (views: see the class doc).
        ``placement`` is not used: the library writes into this engine's registered slots.

        With ``global_steps=N`` and another step on offer, the update is drained (acknowledged unread) and
        :class:`VersionMismatchError` raised before anything is yielded. A consumer that stops early
        (``aclose()``) drains the rest the same way.

        Raises:
            VersionMismatchError; CheckpointConfigError (called on the trainer); TransferAbortedError (the
            trainer gave this update up); TransferTimeoutError / TransferError (the trainer is dead or
            stuck, named, within ``timeout``).
        """
        asked = check_global_steps(global_steps)
        self._check_receiver()
        k = 0
        done = False
        try:
            ctl = await self._connect()
            messages, acks = _queues(self.rank, self._epoch)

            async def next_record() -> WireMessage:
                record = await ctl.recv(messages, WireMessage, self.src_rank,
                                        f"the metadata of message {k} of the next update")
                if record.bucket_size != self.bucket_size:  # its slots are laid out for another size
                    self._drop_connections()
                    check_bucket_size(record.bucket_size, self.bucket_size, f"rollout rank {self.rank}")
                if record.abort is not None:
                    ctl.send(acks, Ack(k))
                    if record.fatal:
                        self._drop_connections()
                    raise TransferAbortedError(f"the trainer gave up step {record.step} (rollout rank "
                                               f"{self.rank} keeps nothing of it): {record.abort}")
                return record

            record = await next_record()
            try:
                check_step(asked, record.step, f"{type(self).__name__} receive on rollout rank {self.rank}")
            except VersionMismatchError:
                while not record.end:
                    ctl.send(acks, Ack(k))
                    k += 1
                    record = await next_record()
                ctl.send(acks, Ack(k))
                done = True
                raise
            self.received_global_steps = record.step
            big: torch.Tensor | None = None
            while not record.end:
                slot = self._slot(record.slot)
                chunk = record.chunk
                if chunk is None:
                    for e in record.entries:
                        yield e.name, byte_view(slot, e.offset, e.torch_dtype, e.shape)
                else:
                    if chunk.start == 0:
                        if self._large is None or self._large.numel() < chunk.nbytes:
                            self._large = None
                            self._large = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self._buffer_device)
                        big = byte_view(self._large, 0, chunk.torch_dtype, chunk.shape)
                    self._large[chunk.start:chunk.start + chunk.length].copy_(slot[:chunk.length])
                    if chunk.last:
                        self._sync()
                        ctl.send(acks, Ack(k))
                        k += 1
                        record = await next_record()
                        yield chunk.name, big
                        continue
                self._sync()
                ctl.send(acks, Ack(k))
                k += 1
                record = await next_record()
            ctl.send(acks, Ack(k))
            done = True
        except GeneratorExit:  # the consumer stopped early: acknowledge the rest so the trainer finishes
            if not done and self._control is not None:
                try:
                    while not record.end:
                        ctl.send(acks, Ack(k))
                        k += 1
                        record = await ctl.recv(messages, WireMessage, self.src_rank, f"message {k}")
                        if record.abort is not None:
                            break
                    ctl.send(acks, Ack(k))
                except PeerFailure:
                    self._drop_connections()
            raise
        except PeerFailure as exc:
            self._drop_connections()
            error = TransferTimeoutError if exc.timed_out else TransferError
            raise error(f"rollout rank {self.rank}: {exc}") from None
