"""``nixl``: weights written by NIXL (``nixl_agent``, UCX backend) into the rollouts' registered buffers.

:mod:`ckpt.p2p`'s shape with one-sided ``WRITE`` transfers. Memory type: the kind's ``nixl_memory_type``;
kinds without one stage through host memory (``"DRAM"``). Install: ``pip install --no-deps nixl==1.5.1
nixl-cu12==1.5.1`` (the ``nixl`` extra)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import uuid
from typing import Any

import torch

import hal
from ckpt.errors import TransferError
from ckpt.p2p import P2PCheckpointEngine, Transport

RDMA_SYSFS = "/sys/class/infiniband"  # Where Linux lists RDMA devices; absent or empty without them.
HOST_MEMORY_TYPE = "DRAM"  # NIXL's memory type of host memory, where the kind's memory cannot be registered.


@dataclasses.dataclass
class NixlWrite:
    """One WRITE in flight: its handle (``None`` once released) and final state (``"DONE"`` or ``"ERR..."``)."""

    handle: Any
    state: str | None = None


class NixlTransport(Transport):
    """One ``nixl_agent`` with ``backends``; a write is ``initialize_xfer("WRITE", ...)`` + ``transfer``, polled."""

    library = "NIXL"
    max_in_flight = 2  # UCX progresses several WRITEs at once: measured faster than one at a time

    def __init__(self, name: str, memory_type: str, backends: tuple[str, ...]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if not (os.path.isdir(RDMA_SYSFS) and os.listdir(RDMA_SYSFS)):
            # no RDMA NIC: without UCX's ib module, whose bundled libnl crashes nixl 1.5.1 at exit
            os.environ.setdefault("UCX_MODULES", "^ib")
        if "NIXL_LOG_LEVEL" not in os.environ:
            # nixl logs every agent at INFO to stdout, which would corrupt a command's JSON output
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name, self.memory_type = name, memory_type
        self.agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self.remote: dict[int, dict[str, Any]] = {}
        self._reg = None

    def _dev(self, tensor: torch.Tensor) -> int:
        return (tensor.device.index or 0) if self.memory_type == "VRAM" else 0

    def _register(self, tensor: torch.Tensor) -> Any:
        # by address with the memory type given: a tensor passed as is gets NIXL's guess instead ("VRAM" for
        # any non-cpu tensor), wrong for a kind whose device memory is host memory
        return self.agent.register_memory([(tensor.data_ptr(), tensor.numel(), self._dev(tensor), "")],
                                          self.memory_type)

    def register(self, buffer: torch.Tensor) -> dict[str, Any]:
        self._reg = self._register(buffer)
        self.addr, self.dev = buffer.data_ptr(), self._dev(buffer)
        return {"agent": base64.b64encode(self.agent.get_agent_metadata()).decode(), "name": self.name,
                "addr": self.addr, "nbytes": buffer.numel(), "dev": self.dev, "memory_type": self.memory_type}

    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        old = self.remote.pop(peer, None)
        if old is not None:
            self.agent.remove_remote_agent(old["name"])
        try:
            name = self.agent.add_remote_agent(base64.b64decode(info["agent"]))
        except Exception as exc:  # nixlBind errors: the peer's agent is unreachable (closed) or its record bad
            raise TransferError(f"NIXL could not add the agent of peer {peer}: {type(exc).__name__}: {exc}") from exc
        self.remote[peer] = dict(info, name=name.decode() if isinstance(name, bytes) else name)

    def register_source(self, tensor: torch.Tensor) -> Any:
        return self._register(tensor), tensor

    def release_source(self, handle: Any) -> None:
        self.agent.deregister_memory(handle[0])

    def start_write(self, peer: int, pieces: list[tuple[int, int, int]]) -> Any:
        """Post one WRITE of ``pieces`` to ``peer``, remaking once an endpoint UCX failed while the peer may live.

        UCX fails an endpoint for good on a reset connection (``NIXL_ERR_REMOTE_DISCONNECT``); remaking it fails
        other writes to that peer still in flight. Raises ``KeyError`` for a peer never added."""
        from nixl._bindings import nixlRemoteDisconnectError

        if peer not in self.remote:
            raise KeyError(f"NIXL has no agent of peer {peer}: add_peer() it first (peers added: {sorted(self.remote)})")
        try:
            try:
                return self._post(self.remote[peer], pieces)
            except nixlRemoteDisconnectError:
                self.add_peer(peer, self.remote[peer])
                return self._post(self.remote[peer], pieces)
        except TransferError:
            raise
        except Exception as exc:  # nixlBind errors: the peer is gone or the descriptors are wrong
            raise TransferError(f"{type(exc).__name__}: {exc}") from exc

    def _post(self, r: dict[str, Any], pieces: list[tuple[int, int, int]]) -> NixlWrite:
        """Post ``initialize_xfer`` + ``transfer`` of ``pieces`` to remote agent ``r``, releasing the handle on failure."""
        local = self.agent.get_xfer_descs([(a, n, self.dev) for a, _, n in pieces], self.memory_type)
        remote = self.agent.get_xfer_descs([(r["addr"] + o, n, r["dev"]) for _, o, n in pieces], r["memory_type"])
        handle = self.agent.initialize_xfer("WRITE", local, remote, r["name"])
        try:
            state = self.agent.transfer(handle)
        except BaseException:
            with contextlib.suppress(Exception):  # the post's own error is the one to report
                self.agent.release_xfer_handle(handle)
            raise
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransferError("NIXL transfer() returned ERR")
        return NixlWrite(handle)

    def poll(self, handle: NixlWrite) -> bool:
        if handle.state is None:
            try:
                state = self.agent.check_xfer_state(handle.handle)
            except Exception as exc:  # noqa: BLE001 - reported as the peer's failure
                state = f"ERR ({type(exc).__name__}: {exc})"
            if state == "DONE" or state.startswith("ERR"):
                self.agent.release_xfer_handle(handle.handle)
                handle.handle, handle.state = None, state
        if handle.state is not None and handle.state != "DONE":
            raise TransferError(f"NIXL reports the WRITE in state {handle.state}")
        return handle.state == "DONE"


    def close(self) -> None:
        if self.agent is None:
            return
        for r in self.remote.values():
            try:
                self.agent.remove_remote_agent(r["name"])
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        self.remote = {}
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        self.agent = None  # its last reference: the agent's destructor stops UCX's workers


class NixlCheckpointEngine(P2PCheckpointEngine):
    """Checkpoint engine over NIXL (see :class:`ckpt.p2p.P2PCheckpointEngine`).

    ``backends``: NIXL backends to instantiate (default ``("UCX",)``; UCX reads ``UCX_TLS`` etc.)."""

    extra_keywords = ("backends",)

    @staticmethod
    def in_place_value(spec: hal.DeviceSpec) -> str | None:
        return spec.nixl_memory_type

    def __init__(self, *args: Any, backends: tuple[str, ...] | list[str] = ("UCX",), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backends = tuple(backends)

    @classmethod
    def availability(cls) -> hal.Availability:
        try:
            import nixl._api  # noqa: F401 - imported to learn whether the library and its shared objects load
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError of a missing shared library
            return hal.Availability.unavailable(
                f"import nixl failed ({type(exc).__name__}: {exc}); install the 'nixl' extra: "
                "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy")
        return hal.Availability.available()

    def make_transport(self, host: str, in_place: str | None) -> Transport:
        return NixlTransport(f"hal-ckpt-{self.rank}-{uuid.uuid4().hex[:12]}", in_place or HOST_MEMORY_TYPE,
                             self.backends)
