"""Weights over a transfer library (NIXL, Mooncake): one-sided writes into the rollouts' registered buffers.

After verl's NIXL engine, with the library behind a small :class:`Transport`:

* data plane: the trainer packs bucket *k* into one of its registered send slots while the library writes
  bucket *k-1*, and writes each bucket straight into slot ``k % 2`` of every rollout's registered region;
* control plane: :mod:`ckpt.control` over the ``TCPStore`` the trainer hosts at ``master_addr``. A rollout
  sends :class:`Hello`; the trainer sends each message's :class:`ckpt.wire.WireMessage` only after its write
  completed; a rollout acknowledges each message (:class:`ckpt.control.Ack`) once done with its slot, the
  trainer's credit to write that slot again. A failed update gives every connection up; a rollout reads the
  mark before its next update and connects again.

Every wait is bounded by ``timeout``; a dead or hung peer is named within ``heartbeat_timeout`` plus a
heartbeat. A rollout that gets an error keeps serving its previous step."""

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
from ckpt.outcome import Reports, ReportsOnBoard, StoreBoard

META_BUDGET = 1 << 20  # Bytes of JSON metadata per bucket at most (a bucket of many small tensors closes early).
NAMESPACE = "ckpt-p2p"  # Prefix of the engine's store keys: ckpt-p2p/<generation>/...


class Transport(abc.ABC):
    """What an engine needs of a transfer library: registered memory and one-sided writes to peers.

    All methods but :meth:`wait` are synchronous and quick."""

    library = "transfer library"
    addr: int | None = None  # Address of the region register() registered (None before).
    max_in_flight = 1  # Messages whose writes may be in flight at once (1 or 2).

    @abc.abstractmethod
    def register(self, buffer: torch.Tensor) -> dict[str, Any]:
        """Register ``buffer`` (flat ``uint8``); return the JSON-ready description a peer needs to address it."""

    @abc.abstractmethod
    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        """Learn ``peer``'s registered region from its hello; raise :class:`TransferError` if unusable."""

    @abc.abstractmethod
    def register_source(self, tensor: torch.Tensor) -> Any:
        """Register the bytes of ``tensor`` for writes in place; return a handle for :meth:`release_source`."""

    @abc.abstractmethod
    def release_source(self, handle: Any) -> None:
        """Deregister what :meth:`register_source` registered (its writes have completed)."""

    @abc.abstractmethod
    def start_write(self, peer: int, pieces: list[tuple[int, int, int]]) -> Any:
        """Begin writing ``pieces`` ``(local address, offset in the peer's region, nbytes)`` to ``peer``."""

    @abc.abstractmethod
    def poll(self, handle: Any) -> bool:
        """Return whether write ``handle`` is complete, without blocking; raise :class:`TransferError` on failure."""

    async def wait(self, handle: Any, timeout: float, alive: Callable[[], None] | None = None) -> None:
        """Wait until the write completed at the target, calling ``alive()`` between polls.

        Raises :class:`TransferTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.0
        while not self.poll(handle):
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{self.library} write not done within {timeout:g} s")
            await asyncio.sleep(delay)
            delay = min(1e-3, delay * 2 or 2e-5)

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory and release the library's resources; idempotent.

        Once it returns, no write lands in memory this transport registered."""


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rollout's first message on a connection: who it is and what its transport needs.

    ``epoch`` numbers the rank's connections; the trainer keeps the newest and its queues are named by it."""

    rank: int
    epoch: int
    bucket_size: int
    transport: dict[str, Any]
    host: str


def _queues(rank: int, epoch: int) -> tuple[str, str]:
    """Return the control queues of rollout ``rank``'s connection ``epoch``: messages, acks."""
    return f"msg/{rank}/{epoch}", f"ack/{rank}/{epoch}"


def _give_up_connection(ctl: ControlChannel, rank: int, epoch: int) -> None:
    """Mark rollout ``rank``'s connection ``epoch`` given up."""
    ctl.add(f"given-up/{rank}/{epoch}", 1)


def _connection_given_up(ctl: ControlChannel, rank: int, epoch: int) -> bool:
    return ctl.add(f"given-up/{rank}/{epoch}", 0) > 0


@dataclasses.dataclass
class Registered:
    """A storage registered for direct writes, deregistered when the last in-flight message using it completed."""

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


