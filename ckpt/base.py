"""The ``CheckpointEngine`` contract: verl 0.9.1's ABC, weight publication tagged with ``global_steps``.

The shape is verl's ``verl.checkpoint_engine.base.CheckpointEngine`` (0.9.1), so verl's
``CheckpointEngineManager`` drives hal's engines and hal's suite judges verl's:

* sync ``prepare() -> dict``: per-update buffers, and metadata (e.g. the master's address and port);
* classmethod ``build_topology(trainer_world_size, rollout_world_size, metadata) -> (trainer_kwargs,
  rollout_kwargs)``: run by the controller on every worker's ``prepare()`` result (trainer ranks first);
  each returned dict maps a keyword to a per-rank list (one entry per rank of that side);
* sync ``init_process_group(**kwargs)``: one rank's entries of those lists;
* ``async send_weights(weights, global_steps=None)`` over an iterable of ``(name, tensor)``;
* ``receive_weights(global_steps=None)``: calling it returns an async iterator of ``(name, tensor)``;
* sync ``finalize()``: releases what ``prepare()`` allocated for one update.

verl's manager runs prepare, build_topology, init_process_group, the concurrent send/receive and finalize
on every update. hal's engines default the lifecycle to no-ops and run what they need lazily on the first
send or receive, so an engine built with its rank and address up front works without them too.

The contract is judged by behaviour (:mod:`ckpt.testing`): the call ``send_weights(...)`` must give an
awaitable and ``receive_weights(...)`` an async iterator, so methods wrapped by a decorator (verl wraps
its own in ``@torch.no_grad()``) pass; a plain ``def send_weights`` (verl 0.9.1's own
``ColocatedCheckpointEngine``: awaiting its ``None`` raises ``TypeError``) fails. :func:`contract_violations`
is the static half the registry applies to a class before any instance exists.
"""

from __future__ import annotations

import abc
import inspect
import math
import numbers
from typing import Any, AsyncIterator, Iterable, Iterator, Protocol, runtime_checkable

import torch

from ckpt.errors import CheckpointConfigError, ContractError, VersionMismatchError

NamedTensor = tuple[str, torch.Tensor]
TopologyKwargs = dict[str, list]
"""``{keyword: [value for rank 0, value for rank 1, ...]}``: what ``build_topology`` returns per side."""

LIFECYCLE_METHODS = ("prepare", "init_process_group", "finalize")
"""Lifecycle methods verl's manager calls synchronously (their results must not be awaitables)."""
AWAITABLE_METHODS = ("send_weights",)
"""Methods whose call must give an awaitable."""
ASYNC_ITER_METHODS = ("receive_weights",)
"""Methods whose call must give an async iterator."""
COROUTINE_METHODS = AWAITABLE_METHODS
"""Kept for callers of the earlier name: the methods that must be awaitable."""


@runtime_checkable
class ReceivePlacement(Protocol):
    """Where a consumer wants received tensors' bytes (e.g. a rollout's weight bank), for engines that can
    receive straight into consumer memory (``receive_weights(..., placement=...)``).
    """

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        """The tensor ``name`` (``dtype``, ``shape``) should land in, or ``None`` for "anywhere".

        An engine uses a target only if it is contiguous, on the engine's device, of that dtype and shape
        (and whatever alignment the engine needs); it yields that very tensor then. Bytes may be written
        there before the update is known to be complete.
        """


def as_placement(placement: Any) -> ReceivePlacement | None:
    """``placement`` checked as a :class:`ReceivePlacement`: ``None`` or an object with ``target``.

    Raises:
        CheckpointConfigError: anything else (names its type).
    """
    if placement is None or isinstance(placement, ReceivePlacement):
        return placement
    raise CheckpointConfigError(f"placement must be None or have target(name, dtype, shape) -> Tensor | None, "
                                f"got {type(placement).__name__}")


