"""Delta flushes over any hal checkpoint engine that carries named tensors (collective, file, p2p, ...).

A flush is three named tensors to an engine: :func:`wire_tensors` names flush ``k``'s ``__delta_flush__/<k>/<key>``
and :func:`receive_delta_flushes` groups them back into verl's ``(named_tensors, is_last)`` flushes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

from ckpt.delta.errors import DeltaChecksumError, DeltaRefusedError
from ckpt.delta.receiver import DeltaReceiver
from ckpt.delta.sender import DeltaSender, Flush, UpdateStats
from ckpt.delta.wire import SPEC, VALUES, decode_spec, split_wire_name, wire_name


def wire_tensors(flushes: Iterable[Flush]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten flushes into ``(wire name, tensor)`` pairs: each flush's spec, positions (if any), values."""
    for index, (named, _is_last) in enumerate(flushes):
        for key, tensor in named:
            yield wire_name(index, key), tensor


async def delta_send(engine: Any, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None,
                     sender: DeltaSender, check: Any = None) -> UpdateStats:
    """Publish ``weights`` through ``engine`` as a delta against ``sender``'s snapshot (a seed when due).

    Commits the snapshot when ``engine.send_weights`` returns, abandons it (next update: a seed) when anything
    raises (a rollout's refusal included). ``check``: a :class:`ckpt.checker.Digester` of ``weights`` for ``engine``'s
    weight check. Returns the update's :class:`UpdateStats`.
    """
    extra = {} if check is None else {"check": check}
    try:
        await engine.send_weights(wire_tensors(sender.flushes(weights, global_steps)), global_steps=global_steps,
                                  **extra)
    except BaseException as exc:
        sender.abandon(f"{type(exc).__name__}: {exc}")
        raise
    return sender.commit()


async def receive_delta_flushes(engine: Any, global_steps: int | None = None, *, own_values: bool = True,
                                **receive_kwargs: Any) -> AsyncIterator[Flush]:
    """Group ``engine.receive_weights(...)`` into ``(named_tensors, is_last)`` flushes with verl's names.

    Each flush's tensors are the consumer's copies (memory: one flush); with ``own_values=False`` its
    ``__values__`` is the engine's item, valid only until the next flush. DeltaChecksumError for a foreign
    name or a stream that ends before ``is_last``.
    """
    stream = engine.receive_weights(global_steps, **receive_kwargs)
    current: list[tuple[str, torch.Tensor]] = []
    index = None
    try:
        async for name, tensor in stream:
            try:
                flush, key = split_wire_name(name)
            except ValueError as exc:
                raise DeltaChecksumError(str(exc)) from exc
            if index is not None and flush != index:
                raise DeltaChecksumError(f"flush {index} ended without {VALUES}; got {name!r}")
            index = flush
            current.append((key, tensor if key == VALUES and not own_values else tensor.clone()))
            if key == VALUES:
                named, current, index = current, [], None
                spec = dict(named).get(SPEC)
                try:
                    is_last = bool(decode_spec(spec).get("hal", {}).get("is_last")) if spec is not None else False
                except ValueError:
                    is_last = False  # a corrupted spec: the consumer refuses it; the stream decides the end
                yield named, is_last
                if is_last:
                    return
        if current or index is not None:
            raise DeltaChecksumError(f"the update ended inside flush {index}")
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def receive_delta(engine: Any, receiver: DeltaReceiver, global_steps: int | None = None,
                        **receive_kwargs: Any) -> int | None:
    """Receive one update from ``engine``, apply it with ``receiver`` and return the step now served.

    On a refusal the rest is still received and discarded (the transport stays in step) before the refusal is
    raised; on a transport error the receiver's update is aborted.
    """
    refused: DeltaRefusedError | None = None
    served = None
    try:
        async for named, is_last in receive_delta_flushes(engine, global_steps, own_values=receiver.atomic,
                                                          **receive_kwargs):
            if refused is not None:
                continue
            try:
                served = receiver.apply_flush(named, is_last=is_last)
            except DeltaRefusedError as exc:
                refused = exc
    except BaseException as exc:
        receiver.abort(f"{type(exc).__name__}: {exc}")
        raise
    if refused is not None:
        raise refused
    return served
