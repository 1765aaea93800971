"""Same-host hand-over between processes: buckets shared in place, small messages in verl's protocol over pyzmq.

The trainer fills a bucket every rollout process maps. How it is shared is the device kind's
``ipc_transport()``: ``"device"``, device memory exported as an IPC handle that a rollout opens on its own
device and reads in place; ``"shm"``, a POSIX shared-memory segment that a rollout on a device copies once per
bucket to that device.

Wire format: verl 0.9.1's ``BucketedWeightSender`` / ``BucketedWeightReceiver``, one ZMQ REQ (trainer, binds)
/ REP (rollout, connects) pair per rollout, pickled objects:

1. the buffer: a device handle ``(rebuild_fn, args)`` or ``{"name": segment, "size": bytes}``; the rollout
   replies ``b""`` (hal's rollout: its hello, :data:`HAL_HELLO`);
2. per bucket, ``{"bucket_meta": {name: {"name", "shape", "dtype", "offset", "handle": None}}, "is_last":
   bool}`` with byte offsets into the whole buffer; the rollout replies ``b""`` once it has read it.

hal adds ``"global_steps"``, ``"bucket_size"`` and the trainer's identity (``"trainer": {"job", "generation",
"pid"}``, also in a segment's dict) to every message, sends a tensor larger than a bucket in slices (``"chunk":
(start, length, nbytes)``), and a hal rollout refuses an update with ``b"refused: <error type>: <why>"``, which
the trainer raises. A hal rollout refuses a trainer it was not built for (another job or generation, or another
pid than its ``peer_pids``); a trainer does not bind an endpoint another process holds. The hello says whether
the rollout opened the buffer and what it can open; a rollout that cannot open a device handle (a cpu rollout)
is sent a shared-memory copy of each bucket instead, for as long as its socket lives. A rollout whose consumer
promised reports (:mod:`ckpt.outcome`) holds its last reply until ``report_outcome``: ``b"reported: "`` and JSON
``{"error", "mismatches"}`` (``check=True``: the trainer's digests ride in the last message). Sockets live per
topology (verl's receiver: per update), whatever frees the buffers. verl's receiver takes hal's sender when every tensor
fits a bucket; hal's receiver takes verl's sender (with ``global_steps=None``).

Pipeline: the buffer holds two buckets; the trainer fills bucket k+1 while the rollouts read bucket k.
In place: an update staged in :meth:`IpcCheckpointEngine.publish_buffer` is shared as it is (no trainer-side
copy; messages say ``"in_place": True``). With ``release_at_finalize`` (``"transient": True``) the rollout
drops each message's pages once read and lets go of the buffer at the end of the update, at the cost of page
faults on both sides every update."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import socket
import sys
import time
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, NamedTuple

import torch

import hal
import hal.ipc
from ckpt.base import (CheckpointEngine, NamedTensor, ReceivePlacement, as_placement, check_global_steps,
                       check_seconds, check_step, named_tensors)
from ckpt.bucket import as_bytes
from ckpt.layout import byte_view
from ckpt.control import PeerFailure
from ckpt.checker import Digester, mismatches, served_digests
from ckpt.errors import (CheckpointConfigError, TransferAbortedError, TransferError, TransferTimeoutError,
                         UpdateRefusedError, WeightCheckError)
from ckpt.layout import align
from ckpt.one_to_many import DEFAULT_BUCKET_SIZE, check_int, check_keywords
from ckpt.outcome import Outcome
from ckpt.reshard.layout import RolloutLayout
from ckpt.reshard.shared import SharedChannel
from ckpt.reshard.transfer import held_or_abort, layouts_by_rank, receive_update, send_update

NUM_BUCKETS = 2  # Buckets in the shared buffer: the one being filled and the one being read.
SEGMENT_PREFIX = "hal-ipc-"  # Names of the engine's shared-memory segments (/dev/shm/hal-ipc-*).
LIVENESS_S = 0.2  # Seconds between two looks at whether a waited-on peer still lives.
ABORT_S = 5.0  # Seconds at most (or the engine's timeout) an abandoned update spends telling its rollouts.
REFUSED = b"refused: "  # Start of a rollout's reply that refuses the update; the rest says why (UTF-8).
REPORTED = b"reported: "  # Start of a reporting rollout's last reply: JSON {"error", "mismatches"} (ckpt.outcome).
UNCHECKED = "the update was received without a consumer that reports (ckpt.CheckpointEngineWorker): nothing was checked"
# Start of a hal rollout's reply to the buffer's handle (verl's is b""), then " " and JSON {"opened", "opens"}.
# The trainer keeps its socket to a hal rollout across updates and binds a new one per update for verl's
# receiver, whose closed socket could swallow the next update's first message.
HAL_HELLO = b"hal-ipc"
REBIND_S = 5.0  # Seconds a socket this process closed may keep its endpoint bound: a bind retries that long.
CLOSE_LINGER_MS = 1000  # Milliseconds a rollout leaving a foreign trainer's endpoint lets its refusal go out.
_closed_here: dict[str, float] = {}  # endpoint -> when this process closed a socket bound to it (monotonic s)


def default_job() -> str:
    """Return a new job name for a trainer not given one: host, pid and a random part."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"


def default_endpoint() -> str:
    """Return a new ZMQ endpoint: an abstract Unix socket on Linux, else a socket file in the temporary directory."""
    tag = f"hal-ipc-{os.getpid()}-{os.urandom(4).hex()}"
    if sys.platform.startswith("linux"):
        return f"ipc://@{tag}"
    import tempfile

    return f"ipc://{os.path.join(tempfile.gettempdir(), tag)}"


def rollout_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of rollout ``rank`` (1..N) under the trainer's ``endpoint``."""
    return f"{endpoint}-{rank}"


class _Shared(NamedTuple):
    """The trainer's buffer: the ``uint8`` tensor, its first message to the rollouts, its release, its segment."""

    tensor: torch.Tensor
    handshake: Any
    release: Callable[[], None] | None
    segment: str | None


class ForeignTrainerError(TransferError):
    """A trainer of another job or generation (or pid) than the rollout was built for sent to its endpoint."""


class _Peer:

    def __init__(self, sock: Any, name: str, pid: int | None, endpoint: str | None = None) -> None:
        self.sock, self.name, self.pid, self.endpoint = sock, name, pid, endpoint
        self.hal = False  # its hello was hal's (a kept socket); else verl's receiver
        self.transport: str | None = None  # "shm" once it said it cannot open the trainer's device handle

    async def reply(self) -> bytes:
        """Receive the reply to the last request (REQ_CORRELATE drops a late one, which may wake the poller for nothing)."""
        import zmq

        while True:
            try:
                return await self.sock.recv()
            except zmq.Again:
                await asyncio.sleep(0)


def _trainer_of(msg: Any) -> Any:
    return msg.get("trainer") if isinstance(msg, dict) else None


def _hello(reply: bytes) -> dict[str, Any] | None:
    """Return a hal rollout's hello as a dict, ``None`` for verl's receiver (or a refusal)."""
    if reply == HAL_HELLO:
        return {"opened": True}
    if reply.startswith(HAL_HELLO + b" "):
        return json.loads(reply[len(HAL_HELLO) + 1:])
    return None


