"""The base of the one-to-many checkpoint engines (collective, nixl, mooncake, kimi): one trainer rank sends.

Shared here, each engine keeping only its transport: argument checks (no swallowed keywords), membership
and verl's ``prepare`` / ``build_topology`` / ``init_process_group`` sequence with generation numbering
(what an engine set up is kept while the topology is unchanged), and the role of each rank.

Ranks: 0 is the trainer that sends (``src_rank``), 1..N the rollouts, -1 a trainer rank outside the group
(its ``send_weights`` drains the iterator). With ``multi_sender``: trainer ranks 0..S-1 all send, rollouts
are S..S+N-1 (:mod:`ckpt.multi_sender`)."""

from __future__ import annotations

import abc
import dataclasses
import inspect
import socket
from typing import Any, Iterable

import hal
from ckpt import control
from ckpt.base import CheckpointEngine, NamedTensor, check_direct_threshold, check_seconds
from ckpt.errors import CheckpointConfigError

DEFAULT_BUCKET_SIZE = 256 << 20  # Default bucket size in bytes (256 MiB).

# Keywords verl 0.9.1 passes to every engine's constructor besides engine_kwargs; every engine takes them.
VERL_KEYWORDS = ("bucket_size", "is_master")


def check_keywords(given: dict[str, Any], accepted: Iterable[str], where: str) -> None:
    """Raise :class:`CheckpointConfigError` naming each keyword of ``given`` (``where`` takes none of them)."""
    if given:
        raise CheckpointConfigError(f"{where} got unknown keyword(s) {', '.join(map(repr, sorted(given)))}; it "
                                    f"accepts {', '.join(sorted(set(accepted)))}")


def named_parameters(fn: Any) -> list[str]:
    """Return ``fn``'s keyword-capable parameter names (no ``self``, ``*args``, ``**kwargs``)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def parse_store_addr(store_addr: Any) -> tuple[str, int]:
    """Parse ``"host:port"`` into ``("host", port)``."""
    host, sep, port = store_addr.rpartition(":") if isinstance(store_addr, str) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise CheckpointConfigError(f"store_addr must be 'host:port', got {store_addr!r}")
    return host, int(port)


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """Validate an ``int`` (not ``bool``) in ``[low, high)`` (``high`` ``None``: unbounded)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value >= high)):
        accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r}")
    return value


def local_address_towards(addr: str) -> str:
    """Return the local address this host uses to reach ``addr`` (no packet sent); ``addr`` itself if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return addr


def host_address() -> str:
    """Return this host's address as its name resolves, else ``127.0.0.1``."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Membership:
    """One rank's place in a one-to-many group.

    ``master_addr`` may be ``None`` on the sender until it picks one; ``generation`` numbers the group (a changed
    topology forms a new one, with fresh keys); ``senders`` > 1 only with ``multi_sender``."""

    rank: int
    world_size: int
    master_addr: str | None
    master_port: int | None
    generation: int = 0
    src_rank: int = 0
    senders: int = 1
    reshard: bool = False  # each rollout rank receives only the slices its layout keeps (ckpt.reshard)

    @classmethod
    def checked(cls, rank: Any, world_size: Any, master_addr: Any, master_port: Any, generation: Any = 0,
                src_rank: Any = 0, min_world_size: int = 1, senders: Any = 1, reshard: Any = False) -> Membership:
        """Build a :class:`Membership` from arguments as given, checking each."""
        check_int(world_size, "world_size", min_world_size)
        check_int(rank, "rank", 0, world_size)
        check_int(src_rank, "src_rank", 0, world_size)
        if master_addr is not None and (not isinstance(master_addr, str) or not master_addr):
            raise CheckpointConfigError(f"master_addr must be a host name or address, got {master_addr!r}")
        if master_port is not None:
            check_int(master_port, "master_port", 1, 65536)
        check_int(generation, "generation", 0)
        check_int(senders, "num_senders", 1, world_size)
        if not isinstance(reshard, bool):
            raise CheckpointConfigError(f"reshard must be True or False, got {reshard!r}")
        return cls(rank, world_size, master_addr, master_port, generation, src_rank, senders, reshard)