class CheckpointEngine(abc.ABC):
    """Moves named tensors from a trainer to rollout workers, tagged with the trainer's ``global_steps``.

    Constructors take ``bucket_size`` (bytes) and ``is_master`` (trainer rank 0, as verl's trainer passes
    it) plus keyword configuration, since verl's registry builds engines as
    ``cls(bucket_size=..., is_master=..., **engine_kwargs)``.

    Contract (checked by :mod:`ckpt.testing` for any engine):

    * ``await send_weights(weights, global_steps)``: ``weights`` is an iterable of ``(name, tensor)``
      consumed once, in order; returns when the sender may reuse or free those tensors.
    * ``receive_weights(global_steps)`` returns an async iterator of ``(name, tensor)`` in the order they
      were sent. With ``global_steps=N`` it raises :class:`VersionMismatchError` (before yielding anything)
      if the update on offer carries another step. Once the first item is yielded (or the iterator ends),
      :attr:`received_global_steps` is the sender's step.
    * dtype, shape and bytes arrive unchanged (fp32, bf16, fp16, int64, bool, empty, 0-d and non-contiguous
      tensors; the received ones are contiguous).
    * Lifecycle (all synchronous, as verl calls them): ``prepare() -> dict``, the classmethod
      ``build_topology``, ``init_process_group(**kwargs)``, ``finalize()``. The defaults do nothing.

    Who owns which buffer after a call is engine specific and stated in each engine's docstring.
    """

    wire_format = "named_tensors"
    """How ``receive_weights`` yields (verl's attribute): ``(name, tensor)`` pairs."""

    received_global_steps: int | None = None
    """The ``global_steps`` of the update most recently received by this instance (``None`` before any)."""

    send_buffer_words: str = ""
    """What :meth:`send_buffer_bytes` counts, in words for a memory bound's report (``""``: nothing)."""

    ranks_may_share_a_device: bool = False
    """Whether the trainer's and the rollouts' processes may use one device (verl's hybrid engine). ``False``
    here: a device communicator refuses two ranks on one device (NCCL's "Duplicate GPU detected"; HCCL alike).
    Engines that hand over through memory or files say ``True``."""

    bytes_cross_a_network: bool = False
    """Whether an update's bytes travel between the trainer's and a rollout's processes over a network link
    (sockets, RDMA): what a cut, slowed or emulated link acts on (``hal soak``'s link faults, ``hal sync
    --link-gbit``). ``False`` here; the collective engine and the transfer-library engines say ``True``."""

    one_process: bool = False
    """Whether the trainer and the rollouts run in one process (the colocated engine): killing or stopping one
    of them is killing or stopping the whole job."""

    stages_in_shared_memory: bool = False
    """Whether the trainer stages updates in POSIX shared memory (``/dev/shm``), as the ipc engine does on host
    memory and the simulated npu's shareable buffers do: what a full ``/dev/shm`` fails."""

    bucketed: bool = False
    """Whether the engine stages an update in buckets of ``bucket_size`` bytes and has a master (``is_master``:
    the trainer) that leads each update, as verl's bucketed engines (NCCL, HCCL, NIXL, Mooncake): the job builds
    it with both. ``False``: the file and colocated engines (they accept and ignore verl's two keywords)."""

    hosts_rendezvous: bool = False
    """Whether the master hosts the update's rendezvous at an address the other ranks connect to
    (``master_addr``; the collective and transfer-library engines). ``False``: nothing to connect to, or an
    address the master picks on the host itself (the ipc engine)."""

    supports_multi_sender: bool = False
    """Whether the engine runs the multi-sender topology (``multi_sender=True``: every rank of a sharded trainer
    sends its own shards)."""

    publishes_to_files: bool = False
    """Whether an update travels as files in a directory every rank reads and writes (``root``; the file
    engine): what a full disk fails, and what the job gives a scratch directory when none is named."""

    accepts_repeated_global_steps: bool = False
    """Whether a second update tagged with the ``global_steps`` just received is taken again (the collective
    and colocated engines) rather than refused or skipped as not newer (the file engine offers only newer
    steps): what publishing one step twice, as ``hal sync --compare-full``'s reference does, needs."""

    uses_transfer_library: bool = False
    """Whether the engine moves bytes with a third-party transfer library (NIXL, Mooncake, Kimi's
    checkpoint-engine over Mooncake) whose bare transport its class offers as ``bare_transport(rank)``
    (:class:`ckpt.p2p.Transport`): what ``hal bench``'s transfer-library figures compare the engine with."""

    rollout_pulls: bool = False
    """Whether the rollouts read the update from the trainer's registered memory (Kimi's engine) rather than
    the trainer writing it to them: its library baseline is a read."""

    receives_inside_vllm: bool = False
    """Whether the job's vLLM rollout (``hal sync --rollout vllm``) builds this engine inside vLLM's worker
    (:mod:`ckpt.vllm_transfer`, with ``bucket_size``, ``is_master`` and ``timeout``): the collective engine, the
    one ``tests/vllm`` runs there. The job refuses any other up front rather than failing inside vLLM."""

    @classmethod
    def transport_words(cls, spec: Any) -> str | None:
        """How this engine moves an update's bytes on the device kind ``spec`` (a ``hal.DeviceSpec``), in a few
        words for reports (``hal sync`` prints them beside the engine's name); ``None`` here: nothing to add to
        the engine's name. Never raises."""
        return None

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        """What the sending side holds while it sends one update, beyond the caller's tensors.

        Args:
            bucket_size: the engine's bucket size (bytes).
            published_bytes: bytes of the update (all tensors).

        Returns:
            ``{what: bytes}`` (e.g. ``{"buckets_bytes": 3 * bucket_size}``); ``{}`` here: nothing.
        """
        return {}

    def publish_buffer(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A flat ``uint8`` tensor of ``nbytes`` on ``device`` for a trainer to stage an update in (cast its weights
        into views of it) before :meth:`send_weights`; hal's extension of verl's contract, optional to use.

        Here: plain memory (``torch.empty``), sent as any tensor is. An engine that reads the staged tensors in
        place overrides it and then sends them without copying them into its buckets (the ipc engine: the
        buffer is shared with the rollouts' processes).

        Raises:
            CheckpointConfigError: ``nbytes`` is not a positive int.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise CheckpointConfigError(f"publish_buffer needs a positive int of bytes, got {nbytes!r}")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release_publish_buffer(self) -> None:
        """Free what :meth:`publish_buffer` holds beyond the caller's reference (nothing here); views of it the
        caller still holds must not be sent afterwards."""

    def prepare(self) -> dict[str, Any]:
        """Allocate per-update buffers; return this worker's metadata for ``build_topology`` (``{}`` here)."""
        return {}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[TopologyKwargs, TopologyKwargs]:
        """Keyword lists for each side's ``init_process_group`` from every worker's ``prepare()`` result.

        Args:
            trainer_world_size, rollout_world_size: ranks on each side.
            metadata: ``prepare()`` results, trainer ranks first, then rollout ranks.

        Returns:
            ``(trainer_kwargs, rollout_kwargs)``, each ``{keyword: per-rank list}``; ``({}, {})`` here.
        """
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Join the communicator described by one rank's ``build_topology`` entries (no-op here)."""

    @abc.abstractmethod
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Publish ``weights`` (iterable of ``(name, tensor)``) tagged with ``global_steps``."""

    @abc.abstractmethod
    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: ReceivePlacement | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of one update; see the class docstring.

        ``placement`` (a :class:`ReceivePlacement`) says where the consumer wants tensors' bytes; an engine
        that can write there does, and yields those tensors; one that cannot ignores it.
        """
        yield  # pragma: no cover - marks the abstract method as an async generator

    def finalize(self) -> None:
        """Release what ``prepare()`` allocated for this update (no-op here)."""


def named_tensors(weights: Any, accepted: tuple[type, ...] = (torch.Tensor,),
                  unique: bool = False) -> Iterator[tuple[str, Any]]:
    """Iterate ``weights`` as ``send_weights`` takes them, checking each item: a ``(name, value)`` pair, a
    ``str`` name and a value of one of ``accepted`` (empty: any value; the caller checks it); with ``unique``,
    a name at most once (an engine that keys its update by name).

    Every engine's ``send_weights`` reads its weights through this, so a wrong argument is the same
    :class:`CheckpointConfigError` everywhere. The common one is verl's ``get_per_tensor_param()`` result
    passed whole: it returns a ``(weights, peft_config)`` pair (verl 0.9.1 ``BaseEngine``), whose first
    "item" is the weights generator itself.

    Raises (while consumed):
        CheckpointConfigError: ``weights`` is not iterable, is such a ``(weights, peft_config)`` pair,
            yields an item that is not a ``(str, accepted)`` pair, or (``unique``) a name twice; the message
            names what it got.
    """
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
    """``weights`` looks like ``get_per_tensor_param()``'s ``(iterable of pairs, peft_config or None)``."""
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
    """The violations visible without calling anything (class or instance; subclass of the ABC or not).

    Decorators that keep ``__wrapped__`` are looked through. Flagged: a missing method; ``send_weights``
    declared as a plain ``def`` (awaiting its result raises ``TypeError``); ``receive_weights`` declared as
    a plain ``def`` or plain generator (no async iterator); a lifecycle method declared ``async`` (verl
    calls it synchronously and would get a coroutine, never run); ``build_topology`` not callable on
    the class. The behavioural half (what the calls return) is :func:`ckpt.testing.check_call_contract`.

    Returns:
        One line per violation, e.g. ``"send_weights is a plain function (def); calling it must give an
        awaitable ('async def')"``; empty when none is visible.
    """
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
    """Validate a ``global_steps`` argument: ``None`` or a non-negative ``int`` (not ``bool``).

    Raises:
        CheckpointConfigError: anything else (a ``ValueError``; the message names the value).
    """
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise CheckpointConfigError(f"global_steps must be None or an int >= 0, got {global_steps!r}")
    return global_steps


def check_seconds(value: Any, name: str = "timeout", allow_zero: bool = False) -> float:
    """Validate a duration argument (seconds) of an engine's constructor; return it as a ``float``.

    Accepted: a real number (``int`` or ``float``, not ``bool``), finite, and ``> 0`` (``>= 0`` when
    ``allow_zero``). ``nan`` would make every deadline comparison false (a wait that never ends) and ``inf``
    overflows the libraries' timeouts, so both are refused here, where the value is given.

    Args:
        value: the argument as given.
        name: the parameter's name, for the message (e.g. ``"timeout"``, ``"poll_interval"``).
        allow_zero: accept ``0`` (e.g. "do not wait").

    Raises:
        CheckpointConfigError: anything else (a ``ValueError``); the message names the parameter, the value
            and what is accepted.
    """
    accepted = "a finite real number of seconds " + (">= 0" if allow_zero else "> 0")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise CheckpointConfigError(f"{name} must be {accepted}, got {value!r}")
    return seconds


def check_direct_threshold(direct_threshold: Any, bucket_size: int) -> int:
    """Validate a ``direct_threshold`` argument (bytes from which tensors are sent from their own memory):
    ``None`` gives the default ``bucket_size // 8``; else a non-negative ``int`` (not ``bool``; 0 packs all).

    Raises:
        CheckpointConfigError: anything else (a ``ValueError``; the message names the value).
    """
    if direct_threshold is None:
        return bucket_size // 8
    if isinstance(direct_threshold, bool) or not isinstance(direct_threshold, int) or direct_threshold < 0:
        raise CheckpointConfigError(f"direct_threshold must be None (bucket_size // 8) or an int >= 0 bytes, "
                                    f"got {direct_threshold!r}")
    return direct_threshold


async def as_async_stream(weights: Iterable[NamedTensor] | AsyncIterator[NamedTensor]) -> AsyncIterator[NamedTensor]:
    """An async iterator over ``weights`` (async or plain iterable: verl's colocated path passes a generator)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def drain(weights: Any) -> None:
    """Consume what is left of a receive stream (async or plain), discarding it, so its transport stays in
    step; a stream that raises is left as it is (it already ended)."""
    try:
        async for _ in as_async_stream(weights):
            pass
    except Exception:  # noqa: BLE001 - the update failed anyway; the caller raises the first error
        pass
