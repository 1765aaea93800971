"""Delta flushes over any hal checkpoint engine that carries named tensors (collective, file, p2p, ...).

The engines need no change: a flush is three named tensors to them. :func:`wire_tensors` names flush
``k``'s tensors ``__delta_flush__/<k>/<key>`` (unique in an update, as the file engine needs);
:func:`receive_delta_flushes` groups an engine's ``receive_weights`` stream back into verl's
``(named_tensors, is_last)`` flushes, with verl's names, for verl's rollout adapters
(``update_weights(..., wire_format="delta_flush")``) or :func:`receive_delta` / :class:`DeltaReceiver`.
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
    """Flatten ``(named_tensors, is_last)`` flushes into ``(wire name, tensor)`` pairs, in order: each flush's
    ``__delta_spec__``, ``__positions__`` (if any), ``__values__``."""
    for index, (named, _is_last) in enumerate(flushes):
        for key, tensor in named:
            yield wire_name(index, key), tensor


async def delta_send(engine: Any, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None,
                     sender: DeltaSender) -> UpdateStats:
    """Publish ``weights`` through ``engine`` as a delta against ``sender``'s snapshot (a seed when due).

    Calls ``await engine.send_weights(<wire tensors>, global_steps=global_steps)``; commits the sender's
    snapshot when it returns, abandons it (next update: a seed) when it raises.

    Returns:
        the update's :class:`UpdateStats` (bytes dense and sent, changed fraction, seed or not).

    Raises:
        whatever ``engine.send_weights`` or the diff raises (the snapshot is then abandoned).
    """
    try:
        await engine.send_weights(wire_tensors(sender.flushes(weights, global_steps)), global_steps=global_steps)
    except BaseException as exc:
        sender.abandon(f"{type(exc).__name__}: {exc}")
        raise
    return sender.commit()


async def receive_delta_flushes(engine: Any, global_steps: int | None = None, *, own_values: bool = True,
                                **receive_kwargs: Any) -> AsyncIterator[Flush]:
    """Group ``engine.receive_weights(global_steps, **receive_kwargs)`` back into ``(named_tensors, is_last)``
    flushes with verl's names (``__delta_spec__``, ``__positions__``, ``__values__``).

    Each flush's tensors are copies owned by the consumer (engines may yield views of their buffers, valid
    only until the next item): memory is one flush. With ``own_values=False`` a flush's ``__values__`` (its
    last tensor) is the engine's own item, valid only until the next flush is asked for: for a consumer
    that applies each flush at once (an in-place :class:`DeltaReceiver`), saving a copy of every value.
    Stops after the flush whose spec says ``is_last``.

    Raises:
        DeltaChecksumError: a tensor name of another format, or the stream ends before ``is_last``.
        whatever the engine raises (version mismatch, transfer errors).
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
    """Receive one update from ``engine`` and apply it with ``receiver``; return the step now served.

    On a refusal the rest of the update is still received (and discarded), so the transport stays in step,
    then the refusal is raised; on a transport error the receiver's update is aborted.

    Raises:
        DeltaRefusedError (and its subclasses): the update was refused (see :class:`DeltaReceiver`).
        whatever the engine raises.
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
