"""The ``CheckpointEngine`` contract: verl 0.9.1's ABC, weight publication tagged with ``global_steps``.

verl's ``CheckpointEngineManager`` calls, every update: sync ``prepare() -> dict`` (buffers, metadata such as
the master's address); classmethod ``build_topology(trainer_world_size, rollout_world_size, metadata)`` on
every worker's ``prepare()`` result (trainer ranks first), returning ``(trainer_kwargs, rollout_kwargs)`` of
per-rank lists; sync ``init_process_group(**kwargs)`` with one rank's entries; then concurrently
``async send_weights(weights, global_steps=None)`` and ``receive_weights(global_steps=None)`` (an async
iterator); then sync ``finalize()``. hal's engines default the lifecycle to no-ops and set up lazily, so an
engine built with its rank and address up front works without them.

Order and ownership: ``weights`` is consumed once, in order, and arrives in that order; ``await
send_weights`` returns when the sender may reuse or free its tensors. ``receive_weights(N)`` raises
:class:`VersionMismatchError` before yielding anything if the update carries another step; dtype, shape and
bytes arrive unchanged (received tensors are contiguous). Who owns buffers after a call is stated per engine.
The contract is judged by behaviour (:mod:`ckpt.testing`), so decorated methods pass and a plain
``def send_weights`` fails; :func:`contract_violations` is the static half."""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import math
import numbers
import threading
from typing import Any, AsyncIterator, Iterable, Iterator, Protocol, runtime_checkable

import torch

from ckpt.errors import CheckpointConfigError, ContractError, SendInProgressError, VersionMismatchError

NamedTensor = tuple[str, torch.Tensor]
# {keyword: [value for rank 0, value for rank 1, ...]}: what build_topology returns per side.
TopologyKwargs = dict[str, list]

# Called synchronously by verl's manager: their results must not be awaitables.
LIFECYCLE_METHODS = ("prepare", "init_process_group", "finalize")
AWAITABLE_METHODS = ("send_weights",)
ASYNC_ITER_METHODS = ("receive_weights",)
COROUTINE_METHODS = AWAITABLE_METHODS  # The earlier name of AWAITABLE_METHODS.


@runtime_checkable
class ReceivePlacement(Protocol):
    """Where a consumer wants received tensors' bytes (``receive_weights(..., placement=...)``)."""

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        """The tensor ``name`` should land in, or ``None`` for "anywhere".

        Used only if contiguous, on the engine's device, of that dtype and shape; bytes may land there before the
        update is known to be complete."""


def as_placement(placement: Any) -> ReceivePlacement | None:
    """Check ``placement`` is ``None`` or has ``target``; raise :class:`CheckpointConfigError` otherwise."""
    if placement is None or isinstance(placement, ReceivePlacement):
        return placement
    raise CheckpointConfigError(f"placement must be None or have target(name, dtype, shape) -> Tensor | None, "
                                f"got {type(placement).__name__}")


