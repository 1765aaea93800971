"""Broadcast of bucketed weights from one trainer rank to rollout ranks, on the backend ``hal`` gives.

One code path for NCCL (cuda), HCCL (npu, npu-sim) and gloo (cpu). The engine forms its own group from a
rendezvous, separate from any training group, and keeps it across updates (rebuilding a communicator per
update exhausts HCCL). Wire format: :mod:`ckpt.bucket`.

Order and ownership: tensors arrive in send order. ``send_weights`` returns when every broadcast completed;
the caller may then reuse its tensors. A tensor yielded by ``receive_weights`` is a view into an engine-owned
buffer, valid only until the next item is requested, unless it was received into ``placement``'s tensor."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Iterable

import torch

import hal
from ckpt.base import NamedTensor, ReceivePlacement, as_placement, check_global_steps, check_step
from ckpt.bucket import ALIGN, as_bytes, plan_messages
from ckpt.layout import byte_view
from ckpt.errors import CheckpointConfigError, TransferAbortedError, TransferError, TransferTimeoutError
from ckpt.wire import Chunk, Segment, TensorEntry, WireMessage
from ckpt.one_to_many import DEFAULT_BUCKET_SIZE, Membership, OneToManyEngine, check_int
from ckpt.control import ControlChannel, PeerFailure
from ckpt.checker import region_key
from ckpt.outcome import Reports, StoreBoard
from ckpt import multi_sender
from ckpt.reshard.layout import RolloutLayout
from ckpt.reshard.transfer import PairBuffers, Posted, held_or_abort, layouts_by_rank, receive_update, send_update

POLL_S = 0.25  # Seconds between a waiting receiver's looks in the store for word that the sender closed its engine.
NAMESPACE = "ckpt-ctl"  # Prefix of the engine's control keys: ckpt-ctl/<generation>[/s<sender>]/...


@dataclasses.dataclass(frozen=True)
class SenderClosed:
    """The sender's word, under control key ``"closed"``, that it closed its engine."""

    reason: str