class P2PCheckpointEngine(ReportsOnBoard, OneToManyEngine):
    """Base of the transfer-library engines: bucketed one-sided writes, 1 trainer to N rollouts.

    Built standalone (``rank``, ``world_size``, and the trainer's store at ``master_addr`` / ``master_port`` or
    ``store_addr="host:port"``) or verl's way (``bucket_size``, ``is_master``, then the lifecycle; trainer ranks
    other than the master get ``rank=-1``). The agent, registered slots and connections outlive ``finalize()``
    while the topology is unchanged. Buffers live on the device where the kind's :meth:`in_place_value` says the
    library moves device memory, else in host memory. ``direct_threshold`` (bytes, default ``bucket_size // 8``):
    tensors at least this large are written from their own memory.

    Memory: the trainer holds three slots of ``bucket_size``, a rollout two, plus one buffer the size of a
    tensor larger than a bucket. Both sides need the same ``bucket_size``.
    Ownership: ``send_weights`` returns once every rollout acknowledged every message. A tensor yielded by
    ``receive_weights`` is a view into an engine-owned slot, valid until the next item is requested.
    Failures: a dead rollout fails the send with :class:`TransferError` naming it; the others raise
    :class:`TransferAbortedError` and every connection is dropped. A failing ``weights`` iterator leaves the
    sender usable."""

    @staticmethod
    def in_place_value(spec: hal.DeviceSpec) -> str | None:
        """Return the kind's fact for the library's in-place memory, ``None`` where it stages through host memory."""
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
        self._reports = Reports(self._peer_label, self.src_rank)  # the rollouts' words, on the control keys

    # ---- the library ------------------------------------------------------------------------------
    @classmethod
    def availability(cls) -> hal.Availability:
        raise NotImplementedError

    @abc.abstractmethod
    def make_transport(self, host: str, in_place: str | None) -> Transport:
        """Return the library's transport, reachable at ``host``; ``in_place`` is the kind's value or ``None``."""

    # ---- configuration ----------------------------------------------------------------------------
    def _kind_value(self) -> str | None:
        return self.in_place_value(self.local.spec)

    # ---- lifecycle --------------------------------------------------------------------------------
    def _host_rendezvous(self) -> None:
        """On the trainer: host the control store (once) at ``master_addr:master_port``."""
        if self._store is None or self._store_moved():
            self._store = None  # the old one stops first: the new one may take its port
            self._store = self._host_store()

    def _namespace(self) -> str:
        return f"{NAMESPACE}/{self._membership.generation if self._membership is not None else 0}"

    def _peer_label(self, rank: int) -> str:
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
        """Free the buffer of a tensor larger than a bucket; the agent, slots and connections are kept."""
        self._large = None

    def close(self) -> None:
        """Drop every connection, stop the trainer's store, free the buffers; idempotent."""
        self._release()
        self._store = None

    def _release(self) -> None:
        """Drop the connections, the control channel, the agent and the buffers (the trainer's store stays)."""
        self._drop_connections()
        if self._control is not None:
            self._control.close()
            self._control = None
        self._close_transport()
        self._large = None
        self._joined = None

    def _close_transport(self) -> None:
        """Close the agent, then free its region, so no write lands there afterwards."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._region = None
        self._sources = {}

    def _drop_connections(self) -> None:
        """Forget every rollout's connection, or on a rollout the connection to the trainer."""
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
            self._reports.unbind()
            # a failed update's write may still arrive (a cut link retransmits): new agent and slots next time
            self._close_transport()

    def _forget(self, peer: _Peer) -> None:
        if self._control is not None:
            self._give_up(peer)
            for queue in peer.queues:
                self._control.drain(queue)
            self._control.unwatch([peer.rank])

    def _forget_given_up(self) -> bool:
        """Forget kept connections given up since accepted; return whether there were any."""
        stale = [peer for peer in self._peers.values()
                 if _connection_given_up(self._control, peer.rank, peer.epoch)]
        for peer in stale:
            self._forget(peer)
            del self._peers[peer.rank]
        return bool(stale)

    def _give_up(self, peer: _Peer) -> None:
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
        return self._region[(k % 2) * self.bucket_size:(k % 2 + 1) * self.bucket_size]

    def _send_slot(self, k: int) -> torch.Tensor:
        return self._region[(k % 3) * self.bucket_size:(k % 3 + 1) * self.bucket_size]

    def _register_source(self, source: torch.Tensor, msg: Message, offset: int, nbytes: int) -> tuple[int, int]:
        """Register the storage ``source`` lies in, once per update; return its key for :meth:`_release_source`."""
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
        namespace = self._namespace()
        if self._control is None or self._control.namespace != namespace:
            self._drop_connections()
            if self._control is not None:
                self._control.close()
            self._control = ControlChannel(self._store, rank=self.src_rank, namespace=namespace,
                                           timeout=self.timeout, label=self._peer_label,
                                           heartbeat_timeout=self.heartbeat_timeout)
            self._reports.bind(StoreBoard(self._control), self.src_rank)
        return self._control

    async def _accept_all(self) -> list[_Peer]:
        """Return every rollout's connection: kept ones, newer ones, and missing ones waited for until ``timeout``."""
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

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: Any = False) -> None:
        """Write ``weights`` to every rollout, tagged ``global_steps``; return once every rollout acknowledged it and
        every reporting one applied it (:mod:`ckpt.outcome`; ``check``: and serves it, :mod:`ckpt.checker`).

        If ``weights`` raises, the rollouts are told (:class:`TransferAbortedError`) first."""
        global_steps = check_global_steps(global_steps)
        if self._outside(weights):  # a trainer rank that does not send (verl: every rank iterates its shard)
            return
        self._check_sender()
        try:
            peers = await self._accept_all()
            pending = self._reports.begin([p.rank for p in peers], global_steps, check)
            await self._send(peers, pending.watch(weights), global_steps)
        except PeerFailure as exc:
            await self._abort_all(global_steps, f"{exc.peer} failed: {exc}", fatal=True)
            # the rollouts reconnect with new agents: a new one here too, so this update's writes die with it
            self._close_transport()
            error = TransferTimeoutError if exc.timed_out else TransferError
            raise error(f"step {global_steps} failed on the trainer: {exc}") from None
        self.outcomes = await pending.collect(self.timeout)

    async def _send(self, peers: list[_Peer], weights: Iterable[NamedTensor], step: int | None) -> None:
        for peer in peers:
            peer.sent = peer.acked = 0
        # messages written but not yet announced, oldest first (at most 2: the rollouts' slots)
        pending: collections.deque = collections.deque()
        k = 0
        try:
            # three send slots in rotation: message k-3, which used slot k % 3, has completed by now
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
        """Wait for a message's writes, release their sources, then announce the message to every rollout."""
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
        while peer.acked < count:
            ack = await self._control.recv(peer.queues[1], Ack, peer.rank,
                                           f"the acknowledgement of message {peer.acked}")
            if ack.index != peer.acked:
                raise PeerFailure(peer.label, f"{peer.label} acknowledged message {ack.index}, expected message "
                                              f"{peer.acked}")
            peer.acked += 1

    async def _abort_all(self, step: int | None, reason: str, fatal: bool) -> None:
        """Tell every reachable rollout the update is off, wait a few seconds for each to take it, drop connections."""
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
        """Return the rollout's control channel to the trainer, connecting (and sending :class:`Hello`) when needed.

        A kept connection the trainer gave up is made again."""
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
            self._reports.bind(StoreBoard(ctl), self.rank)  # a promise before the hello: read once it is accepted
            ctl.send("hello", Hello(self.rank, epoch, self.bucket_size, self._region_info, host))
        except BaseException:
            ctl.close()
            self._close_transport()  # a hello that went out late must find no agent writing into memory in use
            raise
        self._control, self._store, self._epoch = ctl, store, epoch
        return ctl

    async def _open_channel(self) -> tuple[Any, ControlChannel]:
        """Connect to the trainer's store in a worker thread, waiting at most ``timeout + STORE_OVERRUN_S``."""
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
        """Return whether the trainer gave this connection up; an unreachable store counts as given up."""
        try:
            return _connection_given_up(self._control, self.rank, self._epoch)
        except Exception:  # noqa: BLE001 - a store that does not answer: connect again, which says why
            return True

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the next update's ``(name, tensor)`` pairs in send order, as views (``placement`` is not used).

        On a step mismatch or an early ``aclose()`` the rest is acknowledged unread."""
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
            self._reports.take(record.step)
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