class CheckpointEngine(abc.ABC):
    """Moves named tensors from a trainer to rollout workers, tagged with the trainer's ``global_steps``.

    Built as verl's registry does: ``cls(bucket_size=..., is_master=..., **engine_kwargs)`` (``bucket_size`` in
    bytes, ``is_master`` on trainer rank 0). The contract is in the module overview."""

    wire_format = "named_tensors"  # How receive_weights yields (verl's attribute): (name, tensor) pairs.
    received_global_steps: int | None = None  # global_steps of the update last received (None before any).
    outcomes: dict = {}  # Sender: {receiver: ckpt.outcome.Outcome} of the last update, from those that report.
    send_buffer_words: str = ""  # What send_buffer_bytes counts, in words for a memory report ("": nothing).
    # Trainer and rollouts may use one device (verl's hybrid engine); device communicators refuse it.
    ranks_may_share_a_device: bool = False
    # Bytes travel over a network link: what hal soak's link faults and hal sync --link-gbit act on.
    bytes_cross_a_network: bool = False
    one_process: bool = False  # Trainer and rollouts run in one process: stopping one stops the job.
    stages_in_shared_memory: bool = False  # The trainer stages updates in /dev/shm: what a full /dev/shm fails.
    # Stages an update in bucket_size buckets led by a master (is_master); the job builds it with both.
    bucketed: bool = False
    hosts_rendezvous: bool = False  # The master hosts a rendezvous at master_addr that the other ranks connect to.
    supports_multi_sender: bool = False  # Runs multi_sender=True: every rank of a sharded trainer sends its own shards.
    supports_reshard: bool = False  # Rollouts may declare a layout and receive only its slices (ckpt.reshard).
    # An update travels as files under root: what a full disk fails; the job gives it a scratch directory.
    publishes_to_files: bool = False
    # A second update with the step just received is taken again (hal sync --compare-full needs it).
    accepts_repeated_global_steps: bool = False
    # Moves bytes with a transfer library (hal bench compares it with that library alone).
    uses_transfer_library: bool = False
    # Rollouts read the update from the trainer's registered memory (Kimi's engine): its baseline is a read.
    rollout_pulls: bool = False
    # hal sync --rollout vllm builds it inside vLLM's worker (ckpt.vllm_transfer); the job refuses any other.
    receives_inside_vllm: bool = False
    # (task, global_steps) of the send_weights running on this engine, None when none runs (see __init_subclass__).
    _send_running: tuple[Any, int | None] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the ``async`` ``send_weights`` a subclass defines refuse a second call while one runs."""
        super().__init_subclass__(**kwargs)
        send = cls.__dict__.get("send_weights")
        if send is not None and inspect.iscoroutinefunction(unwrap_method(send)):
            cls.send_weights = one_send_at_a_time(send)

    @classmethod
    def transport_words(cls, spec: Any) -> str | None:
        """How this engine moves bytes on device kind ``spec``, in a few words for reports; ``None``: nothing to add."""
        return None

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        """``{what: bytes}`` the sender holds while sending one update, beyond the caller's tensors (``{}`` here)."""
        return {}

    def publish_buffer(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """Return a flat ``uint8`` tensor of ``nbytes`` to stage an update in before :meth:`send_weights`.

        Plain memory here; an engine that sends staged tensors in place overrides it (the ipc engine)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise CheckpointConfigError(f"publish_buffer needs a positive int of bytes, got {nbytes!r}")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release_publish_buffer(self) -> None:
        """Free what :meth:`publish_buffer` holds; views of it must not be sent afterwards."""

    def prepare(self) -> dict[str, Any]:
        """Allocate per-update buffers; return this worker's metadata for ``build_topology`` (``{}`` here)."""
        return {}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[TopologyKwargs, TopologyKwargs]:
        """Return ``(trainer_kwargs, rollout_kwargs)`` of per-rank lists from every worker's ``prepare()`` result."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Join the communicator described by one rank's ``build_topology`` entries (no-op here)."""

    def promise_reports(self, arm: bool = True) -> bool:
        """Promise a :meth:`report_outcome` from this consumer (``arm``: after the next update it receives in this
        task); return whether the engine carries reports (:mod:`ckpt.outcome`)."""
        return False

    def report_outcome(self, error: BaseException | None = None, live: Any = None) -> None:
        """Tell the sender the update last received was applied (``error`` ``None``) or refused (:mod:`ckpt.outcome`).

        ``live``: the parameters in service (``{name: tensor}`` or a callable giving them), for a checked update."""

    @abc.abstractmethod
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Publish ``weights`` (iterable of ``(name, tensor)``) tagged with ``global_steps``."""

    @abc.abstractmethod
    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of one update, into ``placement``'s tensors where the engine can."""
        yield  # pragma: no cover - marks the abstract method as an async generator

    def finalize(self) -> None:
        """Release what ``prepare()`` allocated for this update (no-op here)."""


_SEND_LOCK = threading.Lock()  # makes a send's check-and-claim of its engine atomic across threads


def one_send_at_a_time(send: Any) -> Any:
    """Wrap ``send_weights`` so a call while another runs on the engine raises :class:`SendInProgressError` at once.

    The refused call touches nothing; the running one goes on. A call from inside the running one (``super()``) passes."""
    if getattr(send, "one_send_at_a_time", False):
        return send

    @functools.wraps(send)
    async def guarded(self: Any, weights: Any, global_steps: Any = None, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        with _SEND_LOCK:
            running = self._send_running
            if running is not None and running[0] is not task:
                raise SendInProgressError(
                    f"send_weights(global_steps={global_steps!r}) refused: this {type(self).__name__} is still "
                    f"sending global_steps={running[1]!r}; one update at a time per engine (await the running "
                    f"send_weights first)")
            owner = running is None
            if owner:
                self._send_running = (task, global_steps)
        try:
            return await send(self, weights, global_steps, *args, **kwargs)
        finally:
            if owner:
                self._send_running = None

    guarded.one_send_at_a_time = True  # wrapping it again is a no-op
    return guarded


def named_tensors(weights: Any, accepted: tuple[type, ...] = (torch.Tensor,),
                  unique: bool = False) -> Iterator[tuple[str, Any]]:
    """Iterate ``weights`` as ``send_weights`` takes them, checking each is a ``(str, accepted)`` pair.

    Raises :class:`CheckpointConfigError` (while consumed) on a non-iterable, a name twice (``unique``), or
    verl's ``get_per_tensor_param()`` ``(weights, peft_config)`` pair passed whole."""
    names = " | ".join(f"{t.__module__.split('.')[0]}.{t.__name__}" for t in accepted) or "value"
    if _is_param_pair(weights):
        raise CheckpointConfigError(
            f"weights is a ({type(weights[0]).__name__}, {type(weights[1]).__name__}) pair, as "
            "get_per_tensor_param() returns (weights, peft_config): pass its first element "
            "(weights, _ = engine.get_per_tensor_param()), an iterable of (str, torch.Tensor) pairs")
    try:
        items = iter(weights)
    except TypeError:
        raise CheckpointConfigError(f"weights must be an iterable of (str, {names}) pairs, got "
                                    f"{type(weights).__name__}") from None
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise CheckpointConfigError(f"weights must yield (str, {names}) pairs, got {type(item).__name__}"
                                        + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
        name, value = item
        if not isinstance(name, str) or (accepted and not isinstance(value, accepted)):
            raise CheckpointConfigError(f"weights must yield (str, {names}) pairs, got ({name!r}, "
                                        f"{type(value).__name__})")
        if unique:
            if name in seen:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice in one update")
            seen.add(name)
        yield name, value


def _is_param_pair(weights: Any) -> bool:
    if not isinstance(weights, tuple) or len(weights) != 2:
        return False
    first, second = weights
    if isinstance(first, (str, torch.Tensor)) or not isinstance(first, Iterable):
        return False
    return second is None or isinstance(second, dict) or not isinstance(second, (str, torch.Tensor, tuple, list))


def unwrap_method(fn: Any) -> Any:
    """The function under decorators that keep ``__wrapped__`` (``functools.wraps``, ``torch.no_grad()``)."""
    fn = getattr(fn, "__func__", fn)
    try:
        return inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        return fn


def callable_kind(fn: Any) -> str:
    if inspect.isasyncgenfunction(fn):
        return "an async generator function"
    if inspect.iscoroutinefunction(fn):
        return "a coroutine function ('async def')"
    if inspect.isgeneratorfunction(fn):
        return "a plain generator function (def with yield)"
    if callable(fn):
        return "a plain function (def)"
    return f"not callable ({type(fn).__name__})"


def contract_violations(engine_or_cls: Any) -> list[str]:
    """List the violations visible without calling anything (class or instance), one line each.

    Looks through decorators that keep ``__wrapped__``; the behavioural half is
    :func:`ckpt.testing.check_call_contract`."""
    problems = []
    for name in AWAITABLE_METHODS + ASYNC_ITER_METHODS + LIFECYCLE_METHODS + ("build_topology",):
        attr = getattr(engine_or_cls, name, None)
        if attr is None:
            problems.append(f"{name} is missing")
            continue
        fn = unwrap_method(attr)
        if name in AWAITABLE_METHODS:
            if not inspect.iscoroutinefunction(fn) and not hasattr(attr, "__wrapped__"):
                problems.append(f"{name} is {callable_kind(fn)}; calling it must give an awaitable ('async def')")
        elif name in ASYNC_ITER_METHODS:
            if not (inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(fn) or hasattr(attr, "__wrapped__")):
                problems.append(f"{name} is {callable_kind(fn)}; calling it must give an async iterator "
                                "('async def' with 'yield')")
        elif name == "build_topology":
            if not callable(attr) or inspect.iscoroutinefunction(fn):
                problems.append(f"build_topology is {callable_kind(fn)}; it must be a plain classmethod returning "
                                "(trainer_kwargs, rollout_kwargs)")
        elif inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            problems.append(f"{name} is {callable_kind(fn)}; verl calls it synchronously, so it must be a plain 'def'")
    return problems


def check_async_contract(engine_or_cls: Any) -> None:
    """Raise :class:`ContractError` listing every violation :func:`contract_violations` finds."""
    problems = contract_violations(engine_or_cls)
    if problems:
        name = getattr(engine_or_cls, "__name__", type(engine_or_cls).__name__)
        raise ContractError(f"checkpoint engine {name} breaks the contract: " + "; ".join(problems))


def check_step(asked: int | None, offered: int | None, where: str) -> None:
    """Raise :class:`VersionMismatchError` unless ``asked`` is ``None`` or equals ``offered``."""
    if asked is not None and asked != offered:
        raise VersionMismatchError(asked, offered, where)


def check_global_steps(global_steps: Any) -> int | None:
    """Validate ``global_steps``: ``None`` or an ``int >= 0``, else :class:`CheckpointConfigError`."""
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise CheckpointConfigError(f"global_steps must be None or an int >= 0, got {global_steps!r}")
    return global_steps


def check_seconds(value: Any, name: str = "timeout", allow_zero: bool = False) -> float:
    """Return a duration in seconds as a ``float``; finite, ``> 0`` (``>= 0`` with ``allow_zero``).

    Raises :class:`CheckpointConfigError` otherwise (``nan`` and ``inf`` included), naming ``name``."""
    accepted = "a finite real number of seconds " + (">= 0" if allow_zero else "> 0")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r}")
    return seconds


def check_direct_threshold(direct_threshold: Any, bucket_size: int) -> int:
    """Validate ``direct_threshold`` (bytes): ``None`` gives ``bucket_size // 8``; else an ``int >= 0``."""
    if direct_threshold is None:
        return bucket_size // 8
    if isinstance(direct_threshold, bool) or not isinstance(direct_threshold, int) or direct_threshold < 0:
        raise CheckpointConfigError(f"direct_threshold must be None (bucket_size // 8) or an int >= 0 bytes, "
                                    f"got {direct_threshold!r}")
    return direct_threshold


async def as_async_stream(weights: Iterable[NamedTensor] | AsyncIterator[NamedTensor]) -> AsyncIterator[NamedTensor]:
    """Iterate ``weights`` asynchronously, whether it is async or plain."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def drain(weights: Any) -> None:
    """Consume and discard what is left of a receive stream; a stream that raises is left as it is."""
    try:
        async for _ in as_async_stream(weights):
            pass
    except Exception:  # noqa: BLE001 - the update failed anyway; the caller raises the first error
        pass
