"""The control channel of one one-to-many engine group, over torch.distributed's ``TCPStore``.

Typed messages between the ranks of a group, every wait bounded, a dead peer seen within seconds:

* the trainer (rank 0) hosts the store at ``master_addr`` (:func:`host_store`, port kept across
  generations); the other ranks connect (:func:`connect_store`);
* a :class:`ControlChannel` works under one namespace (engine and generation, e.g. ``"ckpt-p2p/3"``):
  messages travel in the store's FIFO queues, one per direction and peer, named by the caller; values and
  counters sit under plain keys;
* messages are dataclasses sent as JSON with their type's name; a receiver names the type it expects;
* a receive blocks in a worker thread on its own store connection; a timeout raises :class:`PeerFailure`
  naming the peer, what was awaited, the key and the seconds;
* each channel's daemon thread bumps its rank's counter every :data:`HEARTBEAT_S` and reads its watched
  peers'; one still for ``heartbeat_timeout`` is dead: waits on it wake at once and raise
  :class:`PeerFailure`. A counter that moves again revives the peer. The store's host gone fails every wait."""

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

# Seconds a blocking store call may run past its own deadline before recv gives up on it (a TCPStore client
# cancelling a wait over a cut link blocks until the link is back).
STORE_OVERRUN_S = 2.0
HEARTBEAT_S = 0.5  # Seconds between two heartbeats (and two looks at the peers' counters).
# Seconds a watched peer's counter may stand still before it counts as dead: ten beats, for starved CPUs.
HEARTBEAT_DEAD_S = 5.0

M = TypeVar("M")
_WAKE_VALUE = b"\x00hal-ckpt-control-wake"  # what a key waited on is set to when its rank was found dead


class PeerFailure(TransferError):
    """A peer died, hangs, or did not answer in time.

    ``peer`` names it in messages; ``timed_out`` is ``True`` when the wait ran out of time (the engine raises
    :class:`TransferTimeoutError`), ``False`` when the peer is known dead or gone."""

    def __init__(self, peer: str, text: str, timed_out: bool = False) -> None:
        super().__init__(text)
        self.peer, self.timed_out = peer, timed_out


@dataclasses.dataclass(frozen=True)
class Ack:
    """A receiver is done with message ``index`` (from 0 in one update) and its buffer."""

    index: int


class StoreUnanswered(dist.DistNetworkError):
    """A store call got no answer within :data:`STORE_OVERRUN_S` (:class:`BoundedStore`)."""


class BoundedStore:
    """A ``TCPStore`` client whose plain calls each return or fail within ``bound`` seconds.

    ``TCPStore``'s timeout bounds its waits only: a plain call blocks while the link is down or the host stopped.
    Each call runs in this object's daemon thread; once one overran the client counts as lost and every later
    call raises :class:`StoreUnanswered` at once (the caller connects again). ``clone()`` and ``set_timeout()``
    go to the client directly."""

    # The calls made through the thread (call() makes any, "clone" too).
    CALLS = ("set", "get", "check", "add", "delete_key", "compare_set", "queue_push", "queue_pop", "queue_len")

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
        """Return ``store.<name>(*args)``, waited for at most ``bound`` seconds."""
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
        self._jobs.put(None)


def host_store(addr: str, port: int | None, timeout: float) -> dist.TCPStore:
    """Host the group's store at ``addr:port`` (``None`` or 0: a free port, read from ``.port``)."""
    try:
        return hal.connect_store(addr, port or 0, 0, 1, timeout)
    except hal.DistributedTimeoutError as exc:
        raise CheckpointConfigError(f"cannot host the checkpoint engine's store at {addr}:{port or 0}: {exc}") from exc


def connect_store(addr: str, port: int, timeout: float, who: str) -> dist.TCPStore:
    """Connect to the store at ``addr:port`` within ``timeout`` seconds, else :class:`TransferTimeoutError`."""
    try:
        return hal.connect_store(addr, port, 1, 2, timeout)
    except hal.DistributedTimeoutError as exc:
        raise TransferTimeoutError(f"could not reach {who} (its store at {addr}:{port}) within {timeout:g} s: "
                                   f"{exc}") from None


def encode(message: Any) -> bytes:
    """Encode a dataclass instance as JSON bytes with its type's name."""
    body = message.to_dict() if hasattr(message, "to_dict") else dataclasses.asdict(message)
    return json.dumps({"type": type(message).__name__, "body": body}, separators=(",", ":")).encode()