class CollectiveCheckpointEngine(OneToManyEngine):
    """Bucketed broadcast from rank ``src_rank`` (the trainer) to every other rank of its own group.

    Built standalone (``rank``, ``world_size``, ``master_addr`` / ``master_port`` or ``store_addr``; rank 0
    hosts the store, on a free port reported by ``prepare()`` when ``master_port`` is left out) or verl's way
    (``bucket_size``, ``is_master``, then the lifecycle; other trainer ranks get rank -1 and only drain). The
    group is kept while the topology is unchanged; a failed one is rebuilt; ``close()`` releases all.
    ``timeout`` (seconds) bounds the rendezvous and every collective. ``meta_capacity``: bytes of the per-message
    metadata record. ``direct_threshold`` (bytes, default ``bucket_size // 8``): tensors this large, and runs of
    tensors back to back in one storage, are broadcast from their own memory. ``multi_sender``: every trainer rank
    sends its own shards (:mod:`ckpt.multi_sender`).

    Memory: the sender holds at most three buckets of ``bucket_size``, a receiver two, allocated on first need
    and kept across updates, plus one buffer for the largest tensor above a bucket when it has no placement.
    Packing bucket k+1 overlaps the transfer of bucket k where collectives are asynchronous."""

    def __init__(self, rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, store_addr: str | None = None, src_rank: int = 0,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, device: str | None = None,
                 timeout: float = hal.DEFAULT_TIMEOUT_S, meta_capacity: int = 64 << 10,
                 direct_threshold: int | None = None, is_master: bool = False, multi_sender: bool = False,
                 rollout_layout: Any = None, **extra: Any) -> None:
        self._check_extra(extra, CollectiveCheckpointEngine.__init__, "__init__")
        check_int(meta_capacity, "meta_capacity", 1024)
        super().__init__(bucket_size=bucket_size, is_master=is_master, rank=rank, world_size=world_size,
                         master_addr=master_addr, master_port=master_port, store_addr=store_addr, src_rank=src_rank,
                         device=device, timeout=timeout, direct_threshold=direct_threshold, multi_sender=multi_sender)
        if self._membership is not None and (self.master_addr is None or (
                self.master_port is None and not self._hosts_store(self._membership))):
            raise CheckpointConfigError("the collective engine needs master_addr and, except on rank 0 sending, "
                                        "master_port (or store_addr='host:port'), got "
                                        f"{self.master_addr!r}, {self.master_port!r}")
        self.meta_capacity = meta_capacity
        self.device: torch.device | None = None
        self._buffers: list[torch.Tensor] = []
        self._metas: list[torch.Tensor] = []
        self._large: torch.Tensor | None = None  # receiver: assembly buffer of tensors larger than a bucket
        self._pending_meta = None  # receiver: the next message's metadata broadcast, posted ahead
        self._store = None  # where it points: self._store_at (the base's)
        self._store_server = False  # self._store is the server (this rank hosts the rendezvous)
        self._control: ControlChannel | None = None  # the control keys of the joined group (no heartbeat)
        self._group: hal.StoreGroup | None = None
        self._broken: str | None = None
        self._lane = ""  # a lane of a multi-sender group: its suffix of the store keys ("/s<sender>")
        self._lanes: list[CollectiveCheckpointEngine] = []  # multi-sender: this rank's lanes (one on a sender)
        self._parts: dict[str, tuple[list[int], int]] = {}  # receiver: the row parts of the current update
        # a rollout rank that keeps only slices of the model (ckpt.reshard), and the buckets of its pairs
        self.rollout_layout = None if rollout_layout is None else RolloutLayout.from_dict(rollout_layout)
        self._pair_buffers = PairBuffers()
        self._reports = Reports(self._label)  # the rollouts' words on each update, on the joined group's store
        self._lane_of: tuple[int, int] | None = None  # a lane: (its sender's trainer rank, senders), for names

    supports_multi_sender = True
    supports_reshard = True  # point-to-point sends over the same group (ckpt.reshard.transfer)
    bytes_cross_a_network = True  # NCCL, HCCL or gloo between the processes
    accepts_repeated_global_steps = True  # a step is checked only against the one asked for
    receives_inside_vllm = True  # the engine hal's vLLM rollout builds in vLLM's worker (tests/vllm)

    # ---- lifecycle (verl's CheckpointEngine ABC: all synchronous; the sequence is the base's) --------
    def _host_rendezvous(self) -> None:
        """Host the rendezvous store once, at ``master_port`` (``None``: a port the kernel picks)."""
        if self._store is not None or (self._membership is not None and self.master_port is not None):
            return
        self._store = self._host_store()  # records self._store_at
        self._store_server = True
        if self._membership is not None:  # standalone: the group now meets where the kernel put the store
            self._set_membership(dataclasses.replace(self._membership, master_port=self.master_port))

    @staticmethod
    def _hosts_store(m: Membership) -> bool:
        """Return whether ``m``'s rank hosts the store and sends, so it may pick the port."""
        return m.rank == 0 == m.src_rank

    def _prepare_buffers(self) -> None:
        if self.rank is not None and self.rank >= 0:
            self._allocate()

    def prepare(self) -> dict[str, Any]:
        out = super().prepare()
        if self.rollout_layout is not None:
            out["rollout_layout"] = self.rollout_layout.to_dict()
        return out

    def is_healthy(self) -> bool:
        if self._lanes:
            return all(lane.is_healthy() for lane in self._lanes)
        return self._group is not None and not self._broken

    def _enter(self, membership: Membership) -> None:
        if membership.senders > 1 and not membership.reshard:
            self._join_lanes(membership)
        else:
            self._close_lanes()
            self._join(membership)

    def _leave(self) -> None:
        self._close_lanes()
        self._release_group(keep_store=self.is_master)
        self._free_buffers()

    # ---- lanes: this class's engines that a multi-sender rank runs, one per sender (ckpt/multi_sender.py) ----
    def join_as_lane(self, suffix: str, store: Any, hosted: bool, store_at: tuple[str, int],
                     membership: Membership, lane_of: tuple[int, int] | None = None) -> None:
        """Join as one lane of a multi-sender rank: keys under ``suffix``, on ``store``, as ``membership``'s rank;
        ``lane_of``: (its sender's trainer rank, senders), to name ranks as the whole group does."""
        self._lane, self._store, self._store_server, self._store_at = suffix, store, hosted, store_at
        self._lane_of = lane_of
        self._set_membership(membership)
        self._join(membership)

    @property
    def group_formed(self) -> bool:
        return self._group is not None

    def received_part(self, name: str) -> tuple[list[int], int] | None:
        """Return tensor ``name``'s row part in the update being received, ``(full_shape, row_start)``, or ``None``."""
        return self._parts.get(name)

    def _close_lanes(self) -> None:
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.close()

    def _join_lanes(self, m: Membership) -> None:
        """Form this rank's lanes of a multi-sender group, joined in sender order."""
        self._bind()
        self._close_lanes()
        self._release_group(keep_store=self._store_at == (m.master_addr, m.master_port) and self._store_server)
        receivers = m.world_size - m.senders
        mine = [m.rank] if m.rank < m.senders else list(range(m.senders))
        lane_rank = 0 if m.rank < m.senders else 1 + m.rank - m.senders
        try:
            for s in mine:
                lane = type(self)(bucket_size=self.bucket_size, device=self.device_kind, timeout=self.timeout,
                                  meta_capacity=self.meta_capacity, direct_threshold=self.direct_threshold)
                if self._store_server and self._store is not None:  # trainer rank 0 hosts the one store
                    store, hosted = self._store, True
                else:
                    store = hal.connect_store(m.master_addr, m.master_port, 1, receivers + 1, self.timeout)
                    hosted = False
                self._lanes.append(lane)  # closed with the others if it fails to join
                if self._reports.promised:
                    lane.promise_reports(arm=False)
                lane.join_as_lane(f"/s{s}", store, hosted, (m.master_addr, m.master_port),
                                  Membership(lane_rank, receivers + 1, m.master_addr, m.master_port, m.generation, 0),
                                  (s, m.senders))
        except hal.DistributedTimeoutError as exc:
            self._close_lanes()
            raise TransferTimeoutError(f"rank {m.rank} could not reach the checkpoint store at "
                                       f"{m.master_addr}:{m.master_port}: {exc}") from exc
        except BaseException:
            self._close_lanes()
            raise
        self._joined_now(m)

    def _join(self, m: Membership) -> None:
        self._bind()  # it may run in a worker thread (asyncio.to_thread): the group forms on this rank's device
        if m.master_port is None:  # a standalone sender told no port, not prepare()d: the kernel picks one now
            if not self._hosts_store(m):
                raise CheckpointConfigError(f"rank {m.rank} of the collective group needs the master_port of the "
                                            f"store rank 0 hosts (only rank 0 sending may leave it out), got None")
            self._host_rendezvous()
            m = dataclasses.replace(m, master_port=self.master_port)
        self._release_group(keep_store=self._store_at == (m.master_addr, m.master_port))
        self._broken = None
        try:
            if self._store is None:
                self._store = hal.connect_store(m.master_addr, m.master_port, m.rank, m.world_size, self.timeout)
                self._store_at, self._store_server = (m.master_addr, m.master_port), m.rank == 0
            self._control = ControlChannel(self._store, rank=m.rank, namespace=f"{NAMESPACE}/{m.generation}{self._lane}",
                                           timeout=self.timeout, label=self._label, heartbeat=False)
            if m.rank == m.src_rank:  # a sender forming this generation again is not closed
                self._control.unset("closed")
            self._control.post_bytes(f"present/{m.rank}", b"1")  # what an init timeout names the missing by
            # a promise is announced before the rendezvous: the sender reads it once the group formed
            self._reports.bind(StoreBoard(self._control), m.rank)
            self._group = hal.new_group_from_store(self._store, m.rank, m.world_size, self.device_kind,
                                                   self.timeout, f"ckpt/{m.generation}{self._lane}")
        except hal.DistributedTimeoutError as exc:
            raise TransferTimeoutError(f"rank {m.rank} could not form the checkpoint group at "
                                       f"{m.master_addr}:{m.master_port}{self._absent(m)}: {exc}") from exc
        self._joined_now(m)

    def _absent(self, m: Membership) -> str:
        """``": <who> did not join within T s"`` for the ranks of ``m`` not at the rendezvous, else ``""``."""
        try:
            absent = [self._label(r) for r in range(m.world_size)
                      if r != m.rank and not self._control.store.check([self._control.key(f"present/{r}")])]
        except Exception:  # noqa: BLE001 - the store itself is gone: the error says so
            return ""
        if not absent:
            return ""
        return f": {', '.join(absent)} did not join within {self.timeout:g} s"

    def _label(self, rank: int) -> str:
        if self._lane_of is None:
            return super()._label(rank)
        sender, senders = self._lane_of
        return f"trainer rank {sender}" if rank == 0 else f"rollout rank {senders - 1 + rank}"

    # ---- the rollouts' words on each update (ckpt.outcome) --------------------------------------
    def promise_reports(self, arm: bool = True) -> bool:
        for lane in self._lanes:
            lane.promise_reports(arm)
        self._reports.promise(arm)
        return True

    def report_outcome(self, error: BaseException | None = None, live: Any = None) -> None:
        for lane in self._lanes:
            lane.report_outcome(error, live)
        if not self._lanes:
            self._reports.report(error, live, self.timeout)

    def _begin_reports(self, step: int | None, receivers: Iterable[int], check: Any):
        return self._reports.begin(list(receivers), step, check)

    def _release_group(self, keep_store: bool) -> None:
        if self._group is not None:
            self._group.close()
        if self._control is not None:
            self._control.close()
        self._group = self._joined = self._control = None
        self._reports.unbind()
        self._pending_meta = None
        if not keep_store:
            self._store = self._store_at = None
            self._store_server = False

    def _allocate(self) -> None:
        """Bind this rank's device and allocate the metadata records (bucket buffers come on first need)."""
        if self._metas:
            return
        self.device = self.local.bind()
        n = 2 if self.is_sender else 1
        self._metas = [torch.zeros(self.meta_capacity, dtype=torch.uint8, device=self.device) for _ in range(n)]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers this engine holds now, every lane's included."""
        held = [*self._buffers, *self._metas] + ([self._large] if self._large is not None else [])
        return (sum(t.numel() * t.element_size() for t in held) + sum(lane.buffer_bytes for lane in self._lanes)
                + self._pair_buffers.nbytes)

    def _free_buffers(self) -> None:
        self._buffers, self._metas, self._large, self._pending_meta = [], [], None, None
        self._pair_buffers = PairBuffers()

    def finalize(self) -> None:
        """Free the assembly buffer; keep the group and the buckets while the topology is unchanged.

        A failed group is released too, so the next update forms a new one."""
        self._large, self._pending_meta = None, None
        for lane in self._lanes:
            lane.finalize()
        if self._lanes and not all(lane.group_formed for lane in self._lanes):
            self._close_lanes()  # a lane failed: the next init_process_group forms the group again
            self._joined = None
        if self._broken:
            self._release_group(keep_store=self._store_server)
            self._free_buffers()
            self._broken = None

    def close(self) -> None:
        """Release buffers, the group and the store; a waiting receiver fails at once with :class:`TransferError`."""
        if self._group is not None and self._joined is not None and self.is_sender and self._control is not None:
            when = (f"in the middle of step {self._sending}" if self._sending is not None else
                    f"after step {self._sent}" if self._sent is not None else "before sending any update")
            try:
                self._control.post("closed", SenderClosed(f"the sender (rank {self.rank}) closed its engine {when}"))
            except Exception:  # noqa: BLE001 - an unreachable store: the receivers find it gone instead
                pass
        self._sending = None
        self._close_lanes()
        self._free_buffers()
        self._release_group(keep_store=False)
        self._broken = None

    async def _ensure_ready(self) -> hal.StoreGroup:
        if self._broken:
            raise TransferError(f"the checkpoint group of rank {self.rank} is unusable after an earlier "
                                f"failure ({self._broken}); call finalize() and set it up again")
        if self._membership is not None and self._membership.senders > 1 and not self._membership.reshard:
            if not self._lanes or self._joined != self._membership:
                await asyncio.to_thread(self._join_lanes, self._membership)
            self._bind()
            return None
        if self._group is None:
            if self._membership is None:
                raise CheckpointConfigError("this collective engine is in no group: call init_process_group(...) "
                                            "with build_topology's entries, or build it with rank, world_size, "
                                            "master_addr and master_port")
            await asyncio.to_thread(self._join, self._membership)
        self._bind()
        self._allocate()
        return self._group

    def _sender_closed(self) -> str | None:
        """Return why the sender is gone, if a receiver can tell from the store, else ``None``."""
        if self.is_sender or self._control is None or self._joined is None:
            return None
        try:
            closed = self._control.peek("closed", SenderClosed)
        except PeerFailure as exc:  # the store's host went away
            if self._store_server:
                return None
            return (f"the sender (rank {self.src_rank}) closed its engine or died: the rendezvous store at "
                    f"{self._store_at[0]}:{self._store_at[1]} (hosted by rank 0) is gone ({exc})")
        return None if closed is None else closed.reason

    async def _wait(self, works: list, what: str) -> None:
        def poll() -> None:
            reason = self._sender_closed()
            if reason is not None:
                raise TransferError(f"{what} failed on rank {self.rank}: {reason}")

        watch = None if self.is_sender else poll
        try:
            for work in works:
                await asyncio.to_thread(work.wait, watch, POLL_S)
        except TransferError as exc:
            self._broken = f"{what}: {exc}"
            raise
        except hal.DistributedTimeoutError as exc:
            self._broken = f"{what}: {exc}"
            reason = await asyncio.to_thread(self._sender_closed)
            if reason is not None:  # the sender's close ended the wait (its sockets closed): say so
                raise TransferError(f"{what} failed on rank {self.rank}: {reason}") from exc
            raise TransferTimeoutError(f"{what} failed on rank {self.rank} within {self.timeout:g} s "
                                       f"(a peer is dead or stuck): {exc}") from exc
        except Exception as exc:
            self._broken = f"{what}: {exc}"
            raise TransferError(f"{what} failed on rank {self.rank}: {type(exc).__name__}: {exc}") from exc

    def _bcast(self, group: hal.StoreGroup, tensor: torch.Tensor):
        try:
            return group.broadcast(tensor, self.src_rank, async_op=True)
        except Exception as exc:
            self._broken = str(exc)
            raise TransferError(f"broadcast failed on rank {self.rank}: {type(exc).__name__}: {exc}") from exc

    # ---- resharding (ckpt.reshard): point-to-point pieces on the same group ----------------------
    @property
    def _resharding(self) -> bool:
        return self._membership is not None and self._membership.reshard

    def _channel(self, group: hal.StoreGroup) -> _GroupChannel:
        return _GroupChannel(self.device, group, self._wait, self._pair_buffers)

    async def _send_resharded(self, weights: Iterable[NamedTensor], global_steps: int | None, check: Any) -> None:
        receivers = range(self.senders, self.world_size)
        layouts = layouts_by_rank(self.rollout_layouts, receivers)
        if check and (self.senders > 1 or any(d is not None for d in layouts.values())):
            raise CheckpointConfigError("check=True: the weight check of rollouts that keep slices (rollout_layout), "
                                        "or of several senders' pieces, is not supported yet; check an update one "
                                        "sender sends to whole-model rollouts")
        # the senders share the group's board: trainer rank 0 alone numbers the update and collects the words
        pending = self._begin_reports(global_steps, receivers if self.rank == 0 else [], check)
        parts = await held_or_abort(self._channel(self._group), self.rank, layouts, weights, global_steps,
                                    self.bucket_size)
        if pending.digester is not None and not pending.outer:
            for local, held in parts:
                whole = all(o == 0 for o in held.region.offsets) and tuple(held.region.sizes) == tuple(held.full_shape)
                key = held.name if whole else region_key(held.name, [(o, o + n) for o, n in
                                                                     zip(held.region.offsets, held.region.sizes)])
                pending.digester.add(key, local, held.region.offsets, held.full_shape)
        self._sending = global_steps
        try:
            await send_update(self._channel(self._group), self.rank, layouts, parts, global_steps,
                              self.bucket_size)
        finally:
            self._sending = None
        self._sent = global_steps
        self.outcomes = await pending.collect(self.timeout)

    # ---- sender ----------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: Any = False) -> None:
        """Broadcast ``weights`` tagged ``global_steps``; return when all is delivered and every reporting rollout
        applied it (:mod:`ckpt.outcome`; ``check``: and serves it, :mod:`ckpt.checker`).

        If ``weights`` raises, the receivers raise :class:`TransferAbortedError` at once and the group stays usable."""
        global_steps = check_global_steps(global_steps)
        if self._outside(weights):  # a trainer rank outside the group: its iterator may need it (FSDP gathers)
            return
        self._check_sender()
        await self._ensure_ready()
        if self._resharding:
            await self._send_resharded(weights, global_steps, check)
            return
        if self._lanes:
            self._sending = global_steps
            try:
                await multi_sender.send_parts(self._lanes[0], weights, global_steps, check)
            finally:
                self._sending = None
                self.outcomes = self._lanes[0].outcomes
            self._sent = global_steps
            return
        await self.send_row_parts(weights, global_steps, None, check)

    async def send_row_parts(self, weights: Iterable[NamedTensor], global_steps: int | None,
                             parts: dict[str, tuple[list[int], int]] | None, check: Any = False) -> None:
        """Run :meth:`send_weights` on a joined one-sender group; ``parts`` maps a row part's name to its place."""
        self._check_sender()
        group = await self._ensure_ready()
        pending = self._begin_reports(global_steps, (r for r in range(self.world_size) if r != self.src_rank), check)
        weights = pending.watch(weights, parts)
        self._sending = global_steps
        in_flight: list[list] = [[], []]
        keep: list[Any] = [None, None]  # each slot's message: holds directly sent tensors until delivered
        count = 0
        try:
            # three send buffers in rotation: the planner copies message k's tensors into buffer k % 3 once
            # message k-1 is posted, and by then message k-3 (which used it) has been waited for
            plan = plan_messages(weights, global_steps, self.bucket_size, self.meta_capacity, self.device,
                                 self.direct_threshold, buffer_for=lambda k: self._slot(k % 3), parts=parts)
            for count, msg in enumerate(plan):
                slot = count % 2
                await self._wait(in_flight[slot], f"message {count - 2} of step {global_steps}")
                meta = self._metas[slot]
                msg.meta.write(meta)
                works = [self._bcast(group, meta)]
                for _offset, _nbytes, source in msg.segment_bytes():
                    works.append(self._bcast(group, source))
                in_flight[slot], keep[slot] = works, msg
        except Exception as exc:
            if self._broken or self._group is not group:  # the transport failed, or close() released it:
                raise                                      # nothing more can be said to the receivers
            # a local failure (the weights iterator raised, a bad pair): tell the receivers, so they raise
            # TransferError now instead of timing out, and the group stays in step for the next update
            for slot in range(2):
                await self._wait(in_flight[slot], f"abort of step {global_steps}")
            slot = (count + 1) % 2
            WireMessage(global_steps, self.bucket_size,
                        abort=f"{type(exc).__name__}: {exc}"[:2000]).write(self._metas[slot])
            await self._wait([self._bcast(group, self._metas[slot])], f"abort of step {global_steps}")
            raise
        for slot in range(2):
            await self._wait(in_flight[slot], f"end of step {global_steps}")
        self._sending, self._sent = None, global_steps
        self.outcomes = await pending.collect(self.timeout)

    # ---- receiver --------------------------------------------------------------------------------
    def _slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        """Return bucket buffer ``index`` of ``nbytes`` (default ``bucket_size``), allocated on first use."""
        nbytes = self.bucket_size if nbytes is None else nbytes
        while len(self._buffers) <= index:
            self._buffers.append(None)
        if self._buffers[index] is None or self._buffers[index].numel() != nbytes:
            self._buffers[index] = None
            self._buffers[index] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[index]

    async def _next_meta(self, group: hal.StoreGroup, step: int | None) -> WireMessage:
        """Return the next message's metadata (its broadcast posted ahead, else now)."""
        pending, self._pending_meta = self._pending_meta, None
        await self._wait([pending or self._bcast(group, self._metas[0])],
                         "metadata broadcast of " + ("the next update" if step is None else f"step {step}"))
        return WireMessage.read(self._metas[0])

    def _placed(self, placement, name: str, dtype: torch.dtype, shape: list[int], nbytes: int,
                item: TensorEntry | Chunk | None = None) -> torch.Tensor | None:
        """Return the consumer's destination for one tensor if the engine can write there, else ``None``."""
        if placement is None or nbytes == 0:
            return None
        if item is not None and item.full_shape is not None:
            if not hasattr(placement, "part_target"):
                return None
            dest = placement.part_target(name, dtype, shape, item.full_shape, item.row_start)
        else:
            dest = placement.target(name, dtype, torch.Size(shape))
        if (not isinstance(dest, torch.Tensor) or dest.dtype != dtype or list(dest.shape) != list(shape)
                or not dest.is_contiguous() or dest.device != self.device or dest.data_ptr() % ALIGN):
            return None
        return dest

    def _segment_target(self, placement, entries: list[TensorEntry], seg: Segment):
        """Return a flat ``uint8`` range of consumer memory a segment can be received into, with its placed tensors.

        Exists when the segment's tensors are placed in one storage at the bucket's relative offsets, with only
        alignment padding between them; else ``(None, None)``."""
        offset, nbytes = seg.offset, seg.nbytes
        inside = sorted((e for e in entries if offset <= e.offset < offset + nbytes and e.nbytes > 0),
                        key=lambda e: e.offset)
        if (placement is None or not inside or inside[0].offset != offset
                or inside[-1].offset + inside[-1].nbytes != offset + nbytes):
            return None, None
        placed, delta, storage, prev_end = {}, None, None, None
        for e in inside:
            name, at, size = e.name, e.offset, e.nbytes
            dest = self._placed(placement, name, e.torch_dtype, e.shape, size, e)
            if dest is None:
                return None, None
            if storage is None:
                storage, delta = dest.untyped_storage(), dest.data_ptr() - at
            elif dest.untyped_storage().data_ptr() != storage.data_ptr() or dest.data_ptr() - at != delta:
                return None, None
            if prev_end is not None and not 0 <= at - prev_end < ALIGN:
                return None, None
            prev_end = at + size
            placed[name] = dest
        start = delta + offset - storage.data_ptr()
        if start < 0 or start + nbytes > storage.nbytes():
            return None, None
        target = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, start, (nbytes,), (1,))
        return target, placed

    def _post_data(self, group: hal.StoreGroup, meta: WireMessage, slot: int, placement, big: dict[str, Any]):
        """Post one message's data broadcasts and the next metadata broadcast; return ``(works, items)``."""
        works, items = [], []
        chunk = meta.chunk
        for item in ([chunk] if chunk is not None else meta.entries):
            if item.full_shape is not None:
                self._parts[item.name] = (item.full_shape, item.row_start)
        if chunk is not None:
            dtype = chunk.torch_dtype
            if chunk.start == 0 or "bytes" not in big:  # a tensor larger than a bucket: into its placement,
                big.clear()                                 # else a reused buffer
                dest = None if chunk.start else self._placed(placement, chunk.name, dtype, chunk.shape, chunk.nbytes,
                                                             chunk)
                if dest is None:
                    if self._large is None or self._large.numel() < chunk.nbytes:
                        self._large = None
                        self._large = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
                    dest = byte_view(self._large, 0, dtype, chunk.shape)
                big["tensor"], big["bytes"] = dest, as_bytes(dest)
            target = big["bytes"][chunk.start:chunk.start + chunk.length]
            works = [self._bcast(group, target[seg.offset:seg.offset + seg.nbytes]) for seg in meta.segments]
            if chunk.last:
                items.append((chunk.name, big.pop("tensor")))
                big.clear()
        elif meta.entries:
            buffer = None
            views: dict[str, torch.Tensor] = {}
            for seg in meta.segments:
                target, placed = self._segment_target(placement, meta.entries, seg)
                if target is None:
                    buffer = self._slot(slot, meta.bucket_size) if buffer is None else buffer
                    target = buffer[seg.offset:seg.offset + seg.nbytes]
                else:
                    views.update(placed)
                works.append(self._bcast(group, target))
            for e in meta.entries:
                if e.name not in views:
                    buffer = self._slot(slot, meta.bucket_size) if buffer is None else buffer
                    views[e.name] = byte_view(buffer, e.offset, e.torch_dtype, e.shape)
                items.append((e.name, views[e.name]))
        if not meta.end and meta.abort is None:
            self._pending_meta = self._bcast(group, self._metas[0])
        return works, items

    async def _finish(self, meta: WireMessage, works: list) -> None:
        await self._wait(works, f"data broadcast of step {meta.step}")
        if meta.abort is not None:
            raise TransferAbortedError(f"the sender aborted step {meta.step} (rank {self.rank} keeps nothing of "
                                       f"it; the group stays usable): {meta.abort}")

    async def _drain(self, group: hal.StoreGroup, meta: WireMessage, works: list, slot: int = 0) -> None:
        """Receive and discard the rest of an update whose message ``meta`` is posted."""
        big: dict[str, Any] = {}
        while True:
            await self._finish(meta, works)
            if meta.end:
                return
            meta = await self._next_meta(group, meta.step)
            slot = 1 - slot
            works, _ = self._post_data(group, meta, slot, None, big)

    def _uses_large(self, meta: WireMessage, placement) -> bool:
        chunk = meta.chunk
        return chunk is not None and self._placed(placement, chunk.name, chunk.torch_dtype, chunk.shape,
                                                  chunk.nbytes, chunk) is None

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the next update's ``(name, tensor)`` pairs in send order, receiving message k+1 while k is read.

        On a step mismatch or an early ``aclose()`` the rest is received and discarded. ``placement`` targets must
        be contiguous, on the engine's device, 64-byte aligned; they are written before the update is complete."""
        global_steps = check_global_steps(global_steps)
        placement = as_placement(placement)
        self._check_receiver()
        group = await self._ensure_ready()
        if self._resharding:
            def on_step(step: int | None) -> None:
                self.received_global_steps = step
                self._reports.take(step)

            stream = receive_update(self._channel(group), self.rank, list(range(self.senders)), self.rollout_layout,
                                    global_steps, placement, on_step)
            try:
                async for item in stream:
                    yield item
            finally:  # an early aclose() drains the rest now, so the group stays in step
                await stream.aclose()
            return
        if self._lanes:
            def agreed(step: int | None) -> None:
                self.received_global_steps = step

            stream = multi_sender.receive_parts(self._lanes, global_steps, placement, self.device or self.local.bind(),
                                                lambda lane, name: lane.received_part(name), agreed)
            try:
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()
            return
        self._parts = {}
        big: dict[str, Any] = {}
        meta: WireMessage | None = None
        works: list = []
        unposted: WireMessage | None = None  # a message whose metadata is read but whose data is not posted
        try:
            meta = await self._next_meta(group, global_steps)
            self._reports.take(meta.step)
            try:
                check_step(global_steps, meta.step, f"collective receive on rank {self.rank}")
            except Exception:
                await self._drain(group, meta, self._post_data(group, meta, 0, None, big)[0])
                raise
            self.received_global_steps = meta.step
            slot = 0
            works, items = self._post_data(group, meta, slot, placement, big)
            while True:
                await self._finish(meta, works)
                works = []
                if meta.end:
                    break
                current = items
                nxt = await self._next_meta(group, meta.step)
                conflict = bool(current) and self._uses_large(nxt, placement) and any(
                    self._large is not None and t.untyped_storage().data_ptr() == self._large.untyped_storage().data_ptr()
                    for _, t in current)
                if conflict:  # k+1 reuses the large-tensor buffer k's tensor lives in: post it after k
                    unposted = nxt
                else:  # post k+1 into the other buffer, then hand out k
                    slot, meta = 1 - slot, nxt
                    works, items = self._post_data(group, meta, slot, placement, big)
                for name, tensor in current:
                    yield name, tensor
                if unposted is not None:
                    slot, meta, unposted = 1 - slot, unposted, None
                    works, items = self._post_data(group, meta, slot, placement, big)
        except GeneratorExit:  # the consumer stopped early (aclose): drain so the group stays in step
            if meta is not None and not self._broken:
                try:
                    if unposted is not None:
                        slot = 1 - slot
                        meta, works = unposted, self._post_data(group, unposted, slot, None, {})[0]
                    await self._drain(group, meta, works, slot)
                except Exception:  # noqa: BLE001 - _wait marked the group broken; nothing more to do
                    pass
            raise
        except TransferError as exc:
            if not isinstance(exc, TransferAbortedError):
                self._broken = self._broken or str(exc)
            raise



class _GroupChannel:
    """The point-to-point side of a collective engine's group, as :mod:`ckpt.reshard.transfer` uses it."""

    def __init__(self, device: torch.device, group: hal.StoreGroup, wait: Any, buffers: PairBuffers) -> None:
        self.device, self.group, self.wait, self.buffers = device, group, wait, buffers  # wait: the engine's, bounded

    def bucket(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffers.get(peer, slot, nbytes, self.device)

    def send_bucket(self, source: torch.Tensor, peer: int, slot: int) -> Any:
        return self.group.send(source, peer)

    def recv_bucket(self, into: torch.Tensor | None, peer: int, slot: int, nbytes: int) -> Any:
        buffer = into if into is not None else self.buffers.get(peer, slot, nbytes, self.device)[:nbytes]
        return Posted(self.group.recv(buffer, peer), buffer, into is not None)

    def release(self, posted: Posted, peer: int, slot: int) -> None:
        pass  # the engine's own buffer: the next receive into it may be posted at once

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        return self.group.send(tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        return self.group.recv(tensor, peer)
