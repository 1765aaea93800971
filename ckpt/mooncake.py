"""``mooncake``: weights written by Mooncake's Transfer Engine into the rollouts' registered buffers.

:mod:`ckpt.p2p`'s shape with ``transfer_submit_write`` polled from the event loop. Each process runs a
``TransferEngine`` in ``P2PHANDSHAKE`` mode (no metadata server) with the kind's ``mooncake_protocol``; kinds
without one stage through host memory over ``"tcp"``. Install: ``pip install
mooncake-transfer-engine-non-cuda==0.3.13.post1`` (the ``mooncake`` extra; its import needs ``libibverbs.so.1``,
Debian package ``libibverbs1``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import hal
from ckpt.errors import TransferError
from ckpt.p2p import P2PCheckpointEngine, Transport

HOST_PROTOCOL = "tcp"  # Mooncake's protocol for host memory, where the kind's memory cannot be moved in place.


@dataclasses.dataclass
class MooncakeWrite:
    """One write's running batches (oldest first) and state: 0 running, 1 done, < 0 the failed batch's status."""

    batches: list[int]
    state: int = 0


class MooncakeTransport(Transport):
    """One ``TransferEngine`` (``P2PHANDSHAKE``); peers are addressed by session ``"host:rpc_port"``."""

    library = "Mooncake"
    max_in_flight = 1  # two writes in flight to one peer over tcp: measured slower than one

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
        # transfer_submit_write + transfer_check_status, polled from the event loop with short sleeps: the
        # synchronous calls poll without sleeping in the calling thread, which takes a core from the engine's
        # own transfer threads (measured: four synchronous 64 MiB writes 0.78x one 256 MiB write, four
        # submitted ones 1.3x on a 2-core host)
        r = self.remote[peer]
        batches = []
        for a, o, n in pieces:
            batch = self.engine.transfer_submit_write(r["session"], a, r["addr"] + o, n)
            if batch == 0:
                raise TransferError(f"Mooncake transfer_submit_write of {n} bytes to {r['session']} failed "
                                    "(the peer is unreachable or the address is not registered)")
            batches.append(batch)
        return MooncakeWrite(batches)

    def poll(self, handle: MooncakeWrite) -> bool:
        while handle.batches and handle.state == 0:
            status = self.engine.transfer_check_status(handle.batches[0])  # frees the batch once it is final
            if status == 0:
                return False
            handle.batches.pop(0)
            if status < 0:
                handle.state = status
        if handle.state < 0:
            raise TransferError(f"Mooncake reports the write failed (transfer_check_status {handle.state})")
        handle.state = 1
        return True

    def close(self) -> None:
        if self.engine is None:
            return
        if self.addr is not None:
            self.engine.unregister_memory(self.addr)
            self.addr = None
        # its last reference: the destructor stops the engine's tcp server and joins its thread, so no request
        # of a peer writes into this process's memory any more (the server writes wherever a request points)
        self.engine = None


class MooncakeCheckpointEngine(P2PCheckpointEngine):
    """Checkpoint engine over Mooncake's Transfer Engine (see :class:`ckpt.p2p.P2PCheckpointEngine`).

    ``device_name``: Mooncake's device filter (RDMA NIC names for ``"rdma"``; ``""``: let it choose)."""

    extra_keywords = ("device_name",)

    @staticmethod
    def in_place_value(spec: hal.DeviceSpec) -> str | None:
        return spec.mooncake_protocol

    def __init__(self, *args: Any, device_name: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device_name = device_name

    @classmethod
    def availability(cls) -> hal.Availability:
        try:
            import mooncake.engine  # noqa: F401 - imported to learn whether the library and libibverbs load
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libibverbs.so.1 missing)
            return hal.Availability.unavailable(
                f"import mooncake.engine failed ({type(exc).__name__}: {exc}); install the 'mooncake' extra "
                "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1) and Debian's libibverbs1")
        return hal.Availability.available()

    def make_transport(self, host: str, in_place: str | None) -> Transport:
        return MooncakeTransport(host, in_place or HOST_PROTOCOL, self.device_name)
