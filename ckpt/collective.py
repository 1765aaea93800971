"""Broadcast of bucketed weights from one trainer rank to rollout ranks, on the backend ``hal`` gives.

One code path for NCCL (cuda), HCCL (npu, and the simulated npu) and gloo (cpu): the engine asks ``hal``
for the device (``hal.get_device(kind)``) and forms its own group from a rendezvous
(``hal.connect_store`` + ``hal.new_group_from_store``), separate from any training group, kept across
updates (rebuilding a communicator per update exhausts HCCL resources). Wire format: :mod:`ckpt.bucket`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterable

import torch

import hal
from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, check_step
from ckpt.bucket import byte_view, decode_meta, dtype_from_name, encode_meta, pack, plan_messages
from ckpt.errors import CheckpointConfigError, TransferAbortedError, TransferError, TransferTimeoutError

DEFAULT_BUCKET_SIZE = 256 << 20
"""Default bucket size in bytes (256 MiB)."""


class CollectiveCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast from rank ``src_rank`` (the trainer) to every other rank of its own group.

    Args:
        rank, world_size: this process's place in the checkpoint group (trainer + rollout ranks).
        master_addr, master_port: the rendezvous store (hosted by rank 0); or ``store_addr="host:port"``.
        src_rank: the sending rank (default 0).
        bucket_size: bytes per bucket; bounds memory (see below).
        device: kind name (``"cpu"``, ``"npu-sim"``, ...) or ``None`` for hal's resolution.
        timeout: seconds for the rendezvous and for every collective; a dead or stuck peer becomes a
            :class:`TransferTimeoutError` / :class:`TransferError` within it, never a hang.
        meta_capacity: bytes of the per-message metadata record (a bucket closes early when it is full).
        direct_threshold: contiguous tensors on the transfer device of at least this many bytes are
            broadcast from their own storage instead of being copied into a bucket, as are runs of
            tensors lying back to back in one storage (default ``bucket_size // 8``; 0 packs everything).

    Lifecycle: ``prepare()`` allocates (and touches) the buffers, ``build_topology()`` fixes the roles,
    ``init_process_group()`` joins the group; the first ``send_weights`` / ``receive_weights`` runs any of
    them not yet run. ``finalize()`` closes the group and frees the buffers.

    Order: tensors arrive in the order the sender's iterable produced them.

    Overlap: every broadcast is issued asynchronously and waited on (off the event loop) only when its
    buffer is needed again, so packing bucket k+1 overlaps the transfer of bucket k on backends with
    asynchronous collectives (gloo, NCCL, HCCL); the receiver posts the next message's metadata broadcast
    before waiting for the current data. A backend whose collectives complete before returning (the
    simulated npu's hccl) runs the same code serially.

    Memory: the sender holds two send buffers of ``bucket_size`` (bucket k+1 is packed while bucket k is
    in flight) plus references to at most two buckets' worth of directly sent tensors; a receiver holds one
    buffer of ``bucket_size``. A tensor larger than a bucket is split into chunks of ``bucket_size``
    (sent from its own storage when contiguous, else a block of rows at a time through the send buffer);
    the receiver assembles it in one more buffer of the largest such tensor's size, kept across updates
    (its size is unavoidable: the receiver is handed that tensor whole). Runs of tensors adjacent in one
    storage of at least ``direct_threshold`` bytes are broadcast from that storage, without packing.

    Ownership: ``send_weights`` returns when every broadcast has completed; the caller may then reuse or
    free its tensors. Every tensor yielded by ``receive_weights`` is a **view into an engine-owned buffer,
    valid only until the next item is requested**: copy it (``param.copy_(t)``, as a rollout's
    ``load_weights`` does) before advancing if it must outlive that.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str | None = None, master_port: int | None = None,
                 store_addr: str | None = None, src_rank: int = 0, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 device: str | None = None, timeout: float = hal.DEFAULT_TIMEOUT_S, meta_capacity: int = 64 << 10,
                 direct_threshold: int | None = None) -> None:
        if store_addr is not None:
            host, sep, port = store_addr.rpartition(":")
            if not sep or not port.isdigit():
                raise CheckpointConfigError(f"store_addr must be 'host:port', got {store_addr!r}")
            master_addr, master_port = host, int(port)
        if master_addr is None or master_port is None:
            raise CheckpointConfigError("the collective engine needs master_addr and master_port "
                                        f"(or store_addr='host:port'), got {master_addr!r}, {master_port!r}")
        for label, value, low in (("world_size", world_size, 1), ("bucket_size", bucket_size, 1),
                                  ("meta_capacity", meta_capacity, 1024)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CheckpointConfigError(f"{label} must be an int >= {low}, got {value!r}")
        for label, value in (("rank", rank), ("src_rank", src_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
                raise CheckpointConfigError(f"{label} must be an int in [0, {world_size}), got {value!r}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise CheckpointConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank, self.world_size, self.src_rank = rank, world_size, src_rank
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.bucket_size, self.meta_capacity, self.timeout = bucket_size, meta_capacity, float(timeout)
        self.direct_threshold = bucket_size // 8 if direct_threshold is None else int(direct_threshold)
        self.device_kind = device
        self.device: torch.device | None = None
        self.is_sender = rank == src_rank
        self._buffers: list[torch.Tensor] = []
        self._metas: list[torch.Tensor] = []
        self._large: torch.Tensor | None = None  # receiver: assembly buffer of tensors larger than a bucket
        self._pending_meta = None  # receiver: the next message's metadata broadcast, posted ahead
        self._store = None
        self._group: hal.StoreGroup | None = None
        self._topology: dict[str, Any] | None = None
        self._broken: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Allocate the buffers on ``hal.get_device(device)``: 2 x ``bucket_size`` bytes on the sender,
        1 x on a receiver, plus as many ``meta_capacity`` records; zero-filled so pages are touched now."""
        if self._buffers:
            return
        self.device = hal.get_device(self.device_kind)
        n = 2 if self.is_sender else 1
        self._buffers = [torch.zeros(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self._metas = [torch.zeros(self.meta_capacity, dtype=torch.uint8, device=self.device) for _ in range(n)]

    async def build_topology(self) -> dict[str, Any]:
        """Roles: ``{"rank", "world_size", "src_rank", "role": "sender" | "receiver", "receivers": [...]}``."""
        self._topology = {"rank": self.rank, "world_size": self.world_size, "src_rank": self.src_rank,
                          "role": "sender" if self.is_sender else "receiver",
                          "receivers": [r for r in range(self.world_size) if r != self.src_rank]}
        return self._topology

    async def init_process_group(self) -> None:
        """Join the checkpoint group (store at ``master_addr:master_port``, the kind's backend); idempotent.

        Raises:
            TransferTimeoutError: the store or a peer did not come within ``timeout``.
        """
        if self._group is not None:
            return
        try:
            self._store = await asyncio.to_thread(hal.connect_store, self.master_addr, self.master_port,
                                                  self.rank, self.world_size, self.timeout)
            self._group = await asyncio.to_thread(hal.new_group_from_store, self._store, self.rank,
                                                  self.world_size, self.device_kind, self.timeout, "ckpt")
        except hal.DistributedTimeoutError as exc:
            raise TransferTimeoutError(f"rank {self.rank} could not form the checkpoint group at "
                                       f"{self.master_addr}:{self.master_port}: {exc}") from exc

    async def finalize(self) -> None:
        """Close the group and free the buffers; the engine can be set up again afterwards."""
        if self._group is not None:
            self._group.close()
        self._group = self._store = self._topology = None
        self._buffers, self._metas, self._large, self._broken, self._pending_meta = [], [], None, None, None

    async def _ensure_ready(self) -> hal.StoreGroup:
        if self._broken:
            raise TransferError(f"the checkpoint group of rank {self.rank} is unusable after an earlier "
                                f"failure ({self._broken}); call finalize() and set it up again")
        await self.prepare()
        if self._topology is None:
            await self.build_topology()
        await self.init_process_group()
        return self._group

    async def _wait(self, works: list, what: str) -> None:
        try:
            for work in works:
                await asyncio.to_thread(work.wait)
        except hal.DistributedTimeoutError as exc:
            self._broken = f"{what}: {exc}"
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

    # ---- sender ----------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Broadcast ``weights`` (iterable of ``(name, tensor)``, any device/dtype/strides) tagged ``global_steps``.

        Bucket k+1 is packed while bucket k is broadcast (two send buffers). Returns when all is delivered.

        Raises:
            CheckpointConfigError: called on a receiving rank, or bad ``global_steps``/pairs.
            TransferTimeoutError, TransferError: a receiver died or stalled (within ``timeout``).
            Whatever ``weights`` raises: the receivers are told (they raise :class:`TransferAbortedError` at once)
            and the group stays usable for the next update.
        """
        global_steps = check_global_steps(global_steps)
        if not self.is_sender:
            raise CheckpointConfigError(f"send_weights called on rank {self.rank}, but src_rank is {self.src_rank}")
        group = await self._ensure_ready()
        in_flight: list[list] = [[], []]
        keep: list[Any] = [None, None]  # each slot's message: holds directly sent tensors until delivered
        count = 0
        try:
            for count, msg in enumerate(plan_messages(weights, global_steps, self.bucket_size, self.meta_capacity,
                                                      self.device, self.direct_threshold)):
                slot = count % 2
                await self._wait(in_flight[slot], f"message {count - 2} of step {global_steps}")
                buffer, meta = self._buffers[slot], self._metas[slot]
                pack(msg, buffer)
                encode_meta(msg.meta, meta)
                works = [self._bcast(group, meta)]
                for (offset, nbytes), source in zip(msg.meta["segments"] if "segments" in msg.meta else [], msg.sources):
                    works.append(self._bcast(group, buffer[offset:offset + nbytes] if source is None else source))
                in_flight[slot], keep[slot] = works, msg
        except Exception as exc:
            if self._broken:  # the transport failed: nothing more can be said to the receivers
                raise
            # a local failure (the weights iterator raised, a bad pair): tell the receivers, so they raise
            # TransferError now instead of timing out, and the group stays in step for the next update
            for slot in range(2):
                await self._wait(in_flight[slot], f"abort of step {global_steps}")
            slot = (count + 1) % 2
            encode_meta({"step": global_steps, "abort": f"{type(exc).__name__}: {exc}"[:2000]}, self._metas[slot])
            await self._wait([self._bcast(group, self._metas[slot])], f"abort of step {global_steps}")
            raise
        for slot in range(2):
            await self._wait(in_flight[slot], f"end of step {global_steps}")

    # ---- receiver --------------------------------------------------------------------------------
    async def _receive_message(self, group: hal.StoreGroup, dest_for) -> dict[str, Any]:
        """Receive one message: its metadata (posted ahead by the previous call), then its segments into
        ``dest_for(meta)``. The next message's metadata broadcast is posted before waiting for this one's
        data, so its round trip overlaps the data transfer and the consumer's work."""
        meta_buf = self._metas[0]
        pending, self._pending_meta = self._pending_meta, None
        await self._wait([pending or self._bcast(group, meta_buf)], "metadata broadcast")
        meta = decode_meta(meta_buf)
        dest = dest_for(meta)
        works = [self._bcast(group, dest[o:o + n]) for o, n in meta.get("segments", [])]
        if not meta.get("end") and "abort" not in meta:
            self._pending_meta = self._bcast(group, meta_buf)
        await self._wait(works, f"data broadcast of step {meta.get('step')}")
        if "abort" in meta:
            raise TransferAbortedError(f"the sender aborted step {meta.get('step')} (rank {self.rank} keeps nothing of "
                                f"it; the group stays usable): {meta['abort']}")
        return meta

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of the next update, in send order (see the class docstring for
        buffer ownership). With ``global_steps=N`` and another step on offer, the whole update is received
        and discarded (the group stays in step) and :class:`VersionMismatchError` is raised, before
        anything is yielded. A consumer that stops early (``aclose()``) drains the rest the same way.

        Raises:
            VersionMismatchError, CheckpointConfigError (called on the sending rank),
            TransferTimeoutError / TransferError (the sender died or stalled, within ``timeout``; or its
            weights iterator failed mid-update, in which case the group stays usable).
        """
        global_steps = check_global_steps(global_steps)
        if self.is_sender:
            raise CheckpointConfigError(f"receive_weights called on rank {self.rank}, the sending rank")
        group = await self._ensure_ready()
        buffer = self._buffers[0]
        big: dict[str, Any] = {}

        def dest_for(meta: dict[str, Any]) -> torch.Tensor:
            chunk = meta.get("chunk")
            if chunk is None:
                return buffer
            if chunk["start"] == 0:  # a tensor larger than a bucket: assembled in a reused buffer
                if self._large is None or self._large.numel() < chunk["nbytes"]:
                    self._large = None
                    self._large = torch.empty(chunk["nbytes"], dtype=torch.uint8, device=self.device)
                big["tensor"] = byte_view(self._large, 0, dtype_from_name(chunk["dtype"]), chunk["shape"])
            return self._large[chunk["start"]:chunk["nbytes"]]

        meta: dict[str, Any] | None = None
        try:
            meta = await self._receive_message(group, dest_for)
            try:
                check_step(global_steps, meta.get("step"), f"collective receive on rank {self.rank}")
            except Exception:
                while not meta.get("end"):  # drain the update so the group stays in step
                    meta = await self._receive_message(group, dest_for)
                raise
            self.received_global_steps = meta.get("step")
            while not meta.get("end"):
                chunk = meta.get("chunk")
                if chunk is None:
                    for name, dtype, shape, offset, _nbytes in meta["entries"]:
                        yield name, byte_view(buffer, offset, dtype_from_name(dtype), shape)
                elif chunk["start"] + chunk["length"] == chunk["nbytes"]:
                    out = big.pop("tensor")
                    big.clear()
                    yield chunk["name"], out
                meta = await self._receive_message(group, dest_for)
        except GeneratorExit:  # the consumer stopped early (aclose): drain so the group stays in step
            if meta is not None and not self._broken:
                try:
                    while not meta.get("end"):
                        meta = await self._receive_message(group, dest_for)
                except Exception:  # noqa: BLE001 - _wait marked the group broken; nothing more to do
                    pass
            raise
        except TransferError as exc:
            if not isinstance(exc, TransferAbortedError):
                self._broken = self._broken or str(exc)
            raise