class OneToManyEngine(CheckpointEngine):
    """Base of the engines where one trainer rank sends to N rollout ranks (see the module overview).

    ``device`` fixes the engine's device at construction (the index given, else ``LOCAL_RANK``'s); every call
    binds it in the calling thread, so a send from an executor thread uses this rank's device. ``timeout``:
    seconds bounding every wait. ``direct_threshold``: bytes from which tensors are sent from their own memory.
    ``multi_sender``: only the master's value counts, and only where ``supports_multi_sender``."""

    min_bucket_size = 1  # The smallest bucket_size (bytes) the engine's wire format works with.
    min_world_size = 1  # The smallest group: 1 (the sender alone) or 2.

    send_buffer_words = "three buckets (two send buffers and the one in flight)"

    bucketed = True
    hosts_rendezvous = True  # the master's store (``master_addr``), or one named by ``store_addr``

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        return {"buckets_bytes": 3 * bucket_size}

    def __init__(self, *, bucket_size: int = DEFAULT_BUCKET_SIZE, is_master: bool = False,
                 rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, store_addr: str | None = None, src_rank: int = 0,
                 device: str | None = None, timeout: float = hal.DEFAULT_TIMEOUT_S,
                 direct_threshold: int | None = None, host: str | None = None, multi_sender: bool = False) -> None:
        if store_addr is not None:
            master_addr, master_port = parse_store_addr(store_addr)
        lowest = self.min_bucket_size
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < lowest:
            raise CheckpointConfigError(f"bucket_size must be an int >= {lowest}"
                                        f"{' bytes' if lowest > 1 else ''}, got {bucket_size!r}")
        if master_port is not None:
            check_int(master_port, "master_port", 0, 65536)
        if not isinstance(multi_sender, bool) or (multi_sender and not self.supports_multi_sender):
            raise CheckpointConfigError(f"multi_sender must be True or False"
                                        f"{'' if self.supports_multi_sender else ' (False: ' + type(self).__name__ + ' has one sender)'}"
                                        f", got {multi_sender!r}")
        self.multi_sender = multi_sender
        self.rollout_layouts: list | None = None  # sender, resharding: every rollout rank's layout (None: whole)
        self.senders = 1
        self.bucket_size, self.is_master = bucket_size, bool(is_master)
        self.timeout = check_seconds(timeout)
        self.direct_threshold = check_direct_threshold(direct_threshold, bucket_size)
        self.local = hal.resolve_local_device(device)  # resolved once: every update binds it (issue 30)
        self.device_kind, self.host = str(self.local), host
        self.master_addr, self.master_port = master_addr, master_port
        self._store_at: tuple[str, int] | None = None  # where this engine's store is (_host_store records it)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.src_rank = 0
        self._membership: Membership | None = None  # the group this engine is to be in (None: not yet told)
        self._joined: Membership | None = None  # the group what the engine set up was made for
        self._generation = 0  # the highest group generation this engine joined
        self._sending: int | None = None  # sender: the step of the update in progress (None: none)
        self._sent: int | None = None  # sender: the step of the last update it finished
        if rank is not None or world_size is not None:  # standalone: the place is known now
            check_int(world_size, "world_size", self.min_world_size)
            if isinstance(rank, int) and not isinstance(rank, bool) and rank == -1:
                self.rank, self.world_size = -1, world_size
            else:
                self._set_membership(Membership.checked(rank, world_size, master_addr, master_port, 0, src_rank,
                                                        self.min_world_size))

    # Constructor keywords a subclass takes before passing the rest on (for the message).
    extra_keywords: tuple[str, ...] = ()

    def _bind(self) -> None:
        """Make this engine's device the calling thread's current one (no-op on host kinds)."""
        self.local.bind()

    def _check_extra(self, extra: dict[str, Any], method: Any, where: str) -> None:
        accepted = named_parameters(method) + (list(self.extra_keywords) if where == "__init__" else [])
        check_keywords(extra, accepted, f"{type(self).__name__}.{where}()")

    # ---- role --------------------------------------------------------------------------------------
    def _set_membership(self, membership: Membership | None) -> None:
        self._membership = membership
        if membership is None:  # a trainer rank outside the group (verl gives it rank -1)
            self.rank, self.src_rank, self.senders = -1, 0, 1
            return
        self.rank, self.world_size, self.src_rank = membership.rank, membership.world_size, membership.src_rank
        self.senders = membership.senders
        if membership.master_addr is not None:
            self.master_addr = membership.master_addr
        if membership.master_port is not None:
            self.master_port = membership.master_port

    @property
    def is_sender(self) -> bool:
        if self.rank is None:
            return self.is_master
        if self.senders > 1:
            return 0 <= self.rank < self.senders
        return self.rank >= 0 and self.rank == self.src_rank

    @property
    def topology(self) -> dict[str, Any] | None:
        """This rank's place, ``{"rank", "world_size", "src_rank", "role", "receivers"}`` (``"senders"`` with several)."""
        if self.rank is None:
            return None
        if self.rank < 0:
            return {"rank": -1, "world_size": None, "src_rank": self.src_rank, "role": "outside", "receivers": []}
        if self.senders > 1:
            return {"rank": self.rank, "world_size": self.world_size, "src_rank": self.src_rank,
                    "role": "sender" if self.is_sender else "receiver", "senders": list(range(self.senders)),
                    "receivers": list(range(self.senders, self.world_size))}
        return {"rank": self.rank, "world_size": self.world_size, "src_rank": self.src_rank,
                "role": "sender" if self.is_sender else "receiver",
                "receivers": [r for r in range(self.world_size) if r != self.src_rank]}

    def _label(self, rank: int) -> str:
        if rank == self.src_rank:
            return "the trainer (rank 0" + (f" at {self.master_addr}:{self.master_port})" if self.master_addr
                                            else ")")
        return f"rollout rank {rank}"

    # ---- verl's lifecycle ----------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Return ``{"is_master", "master_addr", "master_port", "generation", "joined"}``; the master hosts first.

        ``joined`` is the membership this engine holds set up, else ``None``; ``"multi_sender": True`` with it."""
        self._bind()
        master = self.is_master or (self._membership is not None and self._membership.rank == self.src_rank)
        if master:
            self._host_rendezvous()
        self._prepare_buffers()
        joined = self._joined if self._joined is not None and self.is_healthy() else None
        out = {"is_master": master, "master_addr": self.master_addr, "master_port": self.master_port,
               "generation": self._generation, "joined": dataclasses.asdict(joined) if joined else None}
        if self.multi_sender:
            out["multi_sender"] = True
        return out

    def _host_rendezvous(self) -> None:
        """On the master: make rank 0 reachable at ``master_addr:master_port`` (picking them if unset)."""

    def _host_store(self) -> Any:
        """Host the group's store at ``master_addr`` (else ``host``, else this host) and record where it is."""
        addr = self.master_addr or self.host or host_address()
        store = control.host_store(addr, self.master_port, self.timeout)
        self.master_addr, self.master_port = addr, int(store.port)
        self._store_at = (self.master_addr, self.master_port)
        return store

    def _store_moved(self) -> bool:
        """Return whether the group now looks for this engine's store elsewhere than where it was hosted."""
        return self._store_at != (self.master_addr, self.master_port)

    def _prepare_buffers(self) -> None:
        """Allocate this update's buffers, where the engine does so in ``prepare()`` (nothing here)."""

    def is_healthy(self) -> bool:
        return True

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """One sender (trainer rank 0) and every rollout rank (1..N); other trainer ranks stay outside (-1).

        With the master's ``multi_sender`` and several trainer ranks, all of them send (entries get ``num_senders``,
        verl's name). The group is kept when every member already holds exactly it; else a new generation forms."""
        check_int(trainer_world_size, "trainer_world_size", 1)
        check_int(rollout_world_size, "rollout_world_size", 1)
        if not isinstance(metadata, (list, tuple)) or len(metadata) != trainer_world_size + rollout_world_size:
            raise CheckpointConfigError(f"metadata must list the prepare() result of all {trainer_world_size} + "
                                        f"{rollout_world_size} workers, got {metadata!r}")
        master = metadata[0]
        if not isinstance(master, dict) or not master.get("is_master") or not master.get("master_port"):
            raise CheckpointConfigError("metadata[0] must be the prepare() result of the master (trainer rank 0, "
                                        f"built with is_master=True), got {master!r}")
        senders = trainer_world_size if master.get("multi_sender") else 1
        world_size = senders + rollout_world_size
        layouts = [m.get("rollout_layout") if isinstance(m, dict) else None for m in metadata[trainer_world_size:]]
        reshard = any(layout is not None for layout in layouts)
        if reshard and not cls.supports_reshard:
            raise CheckpointConfigError(f"a rollout declares a resharding layout, but {cls.__name__} has no "
                                        "point-to-point transfers to reshard with (the collective and ipc engines do)")
        if senders > 1:
            ranks = list(range(world_size))
        else:
            ranks = [0] + [-1] * (trainer_world_size - 1) + list(range(1, world_size))
        addr, port, generation = master["master_addr"], master["master_port"], master.get("generation", 0)

        def wanted(rank: int, gen: int) -> dict[str, Any]:
            return dataclasses.asdict(Membership(rank, world_size, addr, port, gen, 0, senders, reshard))

        keep = all(isinstance(m, dict) and m.get("joined") == wanted(r, generation)
                   for r, m in zip(ranks, metadata) if r >= 0)
        if not keep:
            generation += 1
        sides = []
        for side in (ranks[:trainer_world_size], ranks[trainer_world_size:]):
            n = len(side)
            sides.append({"rank": side, "world_size": [world_size] * n, "master_addr": [addr] * n,
                          "master_port": [port] * n, "generation": [generation] * n})
            if senders > 1:
                sides[-1]["num_senders"] = [senders] * n
            if reshard:
                sides[-1]["reshard"] = [True] * n
        if reshard:
            sides[0]["rollout_layouts"] = [layouts] * trainer_world_size
        return sides[0], sides[1]

    def init_process_group(self, rank: int | None = None, world_size: int | None = None,
                           master_addr: str | None = None, master_port: int | None = None,
                           generation: int = 0, num_senders: int = 1, reshard: bool = False,
                           rollout_layouts: list | None = None, **extra: Any) -> None:
        """Be rank ``rank`` of the group :meth:`build_topology` described; keep what is set up if it is that group.

        Without arguments: the group given at construction. ``rank=-1``: outside the group (releases what it held)."""
        self._check_extra(extra, OneToManyEngine.init_process_group, "init_process_group")
        self._bind()
        if rank is None and world_size is None:
            if self._membership is None:
                if self.rank == -1:
                    return
                raise CheckpointConfigError("init_process_group() needs rank, world_size, master_addr and "
                                            "master_port (from build_topology), or an engine built with them")
            membership = self._membership
        elif isinstance(rank, int) and not isinstance(rank, bool) and rank < 0:
            self._leave()
            self._set_membership(None)
            return
        else:
            membership = Membership.checked(rank, world_size, master_addr or self.master_addr,
                                            self.master_port if master_port is None else master_port,
                                            generation, 0, self.min_world_size, num_senders, reshard)
            if reshard and not self.supports_reshard:
                raise CheckpointConfigError(f"reshard=True: {type(self).__name__} has no point-to-point transfers")
            self.rollout_layouts = rollout_layouts
            if membership.senders > 1 and not self.supports_multi_sender:
                raise CheckpointConfigError(f"num_senders={num_senders}: {type(self).__name__} has one sender")
        self._set_membership(membership)
        if self._joined is not None and self._joined == membership and self.is_healthy():
            return  # the same group: keep what is set up (rebuilding a communicator per update exhausts HCCL)
        self._enter(membership)

    def _joined_now(self, membership: Membership) -> None:
        self._joined = membership
        self._generation = max(self._generation, membership.generation)

    @abc.abstractmethod
    def _enter(self, membership: Membership) -> None:
        """Set up for a group other than :attr:`_joined` (release the old one first; may be lazy)."""

    def _leave(self) -> None:
        self._joined = None

    # ---- sender / receiver bookkeeping ---------------------------------------------------------------
    def _outside(self, weights: Iterable[NamedTensor]) -> bool:
        """On a trainer rank outside the group, consume ``weights`` (it may take part in gathers) and return ``True``."""
        if self.rank != -1:
            self._bind()
            return False
        for _ in weights:
            pass
        return True

    def _check_sender(self) -> None:
        if self.rank is None and self._membership is None and not self.is_master:
            raise CheckpointConfigError(f"send_weights before init_process_group: this {type(self).__name__} is in "
                                        "no group; call init_process_group(...) with build_topology's entries, or "
                                        "build it with rank, world_size, master_addr and master_port")
        if not self.is_sender:
            raise CheckpointConfigError(f"send_weights called on rank {self.rank}, but src_rank is {self.src_rank} "
                                        "(only the trainer sends)")

    def _check_receiver(self) -> None:
        self._bind()
        if self.rank is None or self.rank < 0:
            raise CheckpointConfigError(f"receive_weights called on an engine outside any group (rank {self.rank}); "
                                        "call init_process_group(...) with build_topology's entries first")
        if self.is_sender:
            raise CheckpointConfigError(f"receive_weights called on rank {self.rank}, the sending rank")
