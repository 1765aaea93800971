"""A resharding channel between processes of one host: small messages over ZeroMQ, a pair's buckets in two slots
the sender shares (its device kind's IPC handle, or a shared-memory segment) and the rollout reads in place.

Every rank pulls from its own endpoint and pushes to its peers'. Messages, multipart: ``[b"c", src, payload]``
(a small message), ``[b"b", src, slot, nbytes, handle]`` (slot ``slot`` holds a bucket; ``handle`` pickled the
first time a peer is told of a slot, else empty), ``[b"a", src, slot]`` (the rollout is done with that slot: the
sender may fill it again). A wait ends with an error when its timeout passes or a waited-on peer's process dies.
"""

from __future__ import annotations

import collections
import pickle
import time
from typing import Any

import torch

import hal
import hal.ipc
from ckpt.errors import TransferError, TransferTimeoutError
from ckpt.reshard.transfer import Posted

SEGMENT_PREFIX = "hal-m2n-"  # names of the slots' shared-memory segments (/dev/shm/hal-m2n-*)
LIVENESS_S = 0.2  # seconds between two looks at whether a waited-on peer still lives


class _Slot:
    def __init__(self, tensor: torch.Tensor, handle: Any, release: Any) -> None:
        self.tensor, self.handle, self.release, self.told = tensor, handle, release, set()


class _Future:
    """A message awaited from ``peer``; ``on_arrival(parts)`` runs when it comes."""

    def __init__(self, peer: int, key: tuple, on_arrival: Any = None) -> None:
        self.peer, self.key, self.on_arrival, self.done = peer, key, on_arrival, False

    def wait(self, *args: Any, **kwargs: Any) -> None:  # the channel's wait() completes it
        pass


