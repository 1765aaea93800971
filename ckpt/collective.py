"""Broadcast of bucketed weights from one trainer rank to rollout ranks, on the backend ``hal`` gives.

One code path for NCCL (cuda), HCCL (npu, and the simulated npu) and gloo (cpu): the engine asks ``hal``
for this rank's device (``hal.bind_local_device(kind)``) and forms its own group from a rendezvous
(``hal.connect_store`` + ``hal.new_group_from_store``), separate from any training group, kept across
updates (rebuilding a communicator per update exhausts HCCL resources). Wire format: :mod:`ckpt.bucket`.
"""

from __future__ import annotations

import asyncio
import socket
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

    Two ways to build one:

    * hal's standalone use: ``rank``, ``world_size`` and ``master_addr``/``master_port`` (or
      ``store_addr="host:port"``; rank 0 hosts the store) up front; the first ``send_weights`` /
      ``receive_weights`` joins the group.
    * verl's: ``CollectiveCheckpointEngine(bucket_size=..., is_master=..., **engine_kwargs)``, then per
      update ``prepare()`` (the master hosts the store and reports where), the classmethod
      ``build_topology(trainer_world_size, rollout_world_size, metadata)``, ``init_process_group(**one
      rank's entries)``, the transfer, ``finalize()``. Trainer rank 0 sends; other trainer ranks get
      rank -1 (their ``send_weights`` only drains the iterator).

    Either way the communicator is formed once and **kept while the topology is unchanged**
    (``finalize()`` frees only the buffers; rebuilding a communicator per update exhausts HCCL); a changed
    topology forms a new generation of the group, and a failed one is rebuilt. ``close()`` releases all.

    Args:
        rank, world_size: this process's place in the checkpoint group (trainer + rollout ranks).
        master_addr, master_port: the rendezvous store (hosted by rank 0); or ``store_addr="host:port"``.
            With ``is_master`` and no rank, the store's host name and port (``None``: this host, a free port).
        src_rank: the sending rank (default 0).
        bucket_size: bytes per bucket; bounds memory (see below).
        device: kind name (``"cpu"``, ``"npu-sim"``, ...) or ``None`` for hal's resolution.
        timeout: seconds for the rendezvous and for every collective; a dead or stuck peer becomes a
            :class:`TransferTimeoutError` / :class:`TransferError` within it, never a hang.
        meta_capacity: bytes of the per-message metadata record (a bucket closes early when it is full).
        direct_threshold: contiguous tensors on the transfer device of at least this many bytes are
            broadcast from their own storage instead of being copied into a bucket, as are runs of
            tensors lying back to back in one storage (default ``bucket_size // 8``; 0 packs everything).
        is_master: this is verl's trainer rank 0 (hosts the store, sends).

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

    def __init__(self, rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, store_addr: str | None = None, src_rank: int = 0,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, device: str | None = None,
                 timeout: float = hal.DEFAULT_TIMEOUT_S, meta_capacity: int = 64 << 10,
                 direct_threshold: int | None = None, is_master: bool = False) -> None:
        if store_addr is not None:
            host, sep, port = store_addr.rpartition(":")
            if not sep or not port.isdigit():
                raise CheckpointConfigError(f"store_addr must be 'host:port', got {store_addr!r}")
            master_addr, master_port = host, int(port)
        for label, value, low in (("bucket_size", bucket_size, 1), ("meta_capacity", meta_capacity, 1024)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CheckpointConfigError(f"{label} must be an int >= {low}, got {value!r}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise CheckpointConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if master_port is not None and (isinstance(master_port, bool) or not isinstance(master_port, int)
                                        or not 0 <= master_port < 65536):
            raise CheckpointConfigError(f"master_port must be an int in [0, 65536), got {master_port!r}")
        self.master_addr, self.master_port = master_addr, master_port
        self.bucket_size, self.meta_capacity, self.timeout = bucket_size, meta_capacity, float(timeout)
        self.direct_threshold = bucket_size // 8 if direct_threshold is None else int(direct_threshold)
        self.device_kind = device
        self.device: torch.device | None = None
        self.is_master = bool(is_master)
        self.rank, self.world_size, self.src_rank = None, None, 0
        self._membership: dict[str, Any] | None = None  # the group this engine is to be in (None: not yet told)
        if rank is not None or world_size is not None:  # hal's standalone construction: the group is known now
            if master_addr is None or master_port is None:
                raise CheckpointConfigError("the collective engine needs master_addr and master_port "
                                            f"(or store_addr='host:port'), got {master_addr!r}, {master_port!r}")
            self._membership = self._checked_membership(rank, world_size, master_addr, master_port, 0, src_rank)
            self._set_role(self._membership)
        self._buffers: list[torch.Tensor] = []
        self._metas: list[torch.Tensor] = []
        self._large: torch.Tensor | None = None  # receiver: assembly buffer of tensors larger than a bucket
        self._pending_meta = None  # receiver: the next message's metadata broadcast, posted ahead
        self._store = None
        self._store_at: tuple[str, int] | None = None  # where self._store points
        self._group: hal.StoreGroup | None = None
        self._joined: dict[str, Any] | None = None  # the membership self._group was formed with
        self._generation = 0  # the highest group generation this engine formed (the master's numbers them)
        self._broken: str | None = None

    @staticmethod
    def _checked_membership(rank: Any, world_size: Any, master_addr: Any, master_port: Any, generation: Any,
                            src_rank: Any = 0) -> dict[str, Any]:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CheckpointConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        for label, value in (("rank", rank), ("src_rank", src_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
                raise CheckpointConfigError(f"{label} must be an int in [0, {world_size}), got {value!r}")
        if not isinstance(master_addr, str) or not master_addr:
            raise CheckpointConfigError(f"master_addr must be a host name or address, got {master_addr!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise CheckpointConfigError(f"master_port must be an int in (0, 65536), got {master_port!r}")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise CheckpointConfigError(f"generation must be an int >= 0, got {generation!r}")
        return {"rank": rank, "world_size": world_size, "master_addr": master_addr, "master_port": master_port,
                "generation": generation, "src_rank": src_rank}

    def _set_role(self, membership: dict[str, Any] | None) -> None:
        if membership is None:  # a trainer rank outside the group (verl gives it rank -1)
            self.rank, self.world_size, self.src_rank, self.is_sender = -1, None, 0, False
            return
        self.rank, self.world_size = membership["rank"], membership["world_size"]
        self.src_rank = membership["src_rank"]
        self.is_sender = self.rank == self.src_rank

    @property
    def topology(self) -> dict[str, Any] | None:
        """This rank's place: ``{"rank", "world_size", "src_rank", "role", "receivers"}``; ``None`` before
        the group is known; ``role`` is ``"sender"``, ``"receiver"`` or ``"outside"`` (rank -1)."""
        if self.rank is None:
            return None
        if self.rank < 0:
            return {"rank": -1, "world_size": None, "src_rank": self.src_rank, "role": "outside", "receivers": []}
        return {"rank": self.rank, "world_size": self.world_size, "src_rank": self.src_rank,
                "role": "sender" if self.is_sender else "receiver",
                "receivers": [r for r in range(self.world_size) if r != self.src_rank]}

    # ---- lifecycle (verl's CheckpointEngine ABC: all synchronous) ---------------------------------
    def prepare(self) -> dict[str, Any]:
        """Allocate this update's buffers (once the role is known) and describe this worker.

        The master (``is_master=True``, verl's trainer rank 0) hosts the rendezvous store here, once, at
        ``master_port`` (``None``: a free port) and reports where it is. Every worker reports the group it
        is in, so :meth:`build_topology` can keep it.

        Returns:
            ``{"is_master", "master_addr", "master_port", "generation", "joined"}``; ``joined`` is the
            membership of the group this engine holds (``None``: none, or it broke).
        """
        if self.is_master and self._membership is None and self._store is None:
            addr = self.master_addr or _host_address()
            try:
                self._store = hal.connect_store(addr, self.master_port or 0, 0, 1, self.timeout)
            except hal.DistributedTimeoutError as exc:
                raise TransferTimeoutError(f"the master could not host the checkpoint store: {exc}") from exc
            self.master_addr, self.master_port = addr, int(self._store.port)
            self._store_at = (addr, self.master_port)
        if self.rank is not None and self.rank >= 0:
            self._allocate()
        joined = dict(self._joined) if self._group is not None and not self._broken else None
        return {"is_master": self.is_master or (self._membership is not None and self._membership["rank"] == 0),
                "master_addr": self.master_addr, "master_port": self.master_port,
                "generation": self._generation, "joined": joined}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """One sender (trainer rank 0) and every rollout rank; other trainer ranks stay outside (rank -1).

        The group is kept when every member already holds exactly it (same ranks, world size, store and
        generation); otherwise a new generation is formed (its keys are new, so nothing stale is read).

        Args:
            metadata: :meth:`prepare` results, trainer ranks first; ``metadata[0]`` is the master's.

        Returns:
            ``(trainer_kwargs, rollout_kwargs)`` with per-rank lists for ``rank``, ``world_size``,
            ``master_addr``, ``master_port`` and ``generation``.

        Raises:
            CheckpointConfigError: bad sizes, or ``metadata[0]`` is not the master's.
        """
        for label, value, low in (("trainer_world_size", trainer_world_size, 1),
                                  ("rollout_world_size", rollout_world_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CheckpointConfigError(f"{label} must be an int >= {low}, got {value!r}")
        if not isinstance(metadata, (list, tuple)) or len(metadata) != trainer_world_size + rollout_world_size:
            raise CheckpointConfigError(f"metadata must list the prepare() result of all {trainer_world_size} + "
                                        f"{rollout_world_size} workers, got {metadata!r}")
        master = metadata[0]
        if not isinstance(master, dict) or not master.get("is_master") or not master.get("master_port"):
            raise CheckpointConfigError("metadata[0] must be the prepare() result of the master (trainer rank 0, "
                                        f"built with is_master=True), got {master!r}")
        world_size = 1 + rollout_world_size
        ranks = [0] + [-1] * (trainer_world_size - 1) + list(range(1, world_size))
        addr, port, generation = master["master_addr"], master["master_port"], master["generation"]

        def wanted(rank: int, gen: int) -> dict[str, Any]:
            return {"rank": rank, "world_size": world_size, "master_addr": addr, "master_port": port,
                    "generation": gen, "src_rank": 0}

        keep = all(isinstance(m, dict) and m.get("joined") == wanted(r, generation)
                   for r, m in zip(ranks, metadata) if r >= 0)
        if not keep:
            generation += 1
        sides = []
        for side in (ranks[:trainer_world_size], ranks[trainer_world_size:]):
            n = len(side)
            sides.append({"rank": side, "world_size": [world_size] * n, "master_addr": [addr] * n,
                          "master_port": [port] * n, "generation": [generation] * n})
        return sides[0], sides[1]

    def init_process_group(self, rank: int | None = None, world_size: int | None = None,
                           master_addr: str | None = None, master_port: int | None = None,
                           generation: int = 0, **_ignored: Any) -> None:
        """Be rank ``rank`` of the group ``build_topology`` described; reuse the one held if it is that group.

        Without arguments: join the group given at construction (hal's standalone use). ``rank=-1``:
        this worker is outside the group (it releases any group it held). Blocks until every member
        joined, at most ``timeout`` seconds.

        Raises:
            CheckpointConfigError: bad arguments, or no group known at all.
            TransferTimeoutError: the store or a peer did not come within ``timeout``.
        """
        if rank is None and world_size is None:
            if self._membership is None:
                raise CheckpointConfigError("init_process_group() needs rank, world_size, master_addr and "
                                            "master_port (from build_topology), or an engine built with them")
            membership = self._membership
        elif isinstance(rank, int) and not isinstance(rank, bool) and rank < 0:
            self._release_group(keep_store=self.is_master)
            self._membership = None
            self._set_role(None)
            self._free_buffers()
            return
        else:
            membership = self._checked_membership(rank, world_size, master_addr, master_port, generation)
        self._membership = membership
        self._set_role(membership)
        if self._group is not None and self._joined == membership and not self._broken:
            return  # the same group: keep the communicator (rebuilding one per update exhausts HCCL)
        self._join(membership)

    def _join(self, m: dict[str, Any]) -> None:
        self._release_group(keep_store=self._store_at == (m["master_addr"], m["master_port"]))
        self._broken = None
        try:
            if self._store is None:
                self._store = hal.connect_store(m["master_addr"], m["master_port"], m["rank"], m["world_size"],
                                                self.timeout)
                self._store_at = (m["master_addr"], m["master_port"])
            self._group = hal.new_group_from_store(self._store, m["rank"], m["world_size"], self.device_kind,
                                                   self.timeout, f"ckpt/{m['generation']}")
        except hal.DistributedTimeoutError as exc:
            raise TransferTimeoutError(f"rank {m['rank']} could not form the checkpoint group at "
                                       f"{m['master_addr']}:{m['master_port']}: {exc}") from exc
        self._joined = dict(m)
        self._generation = max(self._generation, m["generation"])

    def _release_group(self, keep_store: bool) -> None:
        if self._group is not None:
            self._group.close()
        self._group = self._joined = None
        self._pending_meta = None
        if not keep_store:
            self._store = self._store_at = None

    def _allocate(self) -> None:
        """Bind this rank's device (:func:`hal.bind_local_device`: the index in ``device``, else ``LOCAL_RANK``'s)
        and put the buffers there: 2 x ``bucket_size`` bytes on the sender, 1 x on a receiver, plus as many
        ``meta_capacity`` records; zero-filled so pages are touched now."""
        if self._buffers:
            return
        self.device = hal.bind_local_device(self.device_kind)
        n = 2 if self.is_sender else 1
        self._buffers = [torch.zeros(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self._metas = [torch.zeros(self.meta_capacity, dtype=torch.uint8, device=self.device) for _ in range(n)]

    def _free_buffers(self) -> None:
        self._buffers, self._metas, self._large, self._pending_meta = [], [], None, None

    def finalize(self) -> None:
        """End of one update: free the buffers; keep the group for the next update.

        A group that failed (a dead peer, a timeout) is released too, store included, so the next
        :meth:`init_process_group` (or send / receive) forms a new one.
        """
        self._free_buffers()
        if self._broken:
            self._release_group(keep_store=False)
            self._broken = None

    def close(self) -> None:
        """Release everything: buffers, the group and the store (the master's server included)."""
        self._free_buffers()
        self._release_group(keep_store=False)
        self._broken = None

    async def _ensure_ready(self) -> hal.StoreGroup:
        if self._broken:
            raise TransferError(f"the checkpoint group of rank {self.rank} is unusable after an earlier "
                                f"failure ({self._broken}); call finalize() and set it up again")
        if self._group is None:
            if self._membership is None:
                raise CheckpointConfigError("this collective engine is in no group: call init_process_group(...) "
                                            "with build_topology's entries, or build it with rank, world_size, "
                                            "master_addr and master_port")
            await asyncio.to_thread(self._join, self._membership)
        self._allocate()
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
        if self.rank == -1:  # a trainer rank outside the group: its weights iterator may need it (FSDP gathers)
            for _ in weights:
                pass
            return
        if self.rank is None and self._membership is None:
            raise CheckpointConfigError("this collective engine is in no group: call init_process_group(...) "
                                        "first, or build it with rank, world_size, master_addr and master_port")
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
        if self.rank is None or self.rank < 0:
            raise CheckpointConfigError(f"receive_weights called on an engine outside any group (rank {self.rank}); "
                                        "call init_process_group(...) with build_topology's entries first")
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


def _host_address() -> str:
    """This host's address as its name resolves (what peers on other nodes dial), else ``127.0.0.1``."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
