"""A contract test suite any checkpoint engine can be run through, third-party ones included.

Give it an async *pair factory* returning ``(sender, receiver)`` engines that can talk to each other in this
process (the same instance for a colocated engine) and run every check::

    failures = asyncio.run(run_contract_suite(make_pair))   # [] when the engine keeps the contract

or parametrize a pytest test over :data:`CONTRACT_CHECKS` (see ``tests/ckpt/test_contract.py``). Each check
raises :class:`ContractFailure` (an ``AssertionError``) or :class:`ContractError` (a ``TypeError``: a method
is not async) saying what differed. The checks judge behaviour, so decorated methods pass and verl 0.9.1's
plain ``def send_weights`` fails."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from typing import Any, Awaitable, Callable

import torch

from ckpt.base import CheckpointEngine, callable_kind, check_async_contract, unwrap_method
from ckpt.errors import (CheckpointConfigError, CheckpointEngineError, ContractError, SendInProgressError,
                         VersionMismatchError)

PairFactory = Callable[[], Awaitable[tuple[CheckpointEngine, CheckpointEngine]]]


class ContractFailure(CheckpointEngineError, AssertionError):
    """An engine broke a behavioural clause of the contract (wrong step, bytes, order, dtype, shape)."""


def sample_weights(step: int = 0, big_numel: int = 80_000) -> list[tuple[str, torch.Tensor]]:
    """Return named host tensors covering the contract's cases, with values depending on ``step``.

    fp32 / bf16 / fp16 / int64 / bool, empty, 0-d, non-contiguous, and two larger than the suites' small buckets."""
    g = torch.Generator().manual_seed(1234 + step)
    base = torch.randn(6, 8, generator=g)
    return [
        ("fp32.weight", torch.randn(3, 5, generator=g)),
        ("bf16.weight", torch.randn(7, 4, generator=g).to(torch.bfloat16)),
        ("fp16.bias", torch.randn(11, generator=g).to(torch.float16)),
        ("int64.ids", torch.randint(-2**40, 2**40, (5,), generator=g, dtype=torch.int64)),
        ("bool.mask", torch.rand(9, generator=g) > 0.5),
        ("empty", torch.empty(0, 3)),
        ("scalar.fp32", torch.tensor(float(step) + 0.5)),
        ("scalar.bool", torch.tensor(step % 2 == 0)),
        ("noncontig.transpose", base.t()),
        ("noncontig.strided", torch.randn(20, generator=g).to(torch.bfloat16)[::3]),
        ("big.fp32", torch.randn(big_numel, generator=g)),
        ("big.noncontig", torch.randn(300, 100, generator=g).t()),
        ("tail.fp16", torch.randn(2, 2, generator=g).to(torch.float16)),
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether ``a`` and ``b`` have the same dtype, shape and bytes (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def compare(expected: list[tuple[str, torch.Tensor]], received: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise :class:`ContractFailure` unless ``received`` matches ``expected`` in names, order, dtypes, shapes, bytes."""
    names_e, names_r = [n for n, _ in expected], [n for n, _ in received]
    if names_e != names_r:
        raise ContractFailure(f"{what}: names/order differ: sent {names_e}, received {names_r}")
    for (name, a), (_, b) in zip(expected, received):
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            raise ContractFailure(f"{what}: tensor {name!r} sent {a.dtype} {tuple(a.shape)}, "
                                  f"received {b.dtype} {tuple(b.shape)}")
        if not same_bytes(a, b):
            raise ContractFailure(f"{what}: tensor {name!r} ({a.dtype} {tuple(a.shape)}) bytes differ")


async def collect(stream: Any) -> list[tuple[str, torch.Tensor]]:
    """Consume a receive stream, copying each tensor to the host as it arrives."""
    if not (hasattr(stream, "__aiter__") and hasattr(stream, "__anext__")):
        raise ContractError(f"receive_weights returned {type(stream).__name__}, not an async iterator")
    return [(name, t.detach().to("cpu", copy=True)) async for name, t in stream]


def _describe(engine: Any, name: str) -> str:
    fn = getattr(type(engine), name, None) or getattr(engine, name, None)
    return callable_kind(unwrap_method(fn)) if fn is not None else "missing"


def _not_awaitable(engine: Any, result: Any) -> ContractError:
    return ContractError(
        f"{type(engine).__name__}.send_weights(...) returned {type(result).__name__}, not an awaitable: it is "
        f"{_describe(engine, 'send_weights')}, so `await engine.send_weights(...)` raises TypeError; "
        "declare it 'async def'")


def _not_async_iter(engine: Any, result: Any) -> ContractError:
    hint = ("; a coroutine cannot be iterated with 'async for' (verl's CheckpointEngineWorker hands the call's "
            "result straight to the server adapter): make it an async generator ('async def' with 'yield')"
            if inspect.isawaitable(result) else "; make it an async generator ('async def' with 'yield')")
    return ContractError(f"{type(engine).__name__}.receive_weights(...) returned {type(result).__name__}, not an "
                         f"async iterator: it is {_describe(engine, 'receive_weights')}{hint}")


def _close_unstarted(*calls: Any) -> None:
    for call in calls:
        if inspect.iscoroutine(call):
            call.close()  # never started; closing avoids a "never awaited" warning
        elif inspect.isasyncgen(call):
            try:
                call.aclose().close()
            except Exception:  # noqa: BLE001 - nothing was started, nothing to clean
                pass


async def transfer(sender: CheckpointEngine, receiver: CheckpointEngine, weights: list[tuple[str, torch.Tensor]],
                   send_step: int | None, receive_step: int | None,
                   after_send: Callable[[], None] | None = None,
                   receive_kwargs: dict[str, Any] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Run one send and one receive concurrently; return what was received (host copies).

    ``after_send`` runs the moment ``await send_weights(...)`` returns. Raises the receiver's error first."""
    send = sender.send_weights(iter(weights), send_step)
    if not inspect.isawaitable(send):
        raise _not_awaitable(sender, send)
    try:
        stream = receiver.receive_weights(receive_step, **(receive_kwargs or {}))
    except BaseException:
        _close_unstarted(send)
        raise
    if not (hasattr(stream, "__aiter__") and hasattr(stream, "__anext__")):
        _close_unstarted(send, stream)
        raise _not_async_iter(receiver, stream)
    async def send_then():
        await send
        if after_send is not None:
            after_send()

    got_send, got_recv = await asyncio.gather(send_then(), collect(stream), return_exceptions=True)
    for result in (got_recv, got_send):
        if isinstance(result, BaseException):
            raise result
    return got_recv


def _call_sync(engine: Any, name: str, **kwargs: Any) -> Any:
    """Call a lifecycle method synchronously, as verl does; an awaitable result is a violation."""
    result = getattr(engine, name)(**kwargs)
    if inspect.isawaitable(result):
        _close_unstarted(result)
        raise ContractError(f"{type(engine).__name__}.{name}() returned {type(result).__name__}: verl calls it "
                            "synchronously and never awaits it, so it must be a plain 'def'")
    return result


async def verl_lifecycle(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Run one update's set-up as verl's manager does, for 1 trainer and 1 rollout."""
    metadata = [_call_sync(sender, "prepare"), _call_sync(receiver, "prepare")]
    topology = type(sender).build_topology(1, 1, metadata)
    if inspect.isawaitable(topology):
        _close_unstarted(topology)
        raise ContractError(f"{type(sender).__name__}.build_topology(...) returned {type(topology).__name__}; "
                            "verl calls it synchronously on the class")
    if not (isinstance(topology, tuple) and len(topology) == 2 and all(isinstance(d, dict) for d in topology)
            and all(isinstance(v, list) and len(v) == 1 for d in topology for v in d.values())):
        raise ContractError(f"{type(sender).__name__}.build_topology(1, 1, metadata) must return (trainer_kwargs, "
                            f"rollout_kwargs), dicts of one-entry lists, got {topology!r}")
    kwargs = [{k: v[0] for k, v in side.items()} for side in topology]
    await asyncio.gather(*(asyncio.to_thread(_call_sync, engine, "init_process_group", **kw)
                           for engine, kw in zip((sender, receiver), kwargs)))


async def finalize_both(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Call ``finalize()`` on each distinct engine, as verl does at the end of an update."""
    for engine in {id(sender): sender, id(receiver): receiver}.values():
        _call_sync(engine, "finalize")


def _check_step(receiver: CheckpointEngine, step: int | None, what: str) -> None:
    got = getattr(receiver, "received_global_steps", "missing")
    if got != step:
        raise ContractFailure(f"{what}: receiver.received_global_steps is {got!r}, the sender sent {step!r}")


async def check_call_contract(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Nothing declared wrong, ``send_weights(...)`` awaitable, ``receive_weights(...)`` async, byte-exact."""
    for engine in {id(sender): sender, id(receiver): receiver}.values():
        check_async_contract(engine)
    weights = sample_weights(1)
    compare(weights, await transfer(sender, receiver, weights, 1, 1), "async round trip")


async def check_verl_lifecycle(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Three updates run as verl's manager runs them, byte-exact with the sender's step."""
    for step in (1, 2, 3):
        await verl_lifecycle(sender, receiver)
        weights = sample_weights(step)
        compare(weights, await transfer(sender, receiver, weights, step, step), f"verl lifecycle, update {step}")
        _check_step(receiver, step, f"verl lifecycle, update {step}")
        await finalize_both(sender, receiver)


async def check_round_trip_mixed_dtypes(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Mixed dtypes, empty, 0-d, non-contiguous, larger-than-bucket: byte-exact, in order."""
    weights = sample_weights(3)
    compare(weights, await transfer(sender, receiver, weights, 3, 3), "mixed dtypes")
    _check_step(receiver, 3, "mixed dtypes")


async def check_steps_in_sequence(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Steps 1, 2, 3 in a row; receiving with ``global_steps=None`` still reports the sender's step."""
    for step in (1, 2, 3):
        weights = sample_weights(step)
        asked = None if step == 2 else step
        compare(weights, await transfer(sender, receiver, weights, step, asked), f"step {step}")
        _check_step(receiver, step, f"step {step}")


async def check_version_mismatch(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Asking for step 4 while step 5 is sent raises VersionMismatchError naming both; step 6 then works."""
    try:
        await transfer(sender, receiver, sample_weights(5), 5, 4)
    except VersionMismatchError as exc:
        if "4" not in str(exc) or "5" not in str(exc):
            raise ContractFailure(f"the version error does not name both steps: {exc}") from exc
    else:
        raise ContractFailure("asking for global_steps=4 while 5 was sent raised nothing")
    weights = sample_weights(6)
    compare(weights, await transfer(sender, receiver, weights, 6, 6), "update after a version mismatch")
    _check_step(receiver, 6, "update after a version mismatch")


async def check_weights_pair_refused(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """``send_weights((weights, None), 3)`` raises :class:`CheckpointConfigError`; the receiver does not hang."""
    weights = sample_weights(3)
    send = sender.send_weights((iter(weights), None), 3)
    stream = receiver.receive_weights(3)
    got_send, got_recv = await asyncio.gather(send, collect(stream), return_exceptions=True)
    if not isinstance(got_send, CheckpointConfigError):
        raise ContractFailure(f"send_weights((weights, peft_config), 3) gave {got_send!r}, not a "
                              "CheckpointConfigError")
    if isinstance(got_recv, list) and got_recv:
        raise ContractFailure(f"the receiver got {[n for n, _ in got_recv]} from a refused update")
    weights = sample_weights(4)
    compare(weights, await transfer(sender, receiver, weights, 4, 4), "update after a refused weights pair")
    _check_step(receiver, 4, "update after a refused weights pair")


def overwrite_in_place(weights: list[tuple[str, torch.Tensor]]) -> None:
    """Change every value of ``weights`` in place, as a trainer's next optimizer step does."""
    with torch.no_grad():
        for _, t in weights:
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)


async def check_sender_may_reuse(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """Tensors changed in place once ``await send_weights`` returns still arrive as sent."""
    weights = sample_weights(4)
    sent = [(name, t.clone()) for name, t in weights]
    got = await transfer(sender, receiver, weights, 4, 4, after_send=lambda: overwrite_in_place(weights))
    if not same_bytes(weights[0][1], sent[0][1] + 1):
        raise ContractFailure("the check did not change the sent tensors")  # guards the check itself
    try:
        compare(sent, got, "tensors changed by the sender after send_weights returned")
    except ContractFailure as exc:
        raise ContractFailure(f"{exc}: send_weights returned before the receiver had the sent values (the "
                              "sender may reuse or free its tensors only once it returns)") from None
    _check_step(receiver, 4, "sender reuse")


async def check_empty_update(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """An update with no tensors still carries its step."""
    got = await transfer(sender, receiver, [], 9, 9)
    if got:
        raise ContractFailure(f"an empty update yielded {[n for n, _ in got]}")
    _check_step(receiver, 9, "empty update")


async def check_placement_keyword(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """``receive_weights(global_steps, placement=None)`` is accepted and the update arrives byte-exact."""
    weights = sample_weights(7)
    try:
        got = await transfer(sender, receiver, weights, 7, 7, receive_kwargs={"placement": None})
    except TypeError as exc:
        if "placement" not in str(exc):
            raise
        raise ContractFailure(f"{type(receiver).__name__}.receive_weights does not take the keyword "
                              f"'placement' ({exc}); accept placement=None (and ignore a placement it cannot "
                              "use)") from None
    compare(weights, got, "receive_weights(..., placement=None)")
    _check_step(receiver, 7, "placement keyword")


def _send_from_another_thread(sender: CheckpointEngine, step: int, wait_s: float = 10.0) -> Any:
    """Run ``sender.send_weights`` of ``step`` in a new thread and event loop; return what it raised, ``None`` if it
    returned, or ``"still running"`` after ``wait_s`` seconds."""
    out: list[Any] = []

    def run() -> None:
        try:
            asyncio.run(sender.send_weights(iter(sample_weights(step)), step))
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - the check reads it
            out.append(exc)
    thread = threading.Thread(target=run, name=f"send_weights-{step}", daemon=True)
    thread.start()
    thread.join(wait_s)
    return out[0] if out else "still running"


async def check_one_send_at_a_time(sender: CheckpointEngine, receiver: CheckpointEngine) -> None:
    """A ``send_weights`` while another runs raises :class:`SendInProgressError` naming the running step; the running
    update arrives byte-exact and the next one works."""
    weights, second = sample_weights(5), []

    def first() -> Any:
        for i, item in enumerate(weights):
            if i == 1:  # the first call is consuming its weights: it runs
                second.append(_send_from_another_thread(sender, 6))
            yield item
    got = await transfer(sender, receiver, first(), 5, 5)  # type: ignore[arg-type]
    refused = second[0] if second else "never tried"
    if not isinstance(refused, SendInProgressError) or "global_steps=5" not in str(refused):
        raise ContractFailure(f"send_weights(global_steps=6) while global_steps=5 was being sent gave {refused!r}, "
                              "not a SendInProgressError naming global_steps=5")
    compare(weights, got, "the update running while a second send_weights was refused")
    _check_step(receiver, 5, "one send at a time")
    weights = sample_weights(7)
    compare(weights, await transfer(sender, receiver, weights, 7, 7), "the update after a refused send_weights")


# Every check by name: async check(sender, receiver) -> None, raising on a violation.
CONTRACT_CHECKS: dict[str, Callable[[CheckpointEngine, CheckpointEngine], Awaitable[None]]] = {
    "call_contract": check_call_contract,
    "verl_lifecycle": check_verl_lifecycle,
    "round_trip_mixed_dtypes": check_round_trip_mixed_dtypes,
    "steps_in_sequence": check_steps_in_sequence,
    "version_mismatch": check_version_mismatch,
    "empty_update": check_empty_update,
    "sender_may_reuse": check_sender_may_reuse,
    "placement_keyword": check_placement_keyword,
    "weights_pair_refused": check_weights_pair_refused,
    "one_send_at_a_time": check_one_send_at_a_time,
}


async def run_check(make_pair: PairFactory, name: str, timeout: float = 60.0) -> None:
    """Run one check of :data:`CONTRACT_CHECKS` on a fresh pair, then finalize and close both engines."""
    sender, receiver = await make_pair()
    try:
        await asyncio.wait_for(CONTRACT_CHECKS[name](sender, receiver), timeout)
    finally:
        for engine in {id(sender): sender, id(receiver): receiver}.values():
            for method in ("finalize", "close"):
                fn = getattr(engine, method, None)
                try:
                    result = fn() if callable(fn) else None
                    if inspect.isawaitable(result):
                        await result
                except Exception:  # noqa: BLE001 - clean-up of an engine under test must not hide its failure
                    pass


async def run_contract_suite(make_pair: PairFactory, timeout: float = 60.0) -> dict[str, str]:
    """Run every check, each on a fresh pair; return ``{check name: failure text}`` (empty: all passed)."""
    failures = {}
    for name in CONTRACT_CHECKS:
        try:
            await run_check(make_pair, name, timeout)
        except Exception as exc:  # noqa: BLE001 - collected and reported per check
            failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


def standalone_engine(name: str | type, rank: int, world_size: int, store: Any, key: str = "engine",
                      master_addr: str = "127.0.0.1", **kwargs: Any) -> CheckpointEngine:
    """Make engine ``name`` for standalone use by ranks that meet on ``store`` (under ``key``, new per group).

    Rank 0's ``prepare()`` hosts the rendezvous on a free port, given to the others through ``store``; the engine
    is returned ready for its first send or receive."""
    from ckpt.registry import get_checkpoint_engine

    make = functools.partial(get_checkpoint_engine, name) if isinstance(name, str) else name
    if rank == 0:
        engine = make(rank=0, world_size=world_size, master_addr=master_addr, **kwargs)
        store.set(f"{key}/master_port", str(engine.prepare()["master_port"]))
        return engine
    return make(rank=rank, world_size=world_size, master_addr=master_addr,
                master_port=int(store.get(f"{key}/master_port")), **kwargs)


def standalone_pair(name: str | type, devices: tuple[str | None, str | None] = (None, None),
                    **kwargs: Any) -> tuple[CheckpointEngine, CheckpointEngine]:
    """Return ranks 0 and 1 of one standalone group of engine ``name`` in this process, on ``devices``."""
    import torch.distributed as dist

    store = dist.HashStore()
    return tuple(standalone_engine(name, rank, 2, store, **{**kwargs, **({"device": d} if d else {})})
                 for rank, d in enumerate(devices))