def _span(entries: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """Return the ``(start, end)`` bytes a message's entries cover in its buffer."""
    entries = list(entries)
    return (min(e["offset"] for e in entries),
            max(e["offset"] + (e["chunk"][1] if e.get("chunk") else e["dtype"].itemsize * torch.Size(e["shape"]).numel())
                for e in entries))


class IpcCheckpointEngine(CheckpointEngine):
    """Trainer and rollouts in separate processes of one host; buckets shared in place (see the module overview).

    Ranks: 0 the trainer, 1..N the rollouts, -1 a trainer rank outside the group (its ``send_weights`` drains).
    Built standalone (``rank``, ``world_size``, ``endpoint``) or verl's way (``is_master``, then the lifecycle).
    ``endpoint`` is the trainer's ZMQ prefix (rollout r uses ``endpoint-r``); ``timeout`` (seconds) bounds every
    wait, and a peer whose pid is known (``peer_pids``) is an error within :data:`LIVENESS_S` of its death.
    ``release_at_finalize`` frees the buffer every update; else it lives per topology, until :meth:`close` or a
    failed update. ``job`` names the job: a rollout refuses a trainer of another job (a trainer not given one makes
    one up; the lifecycle gives each rollout its trainer's job and generation).

    Memory: the trainer holds 2 x ``bucket_size``; a rollout maps it, plus one device bucket for an ``"shm"``
    buffer; a tensor larger than a bucket arrives in its own buffer unless ``placement`` gives its target.
    Ownership: ``send_weights`` returns once every rollout is done with every tensor. A tensor yielded by
    ``receive_weights`` is a view into the shared buffer (or the device bucket), **valid until the next item is
    requested**: copy it before advancing."""

    send_buffer_words = "the shared buffer: two buckets, one filled while the other is read"
    bucketed = True  # two buckets of one shared buffer; the master picks the endpoint on the host
    ranks_may_share_a_device = True  # verl's hybrid engine: the rollout opens the trainer's buffer on its device
    supports_reshard = True  # each rollout rank its slices, in slots shared per pair (ckpt.reshard.shared)
    stages_in_shared_memory = True  # the shm transport's buckets, and the simulated npu's shareable buffers

    TRANSPORT_WORDS = {"device": "{kind} IPC handles, read in place", "shm": "shared memory, /dev/shm"}

    @classmethod
    def transport_words(cls, spec: Any) -> str:
        """Say the kind's transport in words, adding the copy to and from device memory where buckets go through shm."""
        transport = spec.ipc_transport()
        words = cls.TRANSPORT_WORDS[transport].format(kind=spec.kind)
        return words if transport == "device" or spec.host_memory else f"{words}, copied to and from {spec.kind} memory"

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        return {"buckets_bytes": NUM_BUCKETS * bucket_size}

    def __init__(self, bucket_size: int = DEFAULT_BUCKET_SIZE, is_master: bool = False, *, rank: int | None = None,
                 world_size: int | None = None, endpoint: str | None = None, device: str | None = None,
                 timeout: float = hal.DEFAULT_TIMEOUT_S, peer_pids: list[int] | None = None,
                 transport: str | None = None, release_at_finalize: bool = False, rollout_layout: Any = None,
                 multi_sender: bool = False, job: str | None = None, **extra: Any) -> None:
        check_keywords(extra, ("bucket_size", "is_master", "rank", "world_size", "endpoint", "device", "timeout",
                               "peer_pids", "transport", "release_at_finalize", "rollout_layout", "multi_sender",
                               "job"), "IpcCheckpointEngine()")
        if job is not None and (not isinstance(job, str) or not job):
            raise CheckpointConfigError(f"job must be None or a non-empty str naming the job, got {job!r}")
        self.job, self._made_job, self.generation = job, job or default_job(), 0
        self._pin: dict[str, Any] | None = None  # a rollout's: the trainer's {"job", "generation"} (lifecycle)
        self.bucket_size = check_int(bucket_size, "bucket_size", 256)
        self.timeout = check_seconds(timeout)
        if transport not in (None, *hal.ipc.TRANSPORTS):
            raise CheckpointConfigError(f"transport must be None (the device kind's) or one of "
                                        f"{hal.ipc.TRANSPORTS}, got {transport!r}")
        self.is_master, self.release_at_finalize = bool(is_master), bool(release_at_finalize)
        self.spec = hal.resolve_device(device)
        self.device = hal.get_device(device)
        self.transport = transport or self.spec.ipc_transport()
        if self.transport == "device" and self.spec.host_memory:
            raise CheckpointConfigError(f"transport 'device' needs a device kind, got {self.spec.kind!r} (cpu "
                                        f"shares buckets through shared memory: transport 'shm')")
        self._torch_device = self.spec.torch_module()
        self.rank = self.world_size = None
        self.endpoint, self.peer_pids = endpoint, None
        if rank is not None or world_size is not None:
            self._set_place(rank, world_size, endpoint, peer_pids)
        self._zmq: Any = None
        self._peers: list[_Peer] = []  # the trainer's sockets, one per rollout, kept while updates succeed
        self._rep: Any = None  # a rollout's socket, likewise
        self._buffer: _Shared | None = None  # the trainer's
        self._mirror: _Shared | None = None  # the trainer's shared-memory copy, for rollouts that cannot open _buffer
        self._publish: _Shared | None = None  # the trainer's publish_buffer(), shared as it is
        self._opened: tuple[Any, torch.Tensor, str | None] | None = None  # a rollout's: (key, buffer, segment)
        self._staging: torch.Tensor | None = None  # a rollout's device bucket, for a shared-memory buffer
        self._promised = False  # a rollout's consumer reports (an update it did not arm for is "not checked")
        self._armed = False  # a rollout's consumer reports the next update it receives (promise_reports)
        self._owed: tuple[Any, dict | None] | None = None  # a rollout's (socket, digests) of the update to report
        self._updates = 0  # the trainer's updates sent, numbering its outcomes
        # resharding (ckpt.reshard): this rank's layout, every trainer rank a sender with multi_sender, the topology
        self.rollout_layout = None if rollout_layout is None else RolloutLayout.from_dict(rollout_layout)
        self.multi_sender, self.senders, self.rollout_layouts = bool(multi_sender), 0, None  # senders 0: not resharding
        self._channel: SharedChannel | None = None

    # ---- place and lifecycle -----------------------------------------------------------------------------
    def _set_place(self, rank: Any, world_size: Any, endpoint: Any, peer_pids: Any) -> None:
        world_size = check_int(world_size, "world_size", 2)
        rank = check_int(rank, "rank", -1, world_size)
        if rank != -1 and (not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://"))):
            raise CheckpointConfigError(f"endpoint must be a ZMQ endpoint 'ipc://...' (the trainer's), got {endpoint!r}")
        if peer_pids is not None and (not isinstance(peer_pids, (list, tuple))
                                      or not all(isinstance(p, int) and p > 0 for p in peer_pids)):
            raise CheckpointConfigError(f"peer_pids must be a list of pids (ints > 0), got {peer_pids!r}")
        changed = (rank, world_size, endpoint) != (self.rank, self.world_size, self.endpoint)
        if changed and (self.rank is not None):
            self._close_sockets()  # a new topology: sockets and buffers are per topology
            self._free()
        self.rank, self.world_size, self.endpoint = rank, world_size, endpoint
        self.peer_pids = list(peer_pids) if peer_pids is not None else None

    @property
    def identity(self) -> dict[str, Any]:
        """The trainer identity this engine's messages carry: ``{"job", "generation", "pid"}``."""
        return {"job": self._made_job, "generation": self.generation, "pid": os.getpid()}

    def prepare(self) -> dict[str, Any]:
        """Return this worker's pid, host, place and trainer identity, and on the master its endpoint (made once)."""
        place = None if self.rank is None else [self.rank, self.world_size, self.endpoint]
        meta = {"pid": os.getpid(), "host": socket.gethostname(), "place": place, "trainer": self._pin}
        if self.is_master or self.rank == 0:
            if self.endpoint is None:
                self.endpoint = default_endpoint()
            meta.update(endpoint=self.endpoint, trainer=self.identity)
            if self.multi_sender:
                meta["multi_sender"] = True
        if self.rollout_layout is not None:
            meta["rollout_layout"] = self.rollout_layout.to_dict()
        return meta

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """Trainer rank 0 sends to rollouts 1..R at the master's endpoint; every side learns the other's pids.

        Every rank also gets the trainer's job and generation, the generation one higher when any place or rollout's
        trainer changes. Raises :class:`CheckpointConfigError` when the workers are on different hosts."""
        check_int(trainer_world_size, "trainer_world_size", 1)
        check_int(rollout_world_size, "rollout_world_size", 1)
        if not isinstance(metadata, list) or len(metadata) != trainer_world_size + rollout_world_size:
            raise CheckpointConfigError(f"metadata must list {trainer_world_size + rollout_world_size} prepare() "
                                        f"results (trainer ranks first), got {metadata!r}")
        master = metadata[0]
        if not isinstance(master, dict) or not master.get("endpoint"):
            raise CheckpointConfigError(f"the master's prepare() result has no endpoint: {master!r} (build the "
                                        "trainer rank 0's engine with is_master=True)")
        hosts = {m.get("host") for m in metadata}
        if len(hosts) > 1:
            raise CheckpointConfigError(f"the ipc engine shares memory on one host; the workers are on "
                                        f"{sorted(map(str, hosts))} (use the collective engine across hosts)")
        layouts = [m.get("rollout_layout") for m in metadata[trainer_world_size:]]
        if any(layout is not None for layout in layouts):  # resharding: every trainer rank sends with multi_sender
            senders = trainer_world_size if master.get("multi_sender") else 1
            world, pids = senders + rollout_world_size, [m.get("pid") for m in metadata]
            pids = pids[:senders] + pids[trainer_world_size:]
            ranks = list(range(senders)) + [-1] * (trainer_world_size - senders)
            common = {"world_size": world, "endpoint": master["endpoint"], "peer_pids": pids, "reshard": True,
                      "num_senders": senders}
            trainer = {"rank": ranks, **{k: [v] * trainer_world_size for k, v in common.items()},
                       "rollout_layouts": [layouts] * trainer_world_size}
            rollout = {"rank": list(range(senders, world)), **{k: [v] * rollout_world_size for k, v in common.items()}}
            return trainer, rollout
        world = 1 + rollout_world_size
        rollout_pids = [m.get("pid") for m in metadata[trainer_world_size:]]
        trainer = {"rank": [0] + [-1] * (trainer_world_size - 1), "world_size": [world] * trainer_world_size,
                   "endpoint": [master["endpoint"]] * trainer_world_size,
                   "peer_pids": [rollout_pids] + [None] * (trainer_world_size - 1)}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "endpoint": [master["endpoint"]] * rollout_world_size,
                   "peer_pids": [[master["pid"]]] * rollout_world_size}
        ident = master.get("trainer")
        if isinstance(ident, dict):  # a hal master: the rollouts pin its job and this topology's generation
            now = {"job": ident["job"], "generation": ident["generation"]}
            kept = master.get("place") == [0, world, master["endpoint"]] and all(
                m.get("place") == [r, world, master["endpoint"]] and m.get("trainer") == now
                for r, m in enumerate(metadata[trainer_world_size:], 1))
            pin = {"job": now["job"], "generation": now["generation"] + (0 if kept else 1)}
            trainer["trainer"], rollout["trainer"] = [pin] * trainer_world_size, [pin] * rollout_world_size
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, endpoint: str | None = None,
                           peer_pids: list[int] | None = None, reshard: bool = False, num_senders: int = 1,
                           rollout_layouts: list | None = None, trainer: dict[str, Any] | None = None,
                           **extra: Any) -> None:
        """Take this rank's place; a changed place frees the old topology's buffer and sockets. Does not block.

        ``reshard``: ranks ``0..num_senders-1`` send each rollout rank the slices its layout keeps
        (``rollout_layouts``, on the senders); ``peer_pids`` then lists every rank's pid. ``trainer`` (``{"job",
        "generation"}``): the trainer's identity, taken by the trainer, pinned by a rollout."""
        check_keywords(extra, ("rank", "world_size", "endpoint", "peer_pids", "reshard", "num_senders",
                               "rollout_layouts", "trainer"), "IpcCheckpointEngine.init_process_group()")
        if trainer is not None and (not isinstance(trainer, dict) or set(trainer) != {"job", "generation"}):
            raise CheckpointConfigError(f"trainer must be None or {{'job': str, 'generation': int}}, got {trainer!r}")
        senders = check_int(num_senders, "num_senders", 1, world_size) if reshard else 0
        if (rank, world_size, endpoint, senders) != (self.rank, self.world_size, self.endpoint, self.senders):
            self._close_channel()  # a new topology: new endpoints and slots
        self._set_place(rank, world_size, endpoint, peer_pids)
        self.senders = senders
        self.rollout_layouts = rollout_layouts
        if trainer is None or self.rank == -1:
            return
        if self.rank > 0:
            self._pin = dict(trainer)
        elif trainer["job"] != self._made_job:
            raise CheckpointConfigError(f"build_topology gave trainer job {trainer['job']!r} to the trainer of job "
                                        f"{self._made_job!r}: metadata[0] must be this engine's prepare()")
        else:
            self.generation = trainer["generation"]

    def finalize(self) -> None:
        """Free the buffers only with ``release_at_finalize`` (a resharding channel keeps its sockets)."""
        if self.release_at_finalize:
            self._free()
            self.release_publish_buffer()
            if self._channel is not None:
                self._channel.free_slots()

    def close(self) -> None:
        """Free the buffers (unlink their segments), the sockets and the ZMQ context; the engine can be used again after."""
        self._close_channel()
        self._close_sockets()
        self._free()
        self.release_publish_buffer()
        if self._zmq is not None:
            self._zmq.destroy(linger=500)  # a last reply still queued goes out (at most 0.5 s)
            self._zmq = None

    def __del__(self) -> None:
        try:
            self._close_sockets()
            self._free()
            self.release_publish_buffer()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the resource tracker unlinks what is left
            pass

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _resharding_channel(self) -> SharedChannel:
        if self._channel is None:
            endpoints = {r: f"{self.endpoint}-m2n-{r}" for r in range(self.world_size)}
            pids = dict(enumerate(self.peer_pids or []))
            self._channel = SharedChannel(self.rank, endpoints, self.device, self.spec, self.transport, self.timeout,
                                          pids)
        return self._channel

    def _close_sockets(self) -> None:
        for peer in self._peers:
            peer.sock.close(linger=0)
            if peer.endpoint is not None:
                _closed_here[peer.endpoint] = time.monotonic()  # still bound for a moment: a rebind here may wait
        self._peers = []
        self._owed = None
        if self._rep is not None:
            self._rep.close(linger=0)
            self._rep = None

    def _free(self) -> None:
        """Free the buffers; the sockets stay (a closing socket could swallow the next update's first message)."""
        buffers, self._buffer, self._mirror = (self._buffer, self._mirror), None, None
        self._opened, self._staging = None, None
        for buffer in buffers:
            if buffer is not None and buffer.release is not None:
                buffer.release()
        if self.transport == "device" and not self.spec.host_memory:
            collect = getattr(self._torch_device, "ipc_collect", None)
            if collect is not None:
                collect()

    def _context(self) -> Any:
        if self._zmq is None:
            import zmq.asyncio

            self._zmq = zmq.asyncio.Context()
        return self._zmq

    def _check_place(self, want: str) -> None:
        if self.rank is None:
            raise CheckpointConfigError("the ipc engine has no place yet: pass rank, world_size and endpoint, or run "
                                        "prepare / build_topology / init_process_group first")
        if want == "send" and self.rank > 0:
            raise CheckpointConfigError(f"send_weights is the trainer's (rank 0); this engine is rollout rank {self.rank}")
        if want == "receive" and self.rank <= 0:
            raise CheckpointConfigError(f"receive_weights is a rollout's (rank >= 1); this engine is rank {self.rank}")

    # ---- waiting -----------------------------------------------------------------------------------------
    async def _wait(self, make: Any, peer: _Peer, what: str, deadline: float) -> Any:
        """Await ``make()`` until ``deadline``; raise :class:`PeerFailure` as soon as ``peer`` is seen dead."""
        future = asyncio.ensure_future(make())
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"{peer.name}: no {what} within {self.timeout:g} s")
                done, _ = await asyncio.wait({future}, timeout=min(LIVENESS_S, left))
                if done:
                    return future.result()
                if peer.pid is not None and not hal.process_alive(peer.pid):
                    # what it sent before it exited (verl's rollout replies, then exits) is still on its way
                    done, _ = await asyncio.wait({future}, timeout=LIVENESS_S)
                    if done:
                        return future.result()
                    raise PeerFailure(peer.name, f"{peer.name} (pid {peer.pid}) died while the {what} was awaited")
        finally:
            if not future.done():
                future.cancel()

    # ---- the trainer ---------------------------------------------------------------------------------------
    def _share(self, nbytes: int) -> _Shared:
        if self.transport == "device":  # verl's receiver rebuilds the handle itself
            shared = self.spec.share_device_buffer(nbytes, self.device)
            return _Shared(shared.tensor, shared.handle, shared.release, shared.segment)
        return self._share_memory(nbytes)

    @staticmethod
    def _share_memory(nbytes: int) -> _Shared:
        segment = hal.ipc.SharedSegment(nbytes, SEGMENT_PREFIX)
        return _Shared(segment.tensor, {"name": segment.name, "size": nbytes}, segment.unlink, segment.name)

    def _ensure_buffer(self) -> _Shared:
        if self._buffer is None:
            self._buffer = self._share(NUM_BUCKETS * self.bucket_size)
        return self._buffer

    def _offer(self, peer: _Peer, primary: _Shared, ident: dict[str, Any]) -> Any:
        """Return the first message to ``peer``: ``primary``'s handle, or the shared-memory copy's for a rollout on it."""
        if peer.transport == "shm" and self.transport == "device":
            if self._mirror is None:
                self._mirror = self._share_memory(NUM_BUCKETS * self.bucket_size)
            primary = self._mirror
        return {**primary.handshake, "trainer": ident} if isinstance(primary.handshake, dict) else primary.handshake

    def _mirrored(self, msg: dict[str, Any], primary: _Shared) -> dict[str, Any]:
        """Copy the bytes ``msg`` names from ``primary`` into its bucket of the shared-memory copy; return its message."""
        entries = msg["bucket_meta"]
        if not entries:
            return {**msg, "in_place": False, "transient": False}
        low, high = _span(entries.values())
        slot = (msg["index"] % NUM_BUCKETS) * self.bucket_size
        self._mirror.tensor[slot:slot + high - low].copy_(primary.tensor[low:high])
        self._torch_device.synchronize()
        return {**msg, "bucket_meta": {n: {**e, "offset": e["offset"] - low + slot} for n, e in entries.items()},
                "in_place": False, "transient": False}

    def publish_buffer(self, nbytes: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Return a flat ``uint8`` buffer of ``nbytes`` on this engine's device, shared with the rollouts.

        An update whose tensors are all contiguous views of it is sent without a copy. The same buffer is returned
        while ``nbytes`` is unchanged; it lives until :meth:`release_publish_buffer`, :meth:`close`, or (with
        ``release_at_finalize``) :meth:`finalize`; a failed update does not free it. Raises ``OSError`` when
        ``/dev/shm`` cannot hold it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise CheckpointConfigError(f"publish_buffer needs a positive int of bytes, got {nbytes!r}")
        if device is not None and hal.get_device(str(device)) != self.device:
            raise CheckpointConfigError(f"publish_buffer on {device} asked of an ipc engine on {self.device}: the "
                                        f"buffer is this engine's (build the engine with device={device!r})")
        if self.rank is not None and self.rank > 0:
            raise CheckpointConfigError(f"publish_buffer is the trainer's; this engine is rollout rank {self.rank}")
        if self._publish is None or self._publish.tensor.numel() != nbytes:
            self.release_publish_buffer()
            self._publish = self._share(nbytes)
        return self._publish.tensor

    def release_publish_buffer(self) -> None:
        """Free the :meth:`publish_buffer`; the memory goes with the last tensor viewing it."""
        shared, self._publish = self._publish, None
        if shared is not None and shared.release is not None:
            shared.release()

    def _publish_offset(self, name: str, tensor: torch.Tensor) -> int | None:
        """Return where ``tensor`` starts in the publish buffer (bytes), or ``None`` if it is not a contiguous view."""
        shared = self._publish
        if shared is None or tensor.device != shared.tensor.device or not tensor.is_contiguous():
            return None
        if tensor.numel() == 0:  # nothing to read, wherever it is (its pointer may be null)
            return 0
        if tensor.untyped_storage().data_ptr() != shared.tensor.untyped_storage().data_ptr():
            return None
        return tensor.data_ptr() - shared.tensor.data_ptr()

    @property
    def segment_name(self) -> str | None:
        """The shared-memory segment behind the buffer, or ``None`` (no buffer yet, or device IPC)."""
        if self._opened is not None:  # a rollout: the segment it opened
            return self._opened[2]
        return None if self._buffer is None else self._buffer.segment

    def _fill(self, weights: Iterator[NamedTensor], step: int | None, ident: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Copy ``weights`` into the buffer bucket by bucket, yielding each bucket's message once filled."""
        buffer, size = self._buffer.tensor, self.bucket_size
        index, offset, meta = 0, 0, {}

        def message(is_last: bool) -> dict[str, Any]:
            return {"bucket_meta": meta, "is_last": is_last, "global_steps": step, "bucket_size": size,
                    "index": index, "trainer": ident}

        for name, tensor in weights:
            tensor = tensor.detach()
            nbytes = tensor.numel() * tensor.element_size()
            start = align(offset)
            if meta and (start + nbytes > size or name in meta):
                yield message(False)
                index, offset, meta, start = index + 1, 0, {}, 0
            base = (index % NUM_BUCKETS) * size
            if nbytes <= size:
                if nbytes:
                    byte_view(buffer, base + start, tensor.dtype, tensor.shape).copy_(tensor, non_blocking=True)
                meta[name] = {"name": name, "shape": tensor.shape, "dtype": tensor.dtype, "offset": base + start,
                              "handle": None}
                offset = start + nbytes
                continue
            flat = as_bytes(tensor.contiguous())  # a tensor larger than a bucket travels in slices
            for first in range(0, nbytes, size):
                length = min(size, nbytes - first)
                base = (index % NUM_BUCKETS) * size
                buffer[base:base + length].copy_(flat[first:first + length], non_blocking=True)
                meta = {name: {"name": name, "shape": tensor.shape, "dtype": tensor.dtype, "offset": base,
                               "handle": None, "chunk": (first, length, nbytes)}}
                yield message(False)
                index, offset, meta = index + 1, 0, {}
        yield message(True)

    def _fill_in_place(self, weights: Iterator[NamedTensor], step: int | None,
                       ident: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield the messages of an update staged in the publish buffer, each spanning at most a bucket."""
        size, index, meta, span = self.bucket_size, 0, {}, None

        def message(is_last: bool) -> dict[str, Any]:
            return {"bucket_meta": meta, "is_last": is_last, "global_steps": step, "bucket_size": size,
                    "index": index, "in_place": True, "transient": self.release_at_finalize, "trainer": ident}

        for name, tensor in weights:
            offset = self._publish_offset(name, tensor)
            if offset is None:
                raise CheckpointConfigError(
                    f"tensor {name!r} is not a contiguous view of the ipc engine's publish_buffer, but the update's "
                    "first tensor was: stage every tensor of an update there, or none")
            nbytes = tensor.numel() * tensor.element_size()
            entry = {"name": name, "shape": tensor.shape, "dtype": tensor.dtype, "offset": offset, "handle": None}
            if nbytes <= size:
                wider = (offset, offset + nbytes) if span is None else (min(span[0], offset),
                                                                         max(span[1], offset + nbytes))
                if meta and (wider[1] - wider[0] > size or name in meta):
                    yield message(False)
                    index, meta, wider = index + 1, {}, (offset, offset + nbytes)
                meta[name], span = entry, wider
                continue
            if meta:
                yield message(False)
                index, meta = index + 1, {}
            for first in range(0, nbytes, size):
                meta = {name: {**entry, "offset": offset + first, "chunk": (first, min(size, nbytes - first), nbytes)}}
                yield message(False)
                index, meta = index + 1, {}
            span = None
        yield message(True)

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: bool | Digester = False) -> None:
        """Send ``weights`` to every rollout, tagged ``global_steps``; return when every rollout is done with them
        and every reporting one applied it (``check``: and serves it, :mod:`ckpt.checker`).

        Raises :class:`TransferError` when a rollout refuses, naming it and its error (the others are told at once
        and keep their step) or when it dies, :class:`TransferTimeoutError` after ``timeout``,
        :class:`CheckpointConfigError` when another process holds the endpoint (any of these frees the buffers);
        :class:`UpdateRefusedError` or :class:`WeightCheckError` from a reporting rollout's word."""
        step = check_global_steps(global_steps)
        if check and self.senders > 0:
            raise CheckpointConfigError("the ipc engine's resharding path carries no weight check (check=True)")
        if self.senders > 0 and self.rank is not None and 0 <= self.rank < self.senders:
            layouts = layouts_by_rank(self.rollout_layouts, range(self.senders, self.world_size))
            io = self._resharding_channel()
            parts = await held_or_abort(io, self.rank, layouts, weights, step, self.bucket_size)
            await send_update(io, self.rank, layouts, parts, step, self.bucket_size)
            return
        self._check_place("send")
        if self.rank == -1:
            for _ in weights:
                pass
            return
        ok, ident, peers = False, self.identity, []
        pairs, in_place = self._peek(weights)
        digester = check if isinstance(check, Digester) else Digester() if check else None
        if digester is not None and digester is not check:
            pairs = digester.watch(pairs)
        try:
            primary = self._publish if in_place else self._ensure_buffer()
            peers = await self._sender_sockets()
            deadline = time.monotonic() + self.timeout
            for peer in peers:  # the handle first; bucket 0 is filled while the rollouts open it
                offer = self._offer(peer, primary, ident)
                await self._wait(lambda p=peer, o=offer: p.sock.send_pyobj(o), peer, "send of the buffer", deadline)
            pending, greeted = "reply to the buffer's handle", False
            fill = self._fill_in_place if in_place else self._fill
            for msg in self._guarded(fill(pairs, step, ident)):
                if isinstance(msg, BaseException):  # the trainer's weights failed: tell the rollouts, then raise
                    await self._abort(peers, pending, step, msg)
                    raise msg
                if self.transport == "device" or not self.spec.host_memory:
                    self._torch_device.synchronize()  # the copies into the bucket are done before it is announced
                if msg["is_last"] and digester is not None:
                    msg = {**msg, "check": digester.result()}  # what a reporting rollout compares its live weights with
                if not greeted:
                    await self._greet(peers, primary, ident, deadline, step)
                    greeted = True
                else:
                    await self._replies(peers, pending, deadline, step, tell_others=True)
                deadline = time.monotonic() + self.timeout
                mirrored = None
                for peer in peers:
                    out = msg
                    if peer.transport == "shm" and self.transport == "device":
                        mirrored = out = mirrored or self._mirrored(msg, primary)
                    await self._wait(lambda p=peer, m=out: p.sock.send_pyobj(m), peer, "send of a bucket", deadline)
                pending = f"reply for bucket {msg['index']}"
            replies = await self._replies(peers, pending, deadline, step)
            ok = True
        finally:
            if not ok:
                self._free()  # nothing half-done survives: the next update starts from new buffers
            elif not all(peer.hal for peer in peers):  # a verl receiver: new sockets next update (see HAL_HELLO; measured: 1 update in 2 lost)
                self._close_sockets()
        self._judge(peers, replies, step)

    def _judge(self, peers: list[_Peer], replies: list[bytes], step: int | None) -> None:
        """Keep the reporting rollouts' words as :attr:`outcomes`; raise a refusal, then a failed check, naming each."""
        self._updates += 1
        words = {p.name: json.loads(r[len(REPORTED):]) for p, r in zip(peers, replies) if r.startswith(REPORTED)}
        self.outcomes = {who: Outcome(self._updates, step, w.get("error"), w.get("mismatches"))
                         for who, w in words.items()}
        refused = {who: o.error for who, o in self.outcomes.items() if o.error is not None}
        if refused:
            raise UpdateRefusedError(f"step {step} was not applied by {len(refused)} of {len(words)} reporting "
                                     f"rollouts: " + "; ".join(f"{who}: {why}" for who, why in refused.items()),
                                     refused, self.outcomes)
        wrong = {who: o.mismatches for who, o in self.outcomes.items() if o.mismatches}
        if wrong:
            raise WeightCheckError(f"the weight check of step {step} failed: " + "; ".join(
                f"{who}: {', '.join(found)}" for who, found in wrong.items()), wrong, self.outcomes)

    def _peek(self, weights: Iterable[NamedTensor]) -> tuple[Iterator[NamedTensor], bool]:
        """Return ``(pairs, staged in the publish buffer?)``; an error of the iterable is raised where pairs are read."""
        pairs, head = named_tensors(weights), []
        try:
            while not head or head[-1][1].numel() == 0:  # empty tensors say nothing of where the update is
                head.append(next(pairs))
        except StopIteration:
            return iter(head), False
        except Exception as exc:  # noqa: BLE001 - raised again where the pairs are read
            error = exc

            def failing() -> Iterator[NamedTensor]:
                yield from head
                raise error

            return failing(), False
        return itertools.chain(head, pairs), self._publish_offset(*head[-1]) is not None

    @staticmethod
    def _guarded(messages: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any] | Exception]:
        """Yield ``messages``, ending with the exception that producing the next one raised."""
        while True:
            try:
                yield next(messages)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - handed to send_weights, which tells the rollouts and raises it
                yield exc
                return

    async def _abort(self, peers: list[_Peer], pending: str, step: int | None, error: BaseException) -> None:
        """Tell every rollout that did not refuse that the update is abandoned; best effort."""
        deadline = self._abort_deadline()
        waiting = []
        for peer in peers:  # every reply read, a refusal too: none is left on its socket
            try:
                if not (await self._wait(peer.reply, peer, pending, deadline)).startswith(REFUSED):
                    waiting.append(peer)  # a refusing rollout expects nothing more of this update
            except (TransferError, TransferTimeoutError):
                pass  # this rollout times out instead
        await self._tell_abort(waiting, step, f"the trainer's weights failed: {type(error).__name__}: {error}",
                               deadline)

    def _abort_deadline(self) -> float:
        return time.monotonic() + min(self.timeout, ABORT_S)

    async def _tell_abort(self, peers: list[_Peer], step: int | None, why: str, deadline: float) -> None:
        """Send each of ``peers`` the update's abort and read its reply; best effort, until ``deadline``."""
        abort = {"bucket_meta": {}, "is_last": True, "global_steps": step, "abort": why, "trainer": self.identity}
        for peer in peers:
            try:
                await self._wait(lambda p=peer: p.sock.send_pyobj(abort), peer, "abort", deadline)
                await self._wait(peer.reply, peer, "reply to the abort", deadline)
            except (TransferError, TransferTimeoutError):
                pass

    async def _sender_sockets(self) -> list[_Peer]:
        import zmq

        if not self._peers:
            peers = []
            try:
                for r in range(1, self.world_size):
                    sock = self._context().socket(zmq.REQ)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.REQ_RELAXED, 1)  # a request may follow one whose reply never came
                    sock.setsockopt(zmq.REQ_CORRELATE, 1)  # and that late reply is dropped
                    pid = self.peer_pids[r - 1] if self.peer_pids and len(self.peer_pids) >= r else None
                    endpoint = rollout_endpoint(self.endpoint, r)
                    peers.append(_Peer(sock, f"rollout rank {r}", pid))
                    await self._bind(sock, endpoint)
                    peers[-1].endpoint = endpoint
            except BaseException:
                self._peers = peers
                self._close_sockets()
                raise
            self._peers = peers
        return self._peers

    async def _bind(self, sock: Any, endpoint: str) -> None:
        import zmq

        closed = _closed_here.get(endpoint)
        while True:  # a socket this process closed on that endpoint may still hold it, for a moment
            try:
                sock.bind(endpoint)
                _closed_here.pop(endpoint, None)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise TransferError(f"cannot bind the ipc engine's endpoint {endpoint}: {exc}") from exc
                if closed is None or time.monotonic() > closed + min(self.timeout, REBIND_S):
                    raise CheckpointConfigError(
                        f"the ipc endpoint {endpoint} is in use by another process (another job's trainer?); a "
                        f"trainer does not take over an endpoint in use: give each job its own endpoint, or leave "
                        f"endpoint unset for a new one") from exc
                await asyncio.sleep(0.01)

    async def _greet(self, peers: list[_Peer], primary: _Shared, ident: dict[str, Any], deadline: float,
                     step: int | None) -> None:
        """Read every rollout's hello; send shared memory to one that cannot open ``primary``; raise a refusal."""
        replies = [await self._wait(peer.reply, peer, "reply to the buffer's handle", deadline) for peer in peers]
        for i, peer in enumerate(peers):
            hello = _hello(replies[i])
            peer.hal = hello is not None
            if hello is not None and not hello.get("opened", True) and peer.transport is None:
                peer.transport = "shm"  # every kind opens shared memory; the rollout keeps it while the socket lives
                offer = self._offer(peer, primary, ident)
                await self._wait(lambda p=peer, o=offer: p.sock.send_pyobj(o), peer, "send of the buffer", deadline)
                replies[i] = await self._wait(peer.reply, peer, "reply to the shared-memory buffer", deadline)
        await self._refused(peers, replies, step, tell_others=True)

    async def _replies(self, peers: list[_Peer], what: str, deadline: float, step: int | None,
                       tell_others: bool = False) -> list[bytes]:
        """Read every rollout's reply to ``what``; raise the first refusal, telling the others first with ``tell_others``."""
        replies = [await self._wait(peer.reply, peer, what, deadline) for peer in peers]
        return await self._refused(peers, replies, step, tell_others)

    async def _refused(self, peers: list[_Peer], replies: list[bytes], step: int | None,
                       tell_others: bool) -> list[bytes]:
        """Return ``replies``, or raise the first refusal among them, telling the others first with ``tell_others``."""
        refused = [(peer, reply) for peer, reply in zip(peers, replies) if reply.startswith(REFUSED)]
        if not refused:
            return replies
        peer, reply = refused[0]
        why = f"{peer.name} refused the update of global_steps={step}: {reply[len(REFUSED):].decode(errors='replace')}"
        if tell_others:
            await self._tell_abort([p for p, r in zip(peers, replies) if not r.startswith(REFUSED)], step, why,
                                   self._abort_deadline())
        raise TransferError(why)

    # ---- a rollout -----------------------------------------------------------------------------------------
    def _open(self, handshake: Any) -> torch.Tensor:
        """Open the trainer's buffer from its handshake, once, kept while the trainer keeps it."""
        if isinstance(handshake, dict) and "name" in handshake:
            key = ("shm", handshake["name"], int(handshake["size"]))
        elif hal.ipc.is_ipc_handle(handshake):
            key = ("device", pickle.dumps(handshake[1][:hal.ipc.DEVICE_INDEX_ARG]))
        else:
            raise TransferError(f"the trainer's first message is neither a device handle nor a shared segment: "
                                f"{type(handshake).__name__}")
        if self._opened is None or self._opened[0] != key:
            self._opened, self._staging = None, None
            if key[0] == "shm":
                buffer, segment = hal.ipc.attach_shared_segment(key[1], key[2]), key[1]
            else:
                buffer = hal.ipc.open_ipc_handle(handshake, self.device.index)
                segment = handshake[1][0] if isinstance(handshake[1][0], str) else None  # the sim's segment
            self._opened = (key, buffer, segment)
        return self._opened[1]

    def _opens(self) -> list[str]:
        """What this rollout opens: device handles where its transport is ``"device"``, shared memory always."""
        return ["device", "shm"] if self.transport == "device" else ["shm"]

    def _hello_bytes(self, cannot: str | None = None) -> bytes:
        return HAL_HELLO + b" " + json.dumps({"opened": cannot is None, "opens": self._opens(), "why": cannot}).encode()

    def _check_trainer(self, msg: Any) -> None:
        why = self._foreign(msg)
        if why is not None:
            raise ForeignTrainerError(why)

    def _foreign(self, msg: Any) -> str | None:
        """Say why ``msg`` is from a trainer this rollout was not built for; ``None`` when it is not."""
        offered = _trainer_of(msg)
        if not isinstance(offered, dict):
            return None  # verl's sender names no trainer
        want = dict(self._pin or {})
        if self.job is not None:
            want.setdefault("job", self.job)
        if self.peer_pids:
            want["pid"] = self.peer_pids[0]
        if all(offered.get(k) == v for k, v in want.items()):
            return None
        def words(d: dict) -> str:
            return ", ".join(f"{k} {d.get(k)!r}" for k in ("job", "generation", "pid") if k in want)

        return (f"the trainer at {rollout_endpoint(self.endpoint, self.rank)} is {words(offered)}, but this rollout "
                f"was built for {words(want)}: two jobs on one endpoint? (give each job its own endpoint)")

    def _accept(self, handshake: Any) -> tuple[torch.Tensor | None, bytes]:
        """Open the trainer's buffer; return it (``None`` if not opened) and the reply: the hello, or a refusal.

        A device handle this rollout cannot open gets a hello asking for shared memory; a buffer already gone (its
        segment unlinked: an update the trainer gave up, still queued here) a refusal."""
        if hal.ipc.is_ipc_handle(handshake) and "device" not in self._opens():
            return None, self._hello_bytes(f"a {self.spec.kind} rollout on transport {self.transport!r} opens shared "
                                           f"memory only")
        try:
            return self._open(handshake), self._hello_bytes()
        except FileNotFoundError as exc:
            return None, REFUSED + f"TransferError: the trainer's buffer is gone ({exc})".encode()
        except Exception as exc:  # another kind's handle: shared memory instead
            if not hal.ipc.is_ipc_handle(handshake):
                raise
            return None, self._hello_bytes(f"{type(exc).__name__}: {exc}")

    async def _handshake(self, sock: Any, trainer: _Peer, deadline: float) -> Any:
        """Return the first message of an update (or a foreign trainer's), answering those of an update this rollout
        left (timed out)."""
        while True:
            msg = await self._wait(sock.recv_pyobj, trainer, "buffer handle", deadline)
            if not isinstance(msg, dict) or "bucket_meta" not in msg or _trainer_of(msg) is None or self._foreign(msg):
                return msg
            await sock.send(b"" if msg.get("abort") else REFUSED + b"TransferError: this rollout left that update "
                            b"(it timed out or stopped) and waits for the next")

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the update's ``(name, tensor)`` pairs in the trainer's order, on this rollout's device.

        Raises :class:`TransferAbortedError` when the trainer's weights failed mid-update (what was yielded is
        incomplete), :class:`TransferError` when the trainer died (its segment is then unlinked here),
        :class:`ForeignTrainerError` for a trainer it was not built for. An error the consumer throws in
        (``athrow``) is the refusal the trainer raises, with its type and text."""
        step = check_global_steps(global_steps)
        placement = as_placement(placement)
        if self.senders > 0 and self.rank is not None and self.rank >= self.senders:
            def on_step(agreed: int | None) -> None:
                self.received_global_steps = agreed

            stream = receive_update(self._resharding_channel(), self.rank, list(range(self.senders)),
                                    self.rollout_layout, step, placement, on_step)
            try:
                async for item in stream:
                    yield item
            finally:  # an early aclose() drains the rest now
                await stream.aclose()
            return
        self._check_place("receive")
        import zmq

        if self._rep is None:  # made on the first update, kept for the topology (see HAL_HELLO)
            self._rep = self._context().socket(zmq.REP)
            self._rep.setsockopt(zmq.LINGER, 0)
            self._rep.setsockopt(zmq.RECONNECT_IVL, 5)  # a trainer that binds per update (verl's) is found soon
            self._rep.connect(rollout_endpoint(self.endpoint, self.rank))
        sock = self._rep
        trainer = _Peer(sock, "the trainer", self.peer_pids[0] if self.peer_pids else None)
        owe_reply, complete, error, buffer = False, False, None, None
        transient = False  # the trainer's publish buffer, freed after this update: let go of it at the end
        armed, self._armed = self._armed, False  # an arm is for one update
        try:
            if self._owed is not None and self._owed[0] is sock:  # the last update's word never came
                self._owed = None
                await sock.send(REFUSED + b"TransferError: the rollout's consumer promised a report and made none")
            msg = await self._handshake(sock, trainer, time.monotonic() + self.timeout)
            owe_reply = True
            while not (isinstance(msg, dict) and "bucket_meta" in msg):  # every buffer offered is answered; the update
                self._check_trainer(msg)  # starts at the first bucket, in the buffer last opened
                buffer, reply = self._accept(msg)
                await sock.send(reply)
                owe_reply = False
                msg = await self._wait(sock.recv_pyobj, trainer, "bucket", time.monotonic() + self.timeout)
                owe_reply = True
            first, parts = True, {}
            while True:
                self._check_trainer(msg)
                if msg.get("abort"):
                    raise TransferAbortedError(f"global_steps={msg.get('global_steps')}: {msg['abort']}")
                if buffer is None:
                    raise TransferError("the trainer sent a bucket without a buffer this rollout opened (verl's sender "
                                        "to a rollout that cannot open its device handle: use_shm=True)")
                if first:
                    offered = msg.get("global_steps")
                    check_step(step, offered, "ipc hand-over")
                    self.received_global_steps, first = offered, False
                left = sum(1 for e in msg["bucket_meta"].values()  # items this message completes
                           if not e.get("chunk") or e["chunk"][0] + e["chunk"][1] >= e["chunk"][2])
                async for item in self._bucket(buffer, msg, placement, parts):
                    left -= 1
                    complete = msg["is_last"] and left == 0 and not parts
                    yield item
                transient = transient or bool(msg.get("in_place") and msg.get("transient"))
                if msg["is_last"]:
                    break
                if not self.spec.host_memory:
                    self._torch_device.synchronize()  # the consumer's copies out of the bucket are done
                if transient:
                    self._drop_read(buffer, msg)
                await sock.send(b"")
                owe_reply = False
                msg = await self._wait(sock.recv_pyobj, trainer, "bucket", time.monotonic() + self.timeout)
                owe_reply = True
                if not isinstance(msg, dict) or "bucket_meta" not in msg:
                    raise TransferError(f"the trainer sent {type(msg).__name__}, not a bucket message (it gave up on "
                                        f"this update?)")
            if not self.spec.host_memory:
                self._torch_device.synchronize()
            last = self._settle(sock, msg, armed)  # the last reply: the trainer may reuse everything now
            if last is not None:
                await sock.send(last)
            owe_reply = False
        except BaseException as exc:
            error = exc
            if isinstance(exc, PeerFailure):
                # the trainer died: its segment would stay until its resource tracker ends (shared with its parent
                # under multiprocessing), so the rollout that saw it die removes the name; mappings stay valid
                segment = self.segment_name
                self._opened, self._staging = None, None
                if segment is not None:
                    hal.ipc.unlink_shared_segment(segment)
            raise
        finally:
            if owe_reply and complete:  # the consumer took the last item and stopped: a whole update
                if not self.spec.host_memory:
                    self._torch_device.synchronize()
                try:
                    last = self._settle(sock, msg, armed)
                    if last is not None:
                        sock.send(last, flags=zmq.NOBLOCK)
                    owe_reply = False
                except zmq.ZMQError:
                    pass
            if owe_reply:  # the trainer reads the refusal, with its cause, and abandons the update
                stopped = error is None or isinstance(error, (GeneratorExit, asyncio.CancelledError))
                why = "the receiver stopped before the end of the update" if stopped else f"{type(error).__name__}: {error}"
                try:
                    sock.send(REFUSED + why.encode(), flags=zmq.NOBLOCK)
                    owe_reply = False
                except zmq.ZMQError:
                    pass
            # the socket is kept (one closing beside a new one could swallow the next update's first message), unless
            # it owes a reply it could not send, or it is a foreign trainer's: leaving stops taking its messages
            if owe_reply or isinstance(error, ForeignTrainerError):
                self._rep = None
                sock.close(linger=0 if owe_reply else CLOSE_LINGER_MS)
            if transient:  # the trainer frees its publish buffer now: a mapping kept here would keep it alive
                self._opened, self._staging = None, None

    def promise_reports(self, arm: bool = True) -> bool:
        """Promise a :meth:`report_outcome` (``arm``: for the next update received): its last reply waits for it."""
        self._promised = True
        self._armed = self._armed or arm
        return True

    def report_outcome(self, error: BaseException | str | None = None, live: Any = None) -> None:
        """Tell the trainer the update last received was applied (``error`` ``None``) or refused, and for a checked
        one what ``live`` (``{name: tensor}`` or a callable giving it) serves otherwise. Any thread may call it."""
        owed, self._owed = self._owed, None
        if owed is None:
            return
        sock, expected = owed
        word: dict[str, Any] = {"error": None if error is None else error if isinstance(error, str)
                                else f"{type(error).__name__}: {error}"}
        if expected is not None and error is None:
            if live is None:
                word["mismatches"] = ["the rollout gave no live parameters to check (report_outcome(live=...))"]
            else:
                word["mismatches"] = mismatches(expected, served_digests(expected, live() if callable(live) else live))
        import zmq

        try:  # a plain socket over the same one: this may be another thread than the event loop's
            zmq.Socket.shadow(sock.underlying).send(REPORTED + json.dumps(word).encode(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the trainer's wait names this rollout

    def _settle(self, sock: Any, msg: dict[str, Any], armed: bool) -> bytes | None:
        """Return the last reply of a whole update, or ``None`` when the consumer's report will send it (armed)."""
        if armed:
            self._owed = (sock, msg.get("check"))
            return None
        if msg.get("check") is None or not self._promised:
            return b""
        return REPORTED + json.dumps({"error": None, "mismatches": [UNCHECKED]}).encode()

    def _drop_read(self, buffer: torch.Tensor, msg: dict[str, Any]) -> None:
        """Drop the pages of one read message from this rollout's resident memory."""
        if msg["bucket_meta"]:
            low, high = _span(msg["bucket_meta"].values())
            self.spec.drop_shared_pages(buffer, low, high - low)

    def _target(self, placement: ReceivePlacement | None, e: dict[str, Any]) -> torch.Tensor | None:
        target = placement.target(e["name"], e["dtype"], torch.Size(e["shape"])) if placement is not None else None
        if (target is not None and target.is_contiguous() and target.dtype == e["dtype"]
                and target.shape == torch.Size(e["shape"]) and target.device == self.device):
            return target
        return None

    def _staged(self, buffer: torch.Tensor, entries: list[dict[str, Any]], bucket_size: int) -> tuple[torch.Tensor, int]:
        """Return ``(source, shift)``: the buffer, or the bytes ``entries`` span copied once to the device bucket."""
        if buffer.device == self.device or not entries:
            return buffer, 0
        shift, high = _span(entries)
        if self._staging is None or self._staging.numel() < high - shift:
            self._staging = torch.empty(max(high - shift, bucket_size), dtype=torch.uint8, device=self.device)
        self._staging[:high - shift].copy_(buffer[shift:high])
        return self._staging, shift

    async def _bucket(self, buffer: torch.Tensor, msg: dict[str, Any], placement: ReceivePlacement | None,
                      parts: dict[str, torch.Tensor]) -> AsyncIterator[NamedTensor]:
        """Yield the tensors of one bucket message, assembling chunks across messages in ``parts``."""
        entries = list(msg["bucket_meta"].values())
        targets = [None if e.get("handle") is not None else self._target(placement, e) for e in entries]
        staged = [e for e, t in zip(entries, targets) if t is None and e.get("handle") is None]
        source, shift = self._staged(buffer, staged, msg.get("bucket_size", 0))
        for e, target in zip(entries, targets):
            name, shape, dtype = e["name"], torch.Size(e["shape"]), e["dtype"]
            if e.get("handle") is not None:  # verl's sender sends a tensor above its bucket as a handle
                yield name, hal.ipc.open_ipc_handle(e["handle"], self.device.index)
                continue
            src, offset = (buffer, e["offset"]) if target is not None else (source, e["offset"] - shift)
            chunk = e.get("chunk")
            if chunk is None:
                view = byte_view(src, offset, dtype, shape)
                if target is not None:
                    target.copy_(view)
                    view = target
                yield name, view
                continue
            first, length, nbytes = chunk
            whole = parts.get(name)
            if whole is None:
                whole = target if target is not None else torch.empty(shape, dtype=dtype, device=self.device)
                parts[name] = whole
            as_bytes(whole)[first:first + length].copy_(src[offset:offset + length])
            if first + length >= nbytes:
                del parts[name]
                yield name, whole


__all__ = ["ForeignTrainerError", "HAL_HELLO", "IpcCheckpointEngine", "NUM_BUCKETS", "SEGMENT_PREFIX", "default_endpoint", "default_job", "rollout_endpoint"]
