"""The control channel of one one-to-many engine group, over torch.distributed's ``TCPStore``.

One idea: typed messages between the ranks of a group, every wait bounded, a dead peer seen within seconds.

* **the store**: the trainer (rank 0, the master) hosts a ``TCPStore`` at its ``master_addr`` (:func:`host_store`,
  once per engine: its port does not change across generations); every other rank connects to it
  (:func:`connect_store`).
* **keys**: a :class:`ControlChannel` works under one namespace (the engine and the group's generation, e.g.
  ``"ckpt-p2p/3"``), so a new generation never reads an old one's keys. Messages travel in the store's FIFO
  queues (``queue_push`` / ``queue_pop``), one queue per direction and peer, named by the caller
  (``"msg/2/1"``: rank 2's messages of its first connection); single values (``post`` / ``peek``, or raw
  bytes with ``post_bytes`` / ``get_bytes``, waited for per rank with ``wait_posted``) and counters (``add``)
  sit under plain keys.
* **messages**: dataclasses (:class:`~ckpt.wire.WireMessage`, :class:`Ack`, an engine's own) sent as JSON with
  their type's name; a receiver names the type it expects and gets an instance of it, or a
  :class:`~ckpt.errors.TransferError` naming what came instead.
* **waits**: a receive blocks in a worker thread (``asyncio.to_thread``) on its own store connection, so the
  event loop keeps running; it is bounded by the engine's timeout and a timeout names the peer, what was
  awaited, the key and the seconds (:class:`PeerFailure` with ``timed_out``).
* **liveness**: each channel runs a daemon thread that bumps its rank's counter (``store.add``) every
  :data:`HEARTBEAT_S` and reads the counters of the peers it was told to :meth:`~ControlChannel.watch`. A peer
  whose counter stood still for :data:`HEARTBEAT_DEAD_S` is dead: a wait on it is woken at once (a queue gets
  a wake-up item, an unset key a wake-up value) and raises :class:`PeerFailure` naming it, and :meth:`~ControlChannel.check_alive` raises the same. A peer
  whose counter moves again (it was stopped or starved, not dead) counts as alive again. The store's
  host gone (its process exited) fails every wait at once, naming the host.

The store keeps what is not taken: receivers pop their queues, and an engine drains the queues of a connection
it drops (:meth:`~ControlChannel.drain`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import queue
import threading
import time
from typing import Any, Callable, TypeVar

import torch.distributed as dist

import hal
from ckpt.errors import CheckpointConfigError, TransferError, TransferTimeoutError

STORE_OVERRUN_S = 2.0
"""Seconds a blocking store call may run past its own deadline before :meth:`ControlChannel.recv` gives up on it.
A ``TCPStore`` client whose wait times out asks the server to cancel it and waits for the answer without a
bound, so over a cut link (``hal soak``'s ``cut_link``) the call returned only once the link was back and TCP
had retransmitted: an update's receive outlived every bound."""
HEARTBEAT_S = 0.5
"""Seconds between two bumps of a rank's heartbeat counter (and two looks at its peers' counters)."""
HEARTBEAT_DEAD_S = 5.0
"""Seconds a watched peer's counter may stand still before the peer counts as dead: ten missed beats, so that a
live process starved of its CPU or its GIL for a while (a loaded 2-core CI machine) is not taken for dead."""

M = TypeVar("M")
_WAKE_VALUE = b"\x00hal-ckpt-control-wake"  # what a key waited on is set to when its rank was found dead


class PeerFailure(TransferError):
    """A peer died, hangs, or did not answer in time.

    Attributes:
        peer: how the peer is named in messages (``"rollout rank 2 (at 10.0.0.3)"``).
        timed_out: ``True`` when the wait ran out of time (the engine raises :class:`TransferTimeoutError`),
            ``False`` when the peer is known dead or gone.
    """

    def __init__(self, peer: str, text: str, timed_out: bool = False) -> None:
        super().__init__(text)
        self.peer, self.timed_out = peer, timed_out


@dataclasses.dataclass(frozen=True)
class Ack:
    """A receiver is done with message ``index`` (counted from 0 in one update) and its buffer."""

    index: int


class StoreUnanswered(dist.DistNetworkError):
    """A call on a store client got no answer within :data:`STORE_OVERRUN_S` (:class:`BoundedStore`)."""


class BoundedStore:
    """A ``TCPStore`` client whose plain calls (``add``, ``set``, ``queue_push``, ...) each return or fail within
    ``bound`` seconds.

    ``TCPStore``'s timeout bounds its waits only: a plain call over a link that is down blocks until TCP delivers
    it once the link is back (with retransmission backoff, tens of seconds later), and on a stopped host for as
    long as it is stopped (measured: an ``add`` to a SIGSTOPped host had not returned after 120 s). Called on an
    engine's event loop, such a call stalled a rollout for the whole outage (``hal soak``'s ``cut_link``). Here
    each call runs in this object's daemon thread and the caller waits at most ``bound``; once a call overran,
    the client counts as lost and every later call raises at once (the thread stays with the stuck call; it is
    a daemon, and the call ends when the link does). The caller connects again (a new client) to go on.

    Args:
        store: the client; ``clone()`` and ``set_timeout()`` go to it directly (a clone is a new connection).
        bound: seconds a call may take.
        where: how errors name the store (``"the store at host:port"``).

    Raises (from every call):
        StoreUnanswered: this call, or an earlier one, got no answer within ``bound``.
    """

    CALLS = ("set", "get", "check", "add", "delete_key", "compare_set", "queue_push", "queue_pop", "queue_len")
    """The calls made through the thread (:meth:`call` makes any, ``"clone"`` too: a new connection's
    handshake blocks on a stopped host as well)."""

    def __init__(self, store: dist.Store, bound: float, where: str) -> None:
        self.store, self.bound, self.where = store, bound, where
        self.lost: str | None = None  # why the client counts as lost
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hal-ckpt-store-calls")
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, name, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(getattr(self.store, name)(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def call(self, name: str, *args: Any) -> Any:
        """``store.<name>(*args)``, waited for at most ``bound`` seconds."""
        if self.lost is not None:
            raise StoreUnanswered(self.lost)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, name, args))
        try:
            return future.result(self.bound)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.lost = (f"{self.where} did not answer a {name} call within {self.bound:g} s (is its link down or "
                         "its host stopped?)")
            raise StoreUnanswered(self.lost) from None

    def __getattr__(self, name: str) -> Any:
        if name in BoundedStore.CALLS:
            return functools.partial(self.call, name)
        return getattr(self.store, name)

    def close(self) -> None:
        """End the thread once it is done with the call it is in (if any); idempotent."""
        self._jobs.put(None)


def host_store(addr: str, port: int | None, timeout: float) -> dist.TCPStore:
    """Host the group's store at ``addr:port`` (``port`` ``None`` or 0: a free port; read it from ``.port``).

    Raises:
        CheckpointConfigError: the address cannot be bound (named).
    """
    try:
        return hal.connect_store(addr, port or 0, 0, 1, timeout)
    except hal.DistributedTimeoutError as exc:
        raise CheckpointConfigError(f"cannot host the checkpoint engine's store at {addr}:{port or 0}: {exc}") from exc


def connect_store(addr: str, port: int, timeout: float, who: str) -> dist.TCPStore:
    """Connect to the store hosted at ``addr:port``, waiting at most ``timeout`` seconds for it; ``who`` names
    the host in the error.

    Raises:
        TransferTimeoutError: the store did not answer within ``timeout``.
    """
    try:
        return hal.connect_store(addr, port, 1, 2, timeout)
    except hal.DistributedTimeoutError as exc:
        raise TransferTimeoutError(f"could not reach {who} (its store at {addr}:{port}) within {timeout:g} s: "
                                   f"{exc}") from None


def encode(message: Any) -> bytes:
    """A dataclass instance as JSON bytes with its type's name (``to_dict()`` when it has one)."""
    body = message.to_dict() if hasattr(message, "to_dict") else dataclasses.asdict(message)
    return json.dumps({"type": type(message).__name__, "body": body}, separators=(",", ":")).encode()


def decode(raw: bytes, expect: type[M], where: str) -> M:
    """Rebuild a message of type ``expect`` from :func:`encode`'s bytes (``expect.from_dict`` when it has one).

    Raises:
        TransferError: the bytes are not a message of that type (``where`` says whose and what).
    """
    try:
        item = json.loads(raw)
        kind, body = item["type"], item["body"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferError(f"{where}: corrupt control message ({type(exc).__name__}: {exc}): {raw[:200]!r}") from None
    if kind != expect.__name__:
        raise TransferError(f"{where}: expected a {expect.__name__} message, got {kind!r}: {raw[:200]!r}")
    if hasattr(expect, "from_dict"):
        return expect.from_dict(body)
    try:
        return expect(**body)
    except TypeError as exc:
        raise TransferError(f"{where}: corrupt {kind} message ({exc}): {raw[:200]!r}") from None


def check_heartbeat_timeout(value: Any) -> float:
    """``value`` as seconds a peer's heartbeat may stand still (see :class:`ControlChannel`).

    Raises:
        CheckpointConfigError: not a number >= ``2 * HEARTBEAT_S`` (a peer must miss two beats at least).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 2 * HEARTBEAT_S:
        raise CheckpointConfigError(f"heartbeat_timeout must be a number of seconds >= {2 * HEARTBEAT_S:g} "
                                    f"(two heartbeats), got {value!r}")
    return float(value)


def _store_timeout(exc: BaseException) -> bool:
    """A store wait that ran out of time (the store is fine), as against the store's host gone."""
    return isinstance(exc, dist.DistStoreError)


class ControlChannel:
    """One rank's control channel of one engine group (see the module docstring).

    Args:
        store: a ``TCPStore`` (the host's own server object, or a client). The channel uses clones of it for
            its blocking waits (made on the first) and its heartbeat; the caller keeps ``store`` and drops it
            after :meth:`close`.
        rank: this rank in the group (its heartbeat counter).
        namespace: prefix of every key, e.g. ``"ckpt-p2p/3"`` (engine and generation).
        timeout: seconds bounding every wait unless a call says otherwise (a number > 0).
        label: ``label(rank) -> str``, how errors name a rank.
        host_rank: the rank whose process hosts the store (named when the store is gone).
        heartbeat: run the heartbeat thread (``False``: :meth:`watch` and dead-peer detection do nothing).
        bounded: on a rank that does not host the store, make the plain calls on ``store`` (and the liveness
            probe's) through a :class:`BoundedStore`: for a channel used on an event loop, where a call that
            blocks for a link's outage stalls everything else. Leave it ``False`` where ``store`` is shared
            with a process group's rendezvous (its long waits would count as the store not answering) or where
            every call runs in a worker thread anyway.
        heartbeat_timeout: seconds a watched peer's counter may stand still before the peer counts as dead
            (:data:`HEARTBEAT_DEAD_S` by default; at least two beats, ``2 * HEARTBEAT_S``). Longer where a
            rank may hold the GIL that long (a long C call that does not release it); shorter to find a dead
            peer sooner.

    Raises:
        CheckpointConfigError: ``timeout`` is not a number > 0, or ``heartbeat_timeout`` is not a number
            >= ``2 * HEARTBEAT_S``.
    """

    def __init__(self, store: dist.Store, *, rank: int, namespace: str, timeout: float,
                 label: Callable[[int], str], host_rank: int = 0, heartbeat: bool = True,
                 heartbeat_timeout: float = HEARTBEAT_DEAD_S, bounded: bool = False) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise CheckpointConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)
        if bounded and rank != host_rank:  # a client's plain calls on an event loop must not outlive a cut link
            store = BoundedStore(store, STORE_OVERRUN_S, f"the control store of {label(host_rank)}")
        self.store, self.rank, self.namespace = store, rank, namespace
        self.timeout, self.label, self.host_rank = float(timeout), label, host_rank
        # blocking waits run in worker threads on a connection of their own, opened now: a channel holds the
        # same connections from its first update on (verl's lifecycle tests count open files per update)
        self._waiter: dist.Store | None = store.clone()
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[str, int]] = {}  # wait token -> (key, peer) of waits in progress
        self._queue_keys: set[str] = set()  # the keys of those that are queues
        self._tokens = itertools.count(1)
        self._watched: dict[int, tuple[int, float]] = {}  # peer -> (last counter seen, when it last changed)
        self._dead: dict[int, str] = {}  # peer -> why it counts as dead
        self._dead_count: dict[int, int] = {}  # peer -> its counter when it was found dead (it stood still there)
        # check_alive's own connection, made when a peer is found dead and closed once none is (so a stopped peer
        # that continues leaves no descriptor behind)
        self._probe: dist.Store | None = None
        self._probe_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat:
            beat = store.clone()
            beat.add(self.key("hb", str(rank)), 1)  # alive before anyone can watch it
            self._thread = threading.Thread(target=self._beat, args=(beat,), daemon=True,
                                            name=f"hal-ckpt-heartbeat-{namespace}-{rank}")
            self._thread.start()

    # ---- keys, values, counters ------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        """The store key of ``parts`` under this channel's namespace."""
        return "/".join((self.namespace, *parts))

    def post(self, name: str, message: Any) -> None:
        """Set key ``name`` to ``message`` (a dataclass), replacing what was there; every client sees it once
        this returns (see :meth:`post_bytes`)."""
        self._set_seen(self.key(name), encode(message))

    def peek(self, name: str, expect: type[M]) -> M | None:
        """The message under key ``name`` without waiting, ``None`` if there is none.

        Raises:
            TransferError: the store's host is gone, or the value is not an ``expect`` message.
        """
        key = self.key(name)
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except dist.DistError as exc:
            raise self._host_gone(f"the key {key!r}", exc) from None
        return decode(raw, expect, f"{self.label(self.rank)} reading {key!r}")

    def post_bytes(self, name: str, data: bytes) -> None:
        """Set key ``name`` to ``data`` as is (a pickled object, a library's record); every client sees it once
        this returns.

        Raises:
            PeerFailure: the store's host is gone.
        """
        try:
            self._set_seen(self.key(name), data)
        except dist.DistError as exc:
            raise self._host_gone(f"setting {self.key(name)!r}", exc) from None

    def _set_seen(self, key: str, data: bytes) -> None:
        # TCPStore's set sends and returns without an answer, and the server serves its connections in no
        # fixed order: another client's check could still miss the key (11 of 2000 posts, measured on a
        # loopback). A check on the same connection is answered only after the set is applied.
        self.store.set(key, data)
        self.store.check([key])

    def get_bytes(self, name: str) -> bytes:
        """The bytes under key ``name`` (set by :meth:`post_bytes`; wait for it with :meth:`wait_posted`)."""
        return self.store.get(self.key(name))

    def wait_posted(self, names: dict[int, str], what: str, timeout: float | None = None) -> None:
        """Block the calling thread until every rank ``r`` of ``names`` (``{rank: key name}``) has set its key,
        at most ``timeout`` seconds in all (default: the channel's); a watched rank found dead meanwhile
        fails the wait at once.

        Raises:
            PeerFailure: ``timed_out``: the ranks that did not set theirs in time, named (``peer``) with the
                seconds; else a rank is dead (named) or the store's host is gone.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for rank, name in names.items():
            key = self.key(name)
            token = next(self._tokens)
            with self._lock:
                self._waits[token] = (key, rank)
            try:
                self.check_alive(rank, what)
                if self._waiter is None:
                    self._waiter = self.store.clone()
                self._waiter.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
                if self._waiter.get(key) == _WAKE_VALUE:
                    self.check_alive(rank, what)
            except dist.DistError as exc:
                if not _store_timeout(exc):
                    raise self._host_gone(what, exc) from None
                missing = [self.label(r) for r, n in names.items() if not self._waiter.check([self.key(n)])]
                who = ", ".join(missing)
                raise PeerFailure(who, f"{who} did not answer {what} within {timeout:g} s (store keys under "
                                       f"{self.namespace!r})", True) from None
            finally:
                with self._lock:
                    self._waits.pop(token, None)

    def unset(self, name: str) -> None:
        """Delete key ``name`` (nothing happens if it is not there)."""
        self.store.delete_key(self.key(name))

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to the counter ``name`` (created at 0); returns the new value.

        Raises:
            PeerFailure: the store's host is gone or does not answer.
        """
        try:
            return int(self.store.add(self.key(name), amount))
        except dist.DistError as exc:
            raise self._host_gone(f"the counter {self.key(name)!r}", exc) from None

    # ---- queues ----------------------------------------------------------------------------------------
    def send(self, queue: str, message: Any) -> None:
        """Append ``message`` (a dataclass) to ``queue``; does not wait for a receiver.

        Raises:
            PeerFailure: the store's host is gone.
        """
        try:
            self.store.queue_push(self.key(queue), encode(message))
        except dist.DistError as exc:
            raise self._host_gone(f"sending on {self.key(queue)!r}", exc) from None

    def pending(self, queue: str) -> int:
        """How many messages wait in ``queue`` (the wake-up items of :meth:`recv` count too)."""
        return int(self.store.queue_len(self.key(queue)))

    def drain(self, queue: str) -> None:
        """Drop whatever waits in ``queue`` (a connection given up); quiet if the store is gone."""
        key = self.key(queue)
        try:
            while self.store.queue_len(key):
                self.store.queue_pop(key, False)
        except dist.DistError:
            pass

    async def recv(self, queue: str, expect: type[M], peer: int | None, what: str,
                   timeout: float | None = None) -> M:
        """The next message of ``queue``, an ``expect``, sent by ``peer`` (``None``: any rank, no liveness
        watch); waits at most ``timeout`` seconds (default: the channel's) in a worker thread.

        Raises:
            PeerFailure: ``timed_out`` after ``timeout`` (naming the peer, ``what``, the key and the seconds);
                else ``peer`` is dead (no heartbeat for :data:`HEARTBEAT_DEAD_S`) or the store's host is gone.
            TransferError: what came is not an ``expect`` message.
        """
        timeout = self.timeout if timeout is None else timeout
        raw = self._pop_ready(self.key(queue), peer, what)
        if raw is None:
            try:
                raw = await asyncio.wait_for(asyncio.to_thread(self.pop, queue, peer, what, timeout),
                                             timeout + STORE_OVERRUN_S)
            except asyncio.TimeoutError:
                # the store's client is stuck in a call past its deadline (see STORE_OVERRUN_S): leave that
                # thread and its connection behind, and wait on a fresh one next time
                self._waiter = None
                who = "no rank" if peer is None else self.label(peer)
                raise PeerFailure(who, f"{who} sent no {what} within {timeout:g} s (store key {self.key(queue)!r}; "
                                       f"the store did not answer within {STORE_OVERRUN_S:g} s more: is its link "
                                       f"down?)", True) from None
        return decode(raw, expect, f"{self.label(self.rank)} receiving {what}")

    def pop(self, queue: str, peer: int | None, what: str, timeout: float) -> bytes:
        """The next raw item of ``queue``, blocking the calling thread at most ``timeout`` seconds (see
        :meth:`recv`, which decodes it; this is its blocking half, for a thread)."""
        key = self.key(queue)
        token = next(self._tokens)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._waits[token] = (key, peer)
            self._queue_keys.add(key)
        try:
            while True:
                if peer is not None:
                    self.check_alive(peer, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    who = "no rank" if peer is None else self.label(peer)
                    raise PeerFailure(who, f"{who} sent no {what} within {timeout:g} s (store key {key!r})", True)
                if self._waiter is None:
                    self._waiter = self.store.clone()
                self._waiter.set_timeout(datetime.timedelta(seconds=left))
                try:
                    raw = self._waiter.queue_pop(key)
                except dist.DistError as exc:
                    if _store_timeout(exc):
                        continue
                    raise self._host_gone(what, exc) from None
                if not self._is_wake(raw, token, peer, what):
                    return raw
        finally:
            with self._lock:
                self._waits.pop(token, None)

    def _pop_ready(self, key: str, peer: int | None, what: str) -> bytes | None:
        """An item already in the queue ``key`` (stale wake-ups skipped), else ``None``; no thread hop."""
        if peer is not None:
            self.check_alive(peer, what)
        while True:
            try:
                raw = self.store.queue_pop(key, False)
            except dist.QueueEmptyError:
                return None
            except dist.DistError as exc:
                raise self._host_gone(what, exc) from None
            if not self._is_wake(raw, 0, peer, what):
                return raw

    def _is_wake(self, raw: bytes, token: int, peer: int | None, what: str) -> bool:
        """Whether ``raw`` is a wake-up item; raise if it is the one for this wait (``token``)."""
        if not raw.startswith(b'{"type":"_Wake"'):
            return False
        if json.loads(raw)["body"].get("token") == token and peer is not None:
            self.check_alive(peer, what)
        return True  # a wake-up for a wait that has ended: skip it

    def _host_gone(self, what: str, exc: BaseException) -> PeerFailure:
        who = self.label(self.host_rank)
        first = (str(exc).splitlines() or [""])[0][:200]
        if isinstance(exc, StoreUnanswered):
            return PeerFailure(who, f"{who}, which hosts the control store, did not answer while "
                                    f"{self.label(self.rank)} waited for {what}: {first}", True)
        return PeerFailure(who, f"{who}, which hosts the control store, is gone (it exited or died) while "
                                f"{self.label(self.rank)} waited for {what} ({type(exc).__name__}: {first})")

    # ---- liveness --------------------------------------------------------------------------------------
    def watch(self, peers: list[int]) -> None:
        """Watch the heartbeats of ``peers`` from now on (in addition to those watched already)."""
        with self._lock:
            for peer in peers:
                self._watched.setdefault(peer, (-1, time.monotonic()))
                self._dead.pop(peer, None)
                self._dead_count.pop(peer, None)

    def unwatch(self, peers: list[int]) -> None:
        """Stop watching ``peers`` (they left, or a new connection of theirs is to be watched afresh)."""
        with self._lock:
            for peer in peers:
                self._watched.pop(peer, None)
                self._dead.pop(peer, None)
                self._dead_count.pop(peer, None)

    def check_alive(self, peer: int, what: str = "a message") -> None:
        """Raise :class:`PeerFailure` if ``peer`` counts as dead (a dictionary look-up while it is alive; for a
        peer found dead, one store round trip: its counter moved since, it was stopped or starved and counts as
        alive again).

        Raises:
            PeerFailure: its heartbeat stood still for :data:`HEARTBEAT_DEAD_S` (and still does), or the store's
                host is gone.
        """
        reason = self._dead.get(peer)
        if reason is not None and not self._beating_again(peer):
            raise PeerFailure(self.label(peer), f"{reason}, while {self.label(self.rank)} waited for {what}")

    def _beating_again(self, peer: int) -> bool:
        """Whether ``peer``, found dead, bumped its counter since (read now, on this channel's own connection);
        if so it is alive again (its next wait may wait on it)."""
        with self._lock:
            dead_at = self._dead_count.get(peer)
        if dead_at is None:  # found dead some other way (the store's host gone): for good
            return False
        try:
            with self._probe_lock:
                if self._probe is None:  # its own connection, made and used as boundedly as the channel's calls
                    if isinstance(self.store, BoundedStore):
                        self._probe = BoundedStore(self.store.call("clone"), STORE_OVERRUN_S, self.store.where)
                    else:
                        self._probe = self.store.clone()
                count = int(self._probe.add(self.key("hb", str(peer)), 0))
        except dist.DistError:
            with self._probe_lock:
                if isinstance(self._probe, BoundedStore) and self._probe.lost is not None:
                    self._probe.close()  # left with its stuck call: a fresh connection next time
                    self._probe = None
            return False
        if count == dead_at:
            return False
        self._revive(peer, count)
        return True

    def _revive(self, peer: int, count: int) -> None:
        with self._lock:
            self._dead.pop(peer, None)
            self._dead_count.pop(peer, None)
            if peer in self._watched:
                self._watched[peer] = (count, time.monotonic())
            none_dead = not self._dead_count
        if none_dead:
            with self._probe_lock:
                probe, self._probe = self._probe, None  # its socket closes with it
            if isinstance(probe, BoundedStore):
                probe.close()

    def _beat(self, beat: dist.Store) -> None:
        """The heartbeat thread: bump this rank's counter, judge the watched peers, wake waits on the dead."""
        mine = self.key("hb", str(self.rank))
        while not self._stop.wait(HEARTBEAT_S):
            try:
                beat.add(mine, 1)
                with self._lock:
                    watched = list(self._watched.items())
                now = time.monotonic()
                for peer, (seen, since) in watched:
                    count = int(beat.add(self.key("hb", str(peer)), 0))
                    if count != seen or count == 0:  # alive, or not started yet (0: never beat)
                        with self._lock:
                            if peer in self._watched:
                                self._watched[peer] = (count, now)
                        if peer in self._dead_count:  # beating again (it was stopped or starved, not dead): a
                            self._revive(peer, count)  # wait that failed meanwhile failed, the next may wait on it
                        continue
                    if now - since >= self.heartbeat_timeout and peer not in self._dead:
                        self._mark_dead(beat, peer, f"{self.label(peer)} is dead or hangs: its heartbeat stood "
                                                    f"still for {now - since:.1f} s (heartbeat_timeout="
                                                    f"{self.heartbeat_timeout:g} s)", count)
            except dist.DistError as exc:  # the store's host is gone: every wait fails by itself
                if self.host_rank in self._watched and self.host_rank != self.rank:
                    self._mark_dead(None, self.host_rank, str(self._host_gone("its heartbeat", exc)))
                return

    def _mark_dead(self, beat: dist.Store | None, peer: int, reason: str, count: int | None = None) -> None:
        with self._lock:
            self._dead[peer] = reason
            if count is not None:  # its counter stood still at count: moving again revives it
                self._dead_count[peer] = count
            waits = [(token, key) for token, (key, p) in self._waits.items() if p == peer]
        if beat is None:
            return
        for token, key in waits:  # wake each wait on the dead peer: a queue gets an item, a key its value
            if key in self._queue_keys:
                beat.queue_push(key, encode(_Wake(token)))
            else:
                beat.compare_set(key, "", _WAKE_VALUE)

    def close(self) -> None:
        """Stop the heartbeat thread (waits for it at most ``2 * HEARTBEAT_S``); idempotent. The store is the
        caller's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * HEARTBEAT_S)
        self._thread = None
        for store in (self.store, self._probe):
            if isinstance(store, BoundedStore):
                store.close()
        self._probe = None


@dataclasses.dataclass(frozen=True)
class _Wake:
    """The item that wakes receive ``token`` (its peer was found dead)."""

    token: int