def decode(raw: bytes, expect: type[M], where: str) -> M:
    """Rebuild a message of type ``expect`` from :func:`encode`'s bytes, else :class:`TransferError`."""
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
    """Validate a heartbeat timeout: seconds, at least ``2 * HEARTBEAT_S``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 2 * HEARTBEAT_S:
        raise CheckpointConfigError(f"heartbeat_timeout must be a number of seconds >= {2 * HEARTBEAT_S:g} "
                                    f"(two heartbeats), got {value!r}")
    return float(value)


def _store_timeout(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistStoreError)


class ControlChannel:
    """One rank's control channel of one engine group (see the module overview).

    ``store`` stays the caller's (the channel uses clones of it). ``label(rank)`` names a rank in errors;
    ``host_rank`` hosts the store. ``heartbeat=False``: no watching, no dead-peer detection. ``bounded``: on a
    client, plain calls go through a :class:`BoundedStore` (for a channel on an event loop; not where the store is
    shared with a process group's rendezvous). ``heartbeat_timeout`` (seconds) defaults to
    :data:`HEARTBEAT_DEAD_S`."""

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
        return "/".join((self.namespace, *parts))

    def post(self, name: str, message: Any) -> None:
        """Set key ``name`` to ``message`` (a dataclass); every client sees it once this returns."""
        self._set_seen(self.key(name), encode(message))

    def peek(self, name: str, expect: type[M]) -> M | None:
        """Return the message under key ``name`` without waiting, ``None`` if there is none."""
        key = self.key(name)
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except dist.DistError as exc:
            raise self._host_gone(f"the key {key!r}", exc) from None
        return decode(raw, expect, f"{self.label(self.rank)} reading {key!r}")

    def post_bytes(self, name: str, data: bytes) -> None:
        """Set key ``name`` to ``data`` as is; every client sees it once this returns."""
        try:
            self._set_seen(self.key(name), data)
        except dist.DistError as exc:
            raise self._host_gone(f"setting {self.key(name)!r}", exc) from None

    def _set_seen(self, key: str, data: bytes) -> None:
        # set returns unanswered; a check on the same connection is answered once the set is applied
        self.store.set(key, data)
        self.store.check([key])

    def get_bytes(self, name: str) -> bytes:
        return self.store.get(self.key(name))

    def wait_posted(self, names: dict[int, str], what: str, timeout: float | None = None) -> None:
        """Block until every rank of ``names`` (``{rank: key name}``) has set its key, within ``timeout`` s in all.

        A watched rank found dead fails the wait at once."""
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
        self.store.delete_key(self.key(name))

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to counter ``name`` (created at 0); return the new value."""
        try:
            return int(self.store.add(self.key(name), amount))
        except dist.DistError as exc:
            raise self._host_gone(f"the counter {self.key(name)!r}", exc) from None

    # ---- queues ----------------------------------------------------------------------------------------
    def send(self, queue: str, message: Any) -> None:
        """Append ``message`` to ``queue`` without waiting for a receiver."""
        try:
            self.store.queue_push(self.key(queue), encode(message))
        except dist.DistError as exc:
            raise self._host_gone(f"sending on {self.key(queue)!r}", exc) from None

    def pending(self, queue: str) -> int:
        """Return how many items wait in ``queue``, wake-up items included."""
        return int(self.store.queue_len(self.key(queue)))

    def drain(self, queue: str) -> None:
        """Drop whatever waits in ``queue``; quiet if the store is gone."""
        key = self.key(queue)
        try:
            while self.store.queue_len(key):
                self.store.queue_pop(key, False)
        except dist.DistError:
            pass

    async def recv(self, queue: str, expect: type[M], peer: int | None, what: str,
                   timeout: float | None = None) -> M:
        """Return the next ``expect`` message of ``queue`` from ``peer`` (``None``: any, unwatched), in a worker thread.

        Raises :class:`PeerFailure` after ``timeout`` seconds (``timed_out``), or when ``peer`` or the store dies."""
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
        """Return the next raw item of ``queue``, blocking the calling thread at most ``timeout`` seconds."""
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
        """Return an item already in queue ``key`` (stale wake-ups skipped), else ``None``."""
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
        """Return whether ``raw`` is a wake-up item; raise if it is the one for this wait."""
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
        with self._lock:
            for peer in peers:
                self._watched.setdefault(peer, (-1, time.monotonic()))
                self._dead.pop(peer, None)
                self._dead_count.pop(peer, None)

    def unwatch(self, peers: list[int]) -> None:
        with self._lock:
            for peer in peers:
                self._watched.pop(peer, None)
                self._dead.pop(peer, None)
                self._dead_count.pop(peer, None)

    def check_alive(self, peer: int, what: str = "a message") -> None:
        """Raise :class:`PeerFailure` if ``peer`` counts as dead; a dead one is asked once whether it beats again."""
        reason = self._dead.get(peer)
        if reason is not None and not self._beating_again(peer):
            raise PeerFailure(self.label(peer), f"{reason}, while {self.label(self.rank)} waited for {what}")

    def _beating_again(self, peer: int) -> bool:
        """Return whether ``peer``, found dead, bumped its counter since; if so it is alive again."""
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
        """Bump this rank's counter, judge the watched peers and wake waits on the dead, every heartbeat."""
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
        """Stop the heartbeat thread (waiting at most ``2 * HEARTBEAT_S``); idempotent. The store is the caller's."""
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

    token: int