class SharedChannel:
    """See the module overview. ``endpoints``: every rank's ZMQ endpoint; ``pids``: peers' pids (liveness);
    ``transport``: ``"device"`` (IPC handles) or ``"shm"``."""

    def __init__(self, rank: int, endpoints: dict[int, str], device: torch.device, spec: Any, transport: str,
                 timeout: float, pids: dict[int, int] | None = None) -> None:
        import zmq
        import zmq.asyncio

        self.rank, self.endpoints, self.device, self.spec = rank, endpoints, device, spec
        self.transport, self.timeout, self.pids = transport, timeout, pids or {}
        self._zmq = zmq
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(endpoints[rank])
        self._push: dict[int, Any] = {}
        self._inbox: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._slots: dict[tuple[int, int], _Slot] = {}  # a sender's: (peer, slot) -> its shared buffer
        self._opened: dict[tuple[int, int], torch.Tensor] = {}  # a rollout's: the senders' slots, mapped

    def free_slots(self) -> None:
        """Free the slots this rank shares and forget the ones it mapped (the next update shares new ones)."""
        for slot in self._slots.values():
            if slot.release is not None:
                slot.release()
        self._slots, self._opened = {}, {}

    def close(self) -> None:
        self.free_slots()
        self._ctx.destroy(linger=0)

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() for s in self._slots.values())

    def _send(self, peer: int, *parts: bytes) -> None:
        sock = self._push.get(peer)
        if sock is None:
            sock = self._push[peer] = self._ctx.socket(self._zmq.PUSH)
            sock.connect(self.endpoints[peer])
        sock.send_multipart([*parts[:1], str(self.rank).encode(), *parts[1:]], copy=True)

    # ---- small messages ---------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        self._send(peer, b"c", tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return None  # queued by ZeroMQ: nothing to wait for

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        def arrived(parts: list[bytes]) -> None:
            data = parts[0]
            if len(data) != tensor.numel() * tensor.element_size():
                raise TransferError(f"rank {peer} sent {len(data)} bytes where rank {self.rank} expected "
                                    f"{tensor.numel() * tensor.element_size()}")
            tensor.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _Future(peer, (peer, b"c"), arrived)

    # ---- buckets ------------------------------------------------------------------------------------------
    def bucket(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        held = self._slots.get((peer, slot))
        if held is None or held.tensor.numel() < nbytes:
            if held is not None and held.release is not None:
                held.release()
            if self.transport == "device":
                shared = self.spec.share_device_buffer(nbytes, self.device)
                held = _Slot(shared.tensor, shared.handle, shared.release)
            else:
                segment = hal.ipc.SharedSegment(nbytes, SEGMENT_PREFIX)
                held = _Slot(segment.tensor, {"name": segment.name, "size": nbytes}, segment.unlink)
            self._slots[(peer, slot)] = held
        return held.tensor

    def send_bucket(self, source: torch.Tensor, peer: int, slot: int) -> Any:
        nbytes = source.numel()
        held = self._slots.get((peer, slot))
        if held is None or source.data_ptr() != held.tensor.data_ptr():  # a tensor of the sender's own: copied in
            self.bucket(peer, slot, nbytes)[:nbytes].copy_(source)
            held = self._slots[(peer, slot)]
        handle = b"" if peer in held.told else pickle.dumps(held.handle)
        held.told.add(peer)
        self._send(peer, b"b", str(slot).encode(), str(nbytes).encode(), handle)
        return _Future(peer, (peer, b"a", slot))

    def recv_bucket(self, into: torch.Tensor | None, peer: int, slot: int, nbytes: int) -> Any:
        posted = Posted(None, into, into is not None)

        def arrived(parts: list[bytes]) -> None:
            size, handle = int(parts[0]), parts[1]
            mapped = self._open(peer, slot, handle) if handle else self._opened.get((peer, slot))
            if mapped is None or size != nbytes:
                raise TransferError(f"rank {peer}'s bucket in slot {slot} ({size} bytes) is not the {nbytes} bytes "
                                    f"rank {self.rank} planned, or its slot was never shared")
            if into is None:
                posted.buffer = mapped[:nbytes]
            else:
                into.reshape(-1).view(torch.uint8).copy_(mapped[:nbytes])
        posted.work = _Future(peer, (peer, b"b", slot), arrived)
        return posted

    def release(self, posted: Posted, peer: int, slot: int) -> None:
        """Tell ``peer`` that this rank is done with the bucket in ``slot``."""
        self._send(peer, b"a", str(slot).encode())

    def _open(self, peer: int, slot: int, handle: bytes) -> torch.Tensor:
        shared = pickle.loads(handle)
        if isinstance(shared, dict):
            tensor = hal.ipc.attach_shared_segment(shared["name"], int(shared["size"]))
        else:
            tensor = hal.ipc.open_ipc_handle(shared, self.device.index)
        self._opened[(peer, slot)] = tensor
        return tensor

    # ---- waiting ----------------------------------------------------------------------------------------------
    async def wait(self, works: list, what: str) -> None:
        """Wait for ``works`` (sends are done at once; receives and bucket acknowledgements when they arrive)."""
        pending = [w.work if isinstance(w, Posted) else w for w in works]
        pending = [w for w in pending if w is not None and not w.done]
        deadline = time.monotonic() + self.timeout
        while pending:
            for w in pending:
                queue = self._inbox.get(w.key)
                if queue:
                    parts = queue.popleft()
                    w.done = True
                    if w.on_arrival is not None:
                        w.on_arrival(parts)
            pending = [w for w in pending if not w.done]
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"{what}: rank {self.rank} heard nothing from rank {pending[0].peer} within "
                                           f"{self.timeout:g} s")
            if await self._pull.poll(timeout=int(1000 * min(LIVENESS_S, left))):
                kind, src, *rest = await self._pull.recv_multipart()
                peer = int(src)
                key = (peer, kind) if kind == b"c" else (peer, kind, int(rest.pop(0)))
                self._inbox[key].append(rest)
            else:
                for w in pending:
                    pid = self.pids.get(w.peer)
                    if pid is not None and not hal.process_alive(pid):
                        raise TransferError(f"{what}: rank {w.peer} (pid {pid}) died while rank {self.rank} waited")


__all__ = ["SharedChannel"]
