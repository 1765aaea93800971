"""``mooncake``: weights written by Mooncake's Transfer Engine into the rollouts' registered buffers.

On :mod:`ckpt.p2p`'s shape: ``transfer_sync_write`` (``batch_transfer_sync_write`` for several pieces) from the trainer's send slots into each rollout's
two receive slots (one thread per write, so the event loop and the packing of the next bucket go on),
metadata (with ``global_steps``) over the control connection once a write returned. Each process runs a
``TransferEngine`` in ``P2PHANDSHAKE`` mode (no metadata server); its protocol is the device kind's
``mooncake_protocol`` (``"rdma"``, ``"ascend_direct"``: buffers on the device); kinds without one stage
through host memory over ``"tcp"``. Install: ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1``
(the ``mooncake`` extra; its import needs ``libibverbs.so.1``, Debian package ``libibverbs1``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import torch

import hal
from ckpt.errors import TransferError, TransferTimeoutError
from ckpt.p2p import P2PCheckpointEngine, Transport

HOST_PROTOCOL = "tcp"
"""Mooncake's protocol for host memory, used when the device kind's memory cannot be moved in place."""


class MooncakeTransport(Transport):
    """One ``TransferEngine`` (``P2PHANDSHAKE``); peers are addressed by session ``"host:rpc_port"``."""

    library = "Mooncake"
    max_in_flight = 1  # two concurrent transfer_sync_write calls to one peer over tcp: measured 2.5x slower

    def __init__(self, host: str, protocol: str, device_name: str = "") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                                f"{device_name!r}) returned {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.remote: dict[int, dict[str, Any]] = {}
        self.addr: int | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="hal-mooncake")

    def register(self, buffer: torch.Tensor) -> dict[str, Any]:
        rc = self.engine.register_memory(buffer.data_ptr(), buffer.numel())
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {buffer.numel()} bytes returned {rc}")
        self.addr, self.nbytes = buffer.data_ptr(), buffer.numel()
        return {"session": self.session, "addr": self.addr, "nbytes": self.nbytes}

    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        self.remote[peer] = dict(info)

    def register_source(self, tensor: torch.Tensor) -> Any:
        rc = self.engine.register_memory(tensor.data_ptr(), tensor.numel())
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {tensor.numel()} bytes returned {rc}")
        return tensor

    def release_source(self, handle: Any) -> None:
        self.engine.unregister_memory(handle.data_ptr())

    def start_write(self, peer: int, pieces: list[tuple[int, int, int]]) -> Any:
        r = self.remote[peer]
        if len(pieces) == 1:
            (a, o, n), = pieces
            return self._pool.submit(self.engine.transfer_sync_write, r["session"], a, r["addr"] + o, n)
        return self._pool.submit(self.engine.batch_transfer_sync_write, r["session"], [a for a, _, _ in pieces],
                                 [r["addr"] + o for _, o, _ in pieces], [n for _, _, n in pieces])

    def poll(self, handle: Any) -> bool:
        if not handle.done():
            return False
        if handle.exception() is not None or handle.result() != 0:
            raise TransferError(f"Mooncake transfer_sync_write failed: {handle.exception() or handle.result()}")
        return True

    async def wait(self, handle: Any, timeout: float) -> None:
        try:
            rc = await asyncio.wait_for(asyncio.wrap_future(handle), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"Mooncake transfer_sync_write not done within {timeout:g} s") from None
        if rc != 0:
            raise TransferError(f"Mooncake transfer_sync_write returned {rc}")

    def close(self) -> None:
        if self.addr is not None:
            self.engine.unregister_memory(self.addr)
            self.addr = None
        self._pool.shutdown(wait=False)


class MooncakeCheckpointEngine(P2PCheckpointEngine):
    """Checkpoint engine over Mooncake's Transfer Engine (see :class:`ckpt.p2p.P2PCheckpointEngine` for
    arguments, memory, ownership and failures).

    Args:
        device_name: Mooncake's device filter (RDMA NIC names for ``"rdma"``; ``""``: let it choose).
    """

    spec_field = "mooncake_protocol"

    def __init__(self, *args: Any, device_name: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device_name = device_name

    @classmethod
    def availability(cls) -> hal.Availability:
        try:
            import mooncake.engine  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libibverbs.so.1 missing)
            return hal.Availability.unavailable(
                f"import mooncake.engine failed ({type(exc).__name__}: {exc}); install the 'mooncake' extra "
                "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1) and Debian's libibverbs1")
        return hal.Availability.available()

    def make_transport(self, host: str, in_place: str | None) -> Transport:
        return MooncakeTransport(host, in_place or HOST_PROTOCOL, self.device_name)
