"""A rollout's word on each update, carried back to the sender's ``send_weights``: applied, or refused and why.

Opt-in per receiver, announced by the receiver: a consumer that will report calls ``promise_reports()`` on its
engine once (hal's :class:`ckpt.CheckpointEngineWorker` does; verl's does not, and no sender waits for it), then
``report_outcome(error, live)`` after every update it received. The sender's ``send_weights`` waits, within its
timeout, for the word of every receiver that promised, then raises :class:`UpdateRefusedError` naming each
refusal and its cause. ``send_weights(..., check=True)`` asks for a weight check (:mod:`ckpt.checker`): the sender
digests what it sends, a rollout digests its live parameters after applying, and the sender raises
:class:`ckpt.checker.WeightCheckError` naming each tensor that differs.

The words travel on a :class:`Board` of the engine's: its control store's keys (collective, p2p, kimi), memory
(colocated) or files (file). Keys: ``report/promise/<id>`` (this receiver reports), ``report/update`` or
``report/<n>/update`` (the sender's number ``n`` of the update in flight and whether it is checked; posted before
its first byte, read by a receiver once the update's first message arrived), ``report/<n>/expect`` (the
sender's digests), ``report/<n>/<id>`` (a receiver's :class:`Outcome`)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

from ckpt.checker import Digester, WeightCheckError, mismatches, served_digests
from ckpt.errors import TransferError, TransferTimeoutError, UpdateRefusedError

PREFIX = "report"
# A consumer's state in its task (a thread of asyncio.to_thread sees it): {"armed": it reports the next update it
# takes, "taken": {id of a Reports: the update it took}} (several for a multi-sender rollout's lanes).
_CONSUMER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hal_ckpt_report_consumer", default=None)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One receiver's word on update ``update`` of step ``step``: ``error`` is ``None`` when it applied it."""

    update: int
    step: int | None
    error: str | None = None
    mismatches: list[str] | None = None  # a checked update: the tensors its live parameters differ in


class Board(Protocol):
    """Where the words of one engine group meet (keys are short strings, values bytes)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...  # without waiting

    def add(self, key: str, amount: int) -> int: ...  # a counter, created at 0

    def delete(self, key: str) -> None: ...

    def wait(self, keys: dict[Any, str], what: str, timeout: float) -> None: ...  # raise naming who is missing


class StoreBoard:
    """A :class:`Board` on a :class:`ckpt.control.ControlChannel` (keys under its namespace)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def put(self, key: str, data: bytes) -> None:
        self.channel.post_bytes(key, data)

    def get(self, key: str) -> bytes | None:
        if not self.channel.store.check([self.channel.key(key)]):
            return None
        return self.channel.get_bytes(key)

    def add(self, key: str, amount: int) -> int:
        return self.channel.add(key, amount)

    def delete(self, key: str) -> None:
        try:
            self.channel.unset(key)
        except Exception:  # noqa: BLE001 - gone with its store
            pass

    def wait(self, keys: dict[Any, str], what: str, timeout: float) -> None:
        self.channel.wait_posted(keys, what, timeout)


