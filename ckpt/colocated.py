"""Hand-over of weights inside one process (trainer and rollout colocated), zero copy, streamed."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, AsyncIterator, Iterable, Iterator

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, check_seconds, check_step, named_tensors
from ckpt.errors import CheckpointConfigError, TransferAbortedError, TransferTimeoutError
from ckpt.outcome import MemoryBoard, Reports, ReportsOnBoard


class _Offer:
    """One hand-over in flight: the sender's step and iterable, and what the receiver reports back."""

    def __init__(self, step: int | None, weights: Iterable[NamedTensor], receivers: int = 1) -> None:
        self.step, self.receivers = step, receivers
        self.taken = 0  # receivers that took it
        self.finished = 0  # receivers finished with every tensor (or stopped)
        self.error: BaseException | None = None  # what the sender's iterable raised
        self.activity = asyncio.Event()  # set on take, on every item requested, and when one is done
        self._source = named_tensors(weights)
        self._items: list[NamedTensor] = []  # items some receiver has not taken yet (several receivers)
        self._base = 0  # index (in the source) of self._items[0]
        self._positions: list[int] = []

    @property
    def done(self) -> bool:
        return self.finished >= self.receivers

    def reader(self) -> Iterator[NamedTensor]:
        """Return this receiver's pass over the sender's iterable, read once for all receivers."""
        if self.receivers == 1:
            return self._source
        me = len(self._positions)
        self._positions.append(0)
        return self._read(me)

    def _read(self, me: int) -> Iterator[NamedTensor]:
        while True:
            index = self._positions[me]
            if index - self._base == len(self._items):
                if self.error is not None:
                    raise self.error
                try:
                    self._items.append(next(self._source))
                except StopIteration:
                    return
                except Exception as exc:
                    self.error = exc
                    raise
            item = self._items[index - self._base]
            self._positions[me] = index + 1
            if len(self._positions) == self.receivers:  # everyone is reading: drop what all have passed
                passed = min(self._positions) - self._base
                if passed > 0:
                    del self._items[:passed]
                    self._base += passed
            yield item


