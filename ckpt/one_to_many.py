"""The base of the one-to-many checkpoint engines (collective, nixl, mooncake, kimi): one trainer rank sends
to every rollout rank.

What every such engine shares lives here; each engine keeps only its transport:

* **argument checks**: ``bucket_size``, ``timeout``, ``store_addr="host:port"`` (parsed once, here),
  ``master_port``, ``direct_threshold``, and no swallowed keywords (:func:`check_keywords`);
* **membership and topology**: :class:`Membership` (rank, world size, rendezvous address, generation,
  sending rank), verl's ``prepare`` / ``build_topology`` / ``init_process_group`` sequence, generation
  numbering, and keeping what an engine set up for a group while the topology is unchanged;
* **sender / receiver bookkeeping**: the role of this rank (``sender``, ``receiver``, ``outside``), what a
  rank outside the group does with ``send_weights`` (drains the iterator: verl's trainer ranks all iterate
  their shard), the step of the update in progress and of the last one sent.

Ranks: 0 is the trainer that sends (``src_rank``), 1..N the rollouts, -1 a trainer rank outside the group.
With the topology option ``multi_sender`` (an engine that takes it, on a trainer of several ranks): trainer
ranks 0..S-1 all send (``num_senders=S``), rollouts are S..S+N-1 (:mod:`ckpt.multi_sender`).
"""

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

DEFAULT_BUCKET_SIZE = 256 << 20
"""Default bucket size in bytes (256 MiB)."""

VERL_KEYWORDS = ("bucket_size", "is_master")
"""Keywords verl 0.9.1 passes to every engine's constructor besides the user's ``engine_kwargs``
(``verl/checkpoint_engine/base.py``: ``CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs)``
in ``CheckpointEngineWorker``; ``verl/workers/engine_workers.py``: ``is_master=(rank == 0), bucket_size=...``
on the trainer). Every engine takes them, even one that does not use them. ``init_process_group`` gets only
what ``build_topology`` returned (verl's manager strips its ``method`` entry)."""


def check_keywords(given: dict[str, Any], accepted: Iterable[str], where: str) -> None:
    """Refuse keywords that ``where`` does not take (instead of swallowing a mistyped one).

    Args:
        given: the keywords left over after the named parameters (``**extra``).
        accepted: the keywords ``where`` takes, for the message.
        where: e.g. ``"CollectiveCheckpointEngine()"`` or ``"NixlCheckpointEngine.init_process_group()"``.

    Raises:
        CheckpointConfigError: ``given`` is not empty; the message names each keyword and lists the accepted ones.
    """
    if given:
        raise CheckpointConfigError(f"{where} got unknown keyword(s) {', '.join(map(repr, sorted(given)))}; it "
                                    f"accepts {', '.join(sorted(set(accepted)))}")


def named_parameters(fn: Any) -> list[str]:
    """The keyword-capable parameter names of ``fn`` (no ``self``, no ``*args`` / ``**kwargs``)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def parse_store_addr(store_addr: Any) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``.

    Raises:
        CheckpointConfigError: not a str of that form (the port a decimal number).
    """
    host, sep, port = store_addr.rpartition(":") if isinstance(store_addr, str) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise CheckpointConfigError(f"store_addr must be 'host:port', got {store_addr!r}")
    return host, int(port)


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high)`` (``high`` ``None``: no upper bound), not a ``bool``.

    Raises:
        CheckpointConfigError: anything else; the message names ``name``, the value and the range.
    """
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value >= high)):
        accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r}")
    return value


def local_address_towards(addr: str) -> str:
    """The local address this host uses to reach ``addr`` (no packet is sent); ``addr`` itself if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return addr