class MemoryBoard:
    """A :class:`Board` in this process (the colocated engine's); ``label(id)`` names a receiver."""

    def __init__(self, label: Callable[[Any], str] = str) -> None:
        self.values: dict[str, bytes] = {}
        self.label = label
        self._changed = threading.Condition()

    def put(self, key: str, data: bytes) -> None:
        with self._changed:
            self.values[key] = data
            self._changed.notify_all()

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(value).encode()
            return value

    def delete(self, key: str) -> None:
        self.values.pop(key, None)

    def wait(self, keys: dict[Any, str], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(k in self.values for k in keys.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(self.label(i) for i, k in keys.items() if k not in self.values)
                    raise TransferTimeoutError(f"{missing} did not answer {what} within {timeout:g} s")
                self._changed.wait(left)


class DirectoryBoard:
    """A :class:`Board` of files under ``root`` (the file engine's), polled every ``poll`` seconds."""

    def __init__(self, root: Path, poll: float = 0.05, label: Callable[[Any], str] = str) -> None:
        self.root, self.poll, self.label = Path(root), poll, label

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        for attempt in range(3):  # another process's tidy() may remove the empty folder between mkdir and write
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.write_bytes(data)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        tmp.replace(path)  # atomic: a reader sees all of it or nothing

    def tidy(self) -> None:
        """Remove the board's empty folders, the board's own included (nothing is left in a user's root)."""
        for folder, _, _ in os.walk(self.root, topdown=False):  # deepest first, root last; a vanished folder is skipped
            try:
                os.rmdir(folder)
            except OSError:  # not empty, or gone
                pass

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def add(self, key: str, amount: int) -> int:
        value = int(self.get(key) or b"0") + amount  # one sender per root
        self.put(key, str(value).encode())
        return value

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # an update's folder, once empty
        except OSError:
            pass

    def list(self, prefix: str) -> list[str]:
        try:  # a reader's delete() may remove the folder under us
            return sorted(p.name for p in self._path(prefix).iterdir() if not p.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def wait(self, keys: dict[Any, str], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            missing = [i for i, k in keys.items() if not self._path(k).exists()]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"{', '.join(self.label(i) for i in missing)} did not answer {what} within "
                                           f"{timeout:g} s")
            time.sleep(self.poll)


def _key(*parts: Any) -> str:
    return "/".join((PREFIX, *map(str, parts)))


class Pending:
    """The sender's side of one update's reports (from :meth:`Reports.begin`)."""

    def __init__(self, reports: Reports, n: int, step: int | None, waiting: list[Any], digester: Digester | None,
                 outer: bool) -> None:
        self.reports, self.n, self.step, self.waiting, self.digester = reports, n, step, waiting, digester
        self.outer = outer  # the digester is filled by a wrapping engine
        self.posted = False  # the digests are on the board
        self.record = _key("update")  # the key of the update's record

    def watch(self, weights: Iterable, parts: Mapping | None = None) -> Iterable:
        """Return ``weights``, digested as they stream when the update is checked by this engine's sender.

        The digests are posted once the stream ends, before a receiver can see its end."""
        if self.digester is None or self.outer:
            return weights
        return self._watch(weights, parts)

    def _watch(self, weights: Iterable, parts: Mapping | None) -> Iterable:
        yield from self.digester.watch(weights, parts)
        self._post_expected()

    def _post_expected(self) -> None:
        if self.digester is not None and not self.posted:
            self.reports.board.put(_key(self.n, "expect"), json.dumps(self.digester.result()).encode())
            self.posted = True

    async def collect(self, timeout: float) -> dict[Any, Outcome]:
        """Wait for every promised receiver's :class:`Outcome`; raise on a refusal or a failed check."""
        board, label = self.reports.board, self.reports.label
        self._post_expected()
        keys = {i: _key(self.n, i) for i in self.waiting}
        try:
            if keys:
                await asyncio.to_thread(board.wait, keys, f"its word on step {self.step} (update {self.n})", timeout)
            outcomes = {i: Outcome(**json.loads(board.get(k))) for i, k in keys.items()}
        except TransferError as exc:
            error = TransferTimeoutError if getattr(exc, "timed_out", True) else TransferError
            raise error(f"step {self.step} was sent, but {exc}; it promised a report (promise_reports) and made "
                        "none") from None
        finally:
            for key in [*keys.values(), *([_key(self.n, "expect")] if self.digester is not None else []),
                        *([self.record] if self.record != _key("update") else [])]:
                board.delete(key)
        refused = {i: o.error for i, o in outcomes.items() if o.error is not None}
        if refused:
            text = "; ".join(f"{label(i)}: {cause}" for i, cause in refused.items())
            raise UpdateRefusedError(f"step {self.step} was not applied by {len(refused)} of {len(outcomes)} "
                                     f"reporting rollouts: {text}", refused, outcomes)
        wrong = {i: o.mismatches for i, o in outcomes.items() if o.mismatches}
        if wrong:
            text = "; ".join(f"{label(i)}: {', '.join(found)}" for i, found in wrong.items())
            raise WeightCheckError(f"the weight check of step {self.step} failed: {text}",
                                   {label(i): found for i, found in wrong.items()}, outcomes)
        return outcomes


def carries_reports(engine: Any) -> bool:
    """Announce a reporting consumer to ``engine``; return whether it carries reports (one without
    ``promise_reports``, verl's own, does not)."""
    promise = getattr(engine, "promise_reports", None)
    return bool(promise(arm=False)) if promise is not None else False


class ReportsOnBoard:
    """``promise_reports``/``report_outcome`` of an engine that keeps its :class:`Reports` as ``_reports`` (mix in
    before :class:`ckpt.base.CheckpointEngine`)."""

    _reports: Reports
    timeout: float

    def promise_reports(self, arm: bool = True) -> bool:
        self._reports.promise(arm)
        return True

    def report_outcome(self, error: BaseException | None = None, live: Any = None) -> None:
        self._reports.report(error, live, self.timeout)


class Reports:
    """One engine's side of the reports, kept for its life and bound to each group's board: a receiver's (``me``
    its id on the board) or the sender's. ``label(id)`` names a receiver, or the sender by its id ``sender``."""

    def __init__(self, label: Callable[[Any], str] = str, sender: Any = 0) -> None:
        self.label, self.sender = label, sender
        self.board: Board | None = None
        self.me: Any = None
        self.promised = False  # receiver: its consumer reports (announced on every board bound)
        self._announced = False

    def bind(self, board: Board, me: Any = None) -> None:
        """Work on ``board`` (a group's) as receiver ``me`` (``None``: anonymous, numbered in report order)."""
        self.board, self.me, self._announced = board, me, False
        self._announce()

    def unbind(self) -> None:
        self.board = None

    # ---- receiver ---------------------------------------------------------------------------------
    def promise(self, arm: bool = True) -> None:
        """Announce that a consumer reports; ``arm``: it reports the next update taken in this task."""
        self.promised = True
        if arm:
            _CONSUMER.set({"armed": True, "taken": {}})
            self._announce()
        else:  # a new consumer: an anonymous board counts it
            self._announce(again=self.me is None)

    @staticmethod
    def armed() -> bool:
        state = _CONSUMER.get()
        return bool(state and state["armed"])

    def _announce(self, again: bool = False) -> None:
        if not self.promised or self.board is None or (self._announced and not again):
            return
        if self.me is None:
            self.board.add(_key("promises"), 1)
        else:
            self.board.put(_key("promise", self.me), b"1")
        self._announced = True

    def withdraw(self) -> None:
        if self.board is not None and self._announced and self.me is not None:
            self.board.delete(_key("promise", self.me))
        self.promised = self._announced = False

    def take(self, step: int | None, n: int | None = None) -> None:
        """Note that an update of ``step`` is in hand (``n``: its number, where the engine knows it).

        Taken without a consumer armed to report it (the engine used directly), it is answered now: received."""
        if not self.promised or self.board is None:
            return
        taken = {"step": step, "n": n}
        state = _CONSUMER.get()
        if state is not None and state["armed"]:
            state["taken"][id(self)] = taken
        else:
            self._post(taken, None, None, 0.0, None, unarmed=True)

    def report(self, error: BaseException | str | None, live: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None,
               timeout: float, locate: Any = None) -> None:
        """Post this consumer's :class:`Outcome` of the update it took, if the sender waits for it.

        The sender's record of the update is read now: it is current while the sender waits for this word, and a
        record of another step, or one that waits for someone else, is not answered."""
        state = _CONSUMER.get()
        if state is None:
            return
        taken = state["taken"].pop(id(self), None)
        if not state["taken"]:
            state["armed"] = False  # an arm is for one update, reported or not
        if taken is not None and self.board is not None:
            self._post(taken, error, live, timeout, locate)

    def _post(self, taken: dict, error: Any, live: Any, timeout: float, locate: Any, unarmed: bool = False) -> None:
        try:
            raw = self.board.get(_key("update") if taken["n"] is None else _key(taken["n"], "update"))
        except Exception:  # noqa: BLE001 - an unreachable board: the sender's wait names this receiver
            return
        update = json.loads(raw) if raw else None
        waiting = update and update["waiting"]
        if update is None or update["step"] != taken["step"] or (self.me is not None and waiting is not None
                                                                 and self.me not in waiting):
            return
        found = None
        if error is None and update.get("check"):
            found = (["the update was received without a consumer that reports (ckpt.CheckpointEngineWorker): "
                      "nothing was checked"] if unarmed else self._check(update["n"], live, timeout, locate))
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        me = self.me if self.me is not None else self.board.add(_key(update["n"], "count"), 1) - 1
        outcome = Outcome(update["n"], update["step"], error, found)
        self.board.put(_key(update["n"], me), json.dumps(dataclasses.asdict(outcome)).encode())

    def _check(self, n: int, live: Any, timeout: float, locate: Any) -> list[str]:
        if live is None:
            return ["the rollout gave no live parameters to check (report_outcome(live=...))"]
        try:
            self.board.wait({self.sender: _key(n, "expect")}, "its digests", timeout)
        except TransferError as exc:
            return [f"no digests from the trainer: {exc}"]
        expected = json.loads(self.board.get(_key(n, "expect")) or b"{}")
        live = live() if callable(live) else live
        return mismatches(expected, served_digests(expected, live, locate))

    # ---- sender -----------------------------------------------------------------------------------
    def promised_by(self, receivers: Iterable[Any] | int | None) -> list[Any] | None:
        """Return the ``receivers`` that promised (an int: that many anonymous ones at most, numbered from 0;
        ``None``: not known yet, the engine sets ``Pending.waiting`` before collecting)."""
        if receivers is None:
            return None
        if isinstance(receivers, int):
            return list(range(min(receivers, int(self.board.get(_key("promises")) or b"0"))))
        return [r for r in receivers if self.board.get(_key("promise", r)) is not None]

    def begin(self, receivers: Iterable[Any] | int | None, step: int | None, check: bool | Digester = False,
              n: int | None = None) -> Pending:
        """Start update ``n`` (``None``: the next of the board's counter) for the ``receivers`` that promised.

        ``check``: ``True`` digests what this engine sends, a :class:`Digester` is one a wrapping engine fills."""
        if self.board is None:
            raise TransferError(f"no group to send step {step} in (the engine was closed)")
        key = _key("update") if n is None else _key(n, "update")
        n = self.board.add(_key("n"), 1) if n is None else n
        outer = isinstance(check, Digester)
        digester = check if outer else Digester() if check else None
        waiting = self.promised_by(receivers)
        if waiting != [] or digester is not None:  # nobody to answer: no record (a file engine's root stays clean)
            self.board.put(key, json.dumps({"n": n, "step": step, "check": digester is not None,
                                            "waiting": waiting}).encode())
        pending = Pending(self, n, step, waiting or [], digester, outer)
        pending.record = key
        return pending

__all__ = ["Board", "DirectoryBoard", "carries_reports", "MemoryBoard", "Outcome", "Pending", "Reports", "ReportsOnBoard", "StoreBoard",
           "UpdateRefusedError"]