class ColocatedCheckpointEngine(ReportsOnBoard, CheckpointEngine):
    """One instance shared by the trainer and the rollout of a process (one event loop); nothing is copied.

    The rollout streams the trainer's own tensors from its iterable, one at a time. Ownership: a yielded tensor
    is the trainer's live tensor, valid until the next item is requested; ``send_weights`` returns once every
    receiver asked past the last item (or stopped). Sender and receiver must run concurrently, as verl's manager
    runs them; a sender alone raises :class:`TransferTimeoutError` after ``timeout`` seconds and withdraws its
    offer. ``channel``: every construction with that name in this process returns the same instance (verl's
    workers each build their own). ``init_process_group(receivers=R)`` serves each offer to R receivers, the
    iterable still read once."""

    send_buffer_words = ""  # nothing: the receiver reads the sender's own tensors
    one_process = True
    accepts_repeated_global_steps = True  # an offer is taken whatever its step, unless a step is asked for

    _channels: weakref.WeakValueDictionary[tuple[type, str], ColocatedCheckpointEngine] = \
        weakref.WeakValueDictionary()

    def __new__(cls, *args: Any, channel: str | None = None, **kwargs: Any) -> ColocatedCheckpointEngine:
        if channel is not None and (cls, channel) in cls._channels:
            return cls._channels[(cls, channel)]
        engine = super().__new__(cls)
        if channel is not None:
            cls._channels[(cls, channel)] = engine
        return engine

    def __init__(self, bucket_size: int | None = None, is_master: bool = False, timeout: float = 60.0,
                 channel: str | None = None) -> None:
        timeout = check_seconds(timeout)
        if getattr(self, "_channel_joined", False):  # another worker's construction of a named channel
            return
        self._channel_joined = channel is not None
        self.channel, self.receivers = channel, 1
        self.timeout = float(timeout)
        self.bucket_size, self.is_master = bucket_size, bool(is_master)
        self._offer: _Offer | None = None
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        board = MemoryBoard(lambda who: "the trainer" if who == "trainer" else f"colocated receiver {who}")
        self._reports = Reports(board.label, "trainer")
        self._reports.bind(board)  # receivers anonymous, numbered in report order

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._ready is None or self._loop is not loop:
            self._ready, self._loop = asyncio.Event(), loop
            if self._offer is not None:
                self._ready.set()
        return self._ready

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        return {}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """Tell every rank how many receivers share each offer."""
        if isinstance(rollout_world_size, bool) or not isinstance(rollout_world_size, int) or rollout_world_size < 1:
            raise CheckpointConfigError(f"rollout_world_size must be an int >= 1, got {rollout_world_size!r}")
        return ({"receivers": [rollout_world_size] * trainer_world_size},
                {"receivers": [rollout_world_size] * rollout_world_size})

    def init_process_group(self, receivers: int = 1, **_ignored: Any) -> None:
        """Serve each offer to ``receivers`` ``receive_weights`` calls (default 1)."""
        if isinstance(receivers, bool) or not isinstance(receivers, int) or receivers < 1:
            raise CheckpointConfigError(f"receivers must be an int >= 1, got {receivers!r}")
        self.receivers = receivers

    def finalize(self) -> None:
        """Withdraw an offer not taken by every receiver."""
        self._offer = None
        if self._ready is not None:
            self._ready.clear()

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: Any = False) -> None:
        """Offer ``weights`` tagged ``global_steps``; return once every receiver is done with every tensor and every
        reporting one applied it (:mod:`ckpt.outcome`; ``check``: and serves it, :mod:`ckpt.checker`).

        What ``weights`` raised is raised here too."""
        global_steps = check_global_steps(global_steps)
        pending = self._reports.begin(self.receivers, global_steps, check)
        offer = _Offer(global_steps, pending.watch(weights), self.receivers)
        self._offer = offer
        self._event().set()
        try:
            while not offer.done:
                offer.activity.clear()
                try:
                    await asyncio.wait_for(offer.activity.wait(), self.timeout)
                except asyncio.TimeoutError:
                    what = ("stopped asking for tensors" if offer.taken else
                            "took the offer (run the rollout's receive concurrently with the send, as verl's "
                            "CheckpointEngineManager does: the colocated engine hands over the trainer's own "
                            "tensors, so the send cannot return before they are read)")
                    raise TransferTimeoutError(f"colocated hand-over of global_steps={global_steps}: no receiver "
                                               f"{what} within {self.timeout:g} s") from None
        finally:
            if self._offer is offer:  # never taken: withdraw it, so the next update starts clean
                self._offer = None
                self._event().clear()
        if offer.error is not None:
            raise offer.error
        self.outcomes = await pending.collect(self.timeout)

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: Any = None) -> AsyncIterator[NamedTensor]:
        """Yield the offered pairs, waiting up to ``timeout`` seconds for an offer; ``placement`` is ignored."""
        global_steps = check_global_steps(global_steps)
        try:
            await asyncio.wait_for(self._event().wait(), self.timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"no weights were offered to the colocated engine within {self.timeout:g} s") from None
        offer = self._offer
        offer.taken += 1
        if offer.taken >= offer.receivers:
            self._offer = None
            self._event().clear()
        offer.activity.set()
        try:
            self._reports.take(offer.step)
            check_step(global_steps, offer.step, "colocated hand-over")
            self.received_global_steps = offer.step
            items = offer.reader()
            while True:
                try:
                    name, tensor = next(items)
                except StopIteration:
                    break
                except Exception as exc:
                    offer.error = offer.error or exc
                    raise TransferAbortedError(f"the trainer's weights failed mid-update of global_steps="
                                               f"{offer.step}: {type(exc).__name__}: {exc}") from exc
                yield name, tensor
                offer.activity.set()  # the consumer asked for the next item: it is done with this one
        finally:
            offer.finished += 1
            offer.activity.set()