def host_address() -> str:
    """This host's address as its name resolves (what peers on other nodes dial), else ``127.0.0.1``."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Membership:
    """One rank's place in a one-to-many group.

    Attributes:
        rank: 0..world_size-1 (``src_rank`` sends).
        world_size: ranks in the group (1 sender + N receivers).
        master_addr, master_port: where rank 0 is reached (its rendezvous store or listener); the address
            may be ``None`` on the sending rank until it picks one (:meth:`OneToManyEngine.prepare`).
        generation: the group's number; a changed topology forms a new generation (fresh keys, no stale reads).
        src_rank: the sending rank (one sender).
        senders: how many trainer ranks send (ranks ``0..senders-1``; > 1 only with ``multi_sender``).
    """

    rank: int
    world_size: int
    master_addr: str | None
    master_port: int | None
    generation: int = 0
    src_rank: int = 0
    senders: int = 1

    @classmethod
    def checked(cls, rank: Any, world_size: Any, master_addr: Any, master_port: Any, generation: Any = 0,
                src_rank: Any = 0, min_world_size: int = 1, senders: Any = 1) -> Membership:
        """A :class:`Membership` from arguments as given.

        Raises:
            CheckpointConfigError: a value out of range (named, with what is accepted).
        """
        check_int(world_size, "world_size", min_world_size)
        check_int(rank, "rank", 0, world_size)
        check_int(src_rank, "src_rank", 0, world_size)
        if master_addr is not None and (not isinstance(master_addr, str) or not master_addr):
            raise CheckpointConfigError(f"master_addr must be a host name or address, got {master_addr!r}")
        if master_port is not None:
            check_int(master_port, "master_port", 1, 65536)
        check_int(generation, "generation", 0)
        check_int(senders, "num_senders", 1, world_size)
        return cls(rank, world_size, master_addr, master_port, generation, src_rank, senders)


class OneToManyEngine(CheckpointEngine):
    """Base of the engines where one trainer rank sends to N rollout ranks (see the module docstring).

    Args:
        bucket_size: bytes per bucket (an int >= :attr:`min_bucket_size`).
        is_master: verl's trainer rank 0 (the rank that hosts the rendezvous and sends).
        rank, world_size: this rank's place up front (hal's standalone use), else given later by
            :meth:`init_process_group`. ``rank=-1``: a trainer rank outside the group.
        master_addr, master_port: where rank 0 is reached; or ``store_addr="host:port"``.
        src_rank: the sending rank (0).
        device: device kind name (``"cpu"``, ``"npu-sim"``, ``"npu-sim:1"``, ...) or ``None`` for hal's
            resolution. The engine is **built for one device**, fixed here: the index given, else
            ``LOCAL_RANK``'s, else the constructing thread's current device (:func:`hal.local_device`); every
            call binds it in the calling thread (:meth:`_bind`), so a send or receive run from an executor
            thread (verl's fully-async trainer) still uses this rank's device, not that thread's current one.
        timeout: seconds bounding every wait (a finite number > 0).
        direct_threshold: bytes from which tensors are sent from their own memory (``None``:
            ``bucket_size // 8``; 0 packs everything).
        host: the address peers reach this process at (``None``: the engine's default).
        multi_sender: the topology option (verl's name): every trainer rank sends its own shards
            (:mod:`ckpt.multi_sender`); ``False`` (default): trainer rank 0 alone sends. Only the master's
            value counts (its :meth:`prepare` reports it to :meth:`build_topology`). Only engines whose
            ``supports_multi_sender`` is true take it.

    Raises:
        CheckpointConfigError: any argument out of range, or an unknown keyword.
    """

    min_bucket_size = 1
    """The smallest ``bucket_size`` the engine's wire format works with (bytes)."""
    min_world_size = 1
    """The smallest group: 1 (the sender alone) or 2 (a sender and a receiver)."""

    send_buffer_words = "three buckets (two send buffers and the one in flight)"

    bucketed = True
    hosts_rendezvous = True  # the master's store (``master_addr``), or one named by ``store_addr``

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        """What the sending rank holds for one update: up to three buckets (bytes)."""
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

    extra_keywords: tuple[str, ...] = ()
    """Constructor keywords a subclass takes before passing the rest to its base (for the message)."""

    def _bind(self) -> None:
        """Make this engine's device the current one of the calling thread (a no-op on host kinds)."""
        self.local.bind()

    def _check_extra(self, extra: dict[str, Any], method: Any, where: str) -> None:
        """:func:`check_keywords` for ``method``'s named parameters (plus :attr:`extra_keywords` for
        ``__init__``)."""
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
        """Whether this rank sends (``src_rank``; before a rank is known: ``is_master``)."""
        if self.rank is None:
            return self.is_master
        if self.senders > 1:
            return 0 <= self.rank < self.senders
        return self.rank >= 0 and self.rank == self.src_rank

    @property
    def topology(self) -> dict[str, Any] | None:
        """This rank's place: ``{"rank", "world_size", "src_rank", "role", "receivers"}`` (and ``"senders"``,
        the sending ranks, when there are several); ``None`` before the group is known; ``role`` is
        ``"sender"``, ``"receiver"`` or ``"outside"`` (rank -1)."""
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
        """How messages name rank ``rank``: the trainer with its address, or a rollout rank."""
        if rank == self.src_rank:
            return "the trainer (rank 0" + (f" at {self.master_addr}:{self.master_port})" if self.master_addr
                                            else ")")
        return f"rollout rank {rank}"

    # ---- verl's lifecycle ----------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Describe this worker for :meth:`build_topology`; the master (``is_master`` or rank 0) first makes
        its rendezvous reachable (:meth:`_host_rendezvous`) and reports where.

        Returns:
            ``{"is_master", "master_addr", "master_port", "generation", "joined"}``; ``joined`` is the
            membership (as a dict) of the group this engine holds set up, ``None`` when none. With
            ``multi_sender``, also ``"multi_sender": True``.
        """
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
        """Host the group's store (:func:`ckpt.control.host_store`) at ``master_addr`` (else ``host``, else this
        host's address) and ``master_port`` (else a free port), and record where it is.

        Raises:
            CheckpointConfigError: the address cannot be bound.
        """
        addr = self.master_addr or self.host or host_address()
        store = control.host_store(addr, self.master_port, self.timeout)
        self.master_addr, self.master_port = addr, int(store.port)
        self._store_at = (self.master_addr, self.master_port)
        return store

    def _store_moved(self) -> bool:
        """Whether the group now looks for this engine's store elsewhere than :meth:`_host_store` hosted it
        (``init_process_group`` was given another ``master_addr`` / ``master_port``): it is then hosted anew
        there, else every peer would wait on an address nobody serves."""
        return self._store_at != (self.master_addr, self.master_port)

    def _prepare_buffers(self) -> None:
        """Allocate this update's buffers, where the engine does so in ``prepare()`` (nothing here)."""

    def is_healthy(self) -> bool:
        """Whether what the engine set up for :attr:`_joined` is still usable (a failure breaks it)."""
        return True

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """One sender (trainer rank 0) and every rollout rank (1..N); other trainer ranks stay outside (-1).

        With the master's ``multi_sender`` (its :meth:`prepare` says so) and more than one trainer rank,
        every trainer rank sends: trainer ranks get 0..T-1, rollouts T..T+N-1, and every entry list also has
        ``num_senders`` (T), as verl's ``NCCLCheckpointEngine`` names it. One trainer rank: the one-sender
        topology, whatever the option (as verl's multi-sender degrades to one sender).

        The group is kept when every member already holds exactly it (same ranks, world size, address and
        generation: ``joined`` in its :meth:`prepare` result); otherwise a new generation is formed.

        Args:
            trainer_world_size, rollout_world_size: ranks on each side (ints >= 1).
            metadata: :meth:`prepare` results, trainer ranks first; ``metadata[0]`` is the master's.

        Returns:
            ``(trainer_kwargs, rollout_kwargs)`` with per-rank lists for ``rank``, ``world_size``,
            ``master_addr``, ``master_port`` and ``generation`` (and ``num_senders`` with several senders).

        Raises:
            CheckpointConfigError: bad sizes, or ``metadata[0]`` is not the master's.
        """
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
        if senders > 1:
            ranks = list(range(world_size))
        else:
            ranks = [0] + [-1] * (trainer_world_size - 1) + list(range(1, world_size))
        addr, port, generation = master["master_addr"], master["master_port"], master.get("generation", 0)

        def wanted(rank: int, gen: int) -> dict[str, Any]:
            return dataclasses.asdict(Membership(rank, world_size, addr, port, gen, 0, senders))

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
        return sides[0], sides[1]

    def init_process_group(self, rank: int | None = None, world_size: int | None = None,
                           master_addr: str | None = None, master_port: int | None = None,
                           generation: int = 0, num_senders: int = 1, **extra: Any) -> None:
        """Be rank ``rank`` of the group :meth:`build_topology` described; keep what is set up if it is
        that group.

        ``num_senders`` > 1: the multi-sender group (ranks below it send; see :mod:`ckpt.multi_sender`).
        Without arguments: the group given at construction (hal's standalone use). ``rank=-1``: this worker
        is outside the group (it releases what it held). Otherwise the engine's :meth:`_enter` sets up the
        new group (some engines do that lazily, on the first send or receive).

        Raises:
            CheckpointConfigError: bad or unknown arguments, or no group known at all.
            TransferTimeoutError: the engine joins eagerly and a peer did not come within ``timeout``.
        """
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
                                            generation, 0, self.min_world_size, num_senders)
            if membership.senders > 1 and not self.supports_multi_sender:
                raise CheckpointConfigError(f"num_senders={num_senders}: {type(self).__name__} has one sender")
        self._set_membership(membership)
        if self._joined is not None and self._joined == membership and self.is_healthy():
            return  # the same group: keep what is set up (rebuilding a communicator per update exhausts HCCL)
        self._enter(membership)

    def _joined_now(self, membership: Membership) -> None:
        """Record that what the engine set up is for ``membership`` (called by the engine once it is)."""
        self._joined = membership
        self._generation = max(self._generation, membership.generation)

    @abc.abstractmethod
    def _enter(self, membership: Membership) -> None:
        """Set up for a group other than :attr:`_joined` (release the old one first; may be lazy)."""

    def _leave(self) -> None:
        """Release what was set up for the group (this rank is now outside any)."""
        self._joined = None

    # ---- sender / receiver bookkeeping ---------------------------------------------------------------
    def _outside(self, weights: Iterable[NamedTensor]) -> bool:
        """On a trainer rank outside the group (-1): consume ``weights`` (its iterator may take part in
        gathers, as FSDP's does) and return ``True``; else ``False``."""
        if self.rank != -1:
            self._bind()
            return False
        for _ in weights:
            pass
        return True

    def _check_sender(self) -> None:
        """Raise :class:`CheckpointConfigError` unless this rank sends."""
        if self.rank is None and self._membership is None and not self.is_master:
            raise CheckpointConfigError(f"send_weights before init_process_group: this {type(self).__name__} is in "
                                        "no group; call init_process_group(...) with build_topology's entries, or "
                                        "build it with rank, world_size, master_addr and master_port")
        if not self.is_sender:
            raise CheckpointConfigError(f"send_weights called on rank {self.rank}, but src_rank is {self.src_rank} "
                                        "(only the trainer sends)")

    def _check_receiver(self) -> None:
        """Raise :class:`CheckpointConfigError` unless this rank receives."""
        self._bind()
        if self.rank is None or self.rank < 0:
            raise CheckpointConfigError(f"receive_weights called on an engine outside any group (rank {self.rank}); "
                                        "call init_process_group(...) with build_topology's entries first")
        if self.is_sender:
            raise CheckpointConfigError(f"receive_weights called on rank {self.rank}, the sending rank")
