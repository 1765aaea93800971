"""One resharded update over point-to-point transfers: the protocol both sides of every pair follow.

Per update and per (trainer rank, rollout rank) pair: the sender's *head* (its step, what it holds, the digest
of the layout it planned with, its bucket size, or why it cannot plan); the rollout's *verdict* (accept, or
why not: a step it did not ask for, a slice nobody covers, another layout); on accept, the pair's buckets
(:func:`ckpt.reshard.plan.bucket_plan`: both sides know every byte's place, so only bytes travel); then the
sender's *tail* (done, or why it stopped). A rollout yields each of its tensors once all its pieces landed.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Protocol, Sequence

import torch

from ckpt.base import ReceivePlacement
from ckpt.errors import CheckpointConfigError, TransferAbortedError, TransferError, VersionMismatchError
from ckpt.layout import byte_view
from ckpt.reshard.layout import Holding, RolloutLayout, held_parts
from ckpt.reshard.plan import PlanError, bucket_bytes, bucket_plan, check_coverage, layout_digest, pair_plan

MAGIC = 0x4D324E  # first word of a head: "M2N"
NOTE_BYTES = 4096  # a verdict or a tail: one status byte, then UTF-8 text
ACCEPT, REFUSE, DONE, ABORT = 0, 1, 0, 2


class Channel(Protocol):
    """Point-to-point transfers between the ranks of one group (tensors on ``device``).

    ``send``/``recv`` carry the small messages; a pair's buckets go through two slots per peer: the sender packs
    into ``bucket(peer, slot, nbytes)`` (or sends a tensor of its own), ``send_bucket`` hands it over;
    ``recv_bucket`` lands it in ``into`` (or a slot of the channel's) and, once waited for, ``.buffer`` holds it
    until ``release`` gives the slot back to the sender."""

    device: torch.device

    def send(self, tensor: torch.Tensor, peer: int) -> Any: ...  # a pending work for wait()

    def recv(self, tensor: torch.Tensor, peer: int) -> Any: ...

    def bucket(self, peer: int, slot: int, nbytes: int) -> torch.Tensor: ...

    def send_bucket(self, source: torch.Tensor, peer: int, slot: int) -> Any: ...

    def recv_bucket(self, into: torch.Tensor | None, peer: int, slot: int, nbytes: int) -> Any: ...

    def release(self, posted: Any, peer: int, slot: int) -> None: ...

    async def wait(self, works: list, what: str) -> None: ...  # bounded by the group's timeout


def note(code: int, text: str, device: torch.device) -> torch.Tensor:
    data = text.encode()[:NOTE_BYTES - 1]
    out = torch.zeros(NOTE_BYTES, dtype=torch.uint8)
    out[0] = code
    out[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else out[1:1]
    return out.to(device)


def read_note(tensor: torch.Tensor) -> tuple[int, str]:
    raw = bytes(tensor.cpu().numpy().tobytes())
    return raw[0], raw[1:].split(b"\0", 1)[0].decode(errors="replace")


class Posted:
    """A posted bucket receive: ``wait()`` it; ``buffer`` then holds the bytes (``direct``: the caller's ``into``)."""

    def __init__(self, work: Any, buffer: torch.Tensor, direct: bool) -> None:
        self.work, self.buffer, self.direct = work, buffer, direct

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class PairBuffers:
    """Two bucket buffers per peer, kept across updates (a channel's memory for its pairs' buckets)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, peer: int, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.slots.get((peer, slot))
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self.slots[(peer, slot)] = buf = None
            self.slots[(peer, slot)] = buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.slots.values())


def layouts_by_rank(given: Sequence[dict | None] | None, receivers: Sequence[int]) -> dict[int, RolloutLayout | None]:
    """Return each rollout rank's layout from ``build_topology``'s ``rollout_layouts`` (``None``: the whole model)."""
    given = list(given) if given else [None] * len(receivers)
    if len(given) != len(receivers):
        raise CheckpointConfigError(f"rollout_layouts has {len(given)} entries for {len(receivers)} rollout ranks")
    return {r: None if d is None else RolloutLayout.from_dict(d) for r, d in zip(receivers, given)}


async def held_or_abort(io: Channel, rank: int, layouts: dict[int, RolloutLayout | None], weights: Any,
                        step: int | None, bucket_size: int) -> list[tuple[torch.Tensor, Holding]]:
    """Return ``held_parts(weights)``; if ``weights`` raises, tell every rollout (they abort at once) and re-raise."""
    try:
        return held_parts(weights)
    except Exception as exc:  # the rollouts wait for our head
        await send_update(io, rank, layouts, [], step, bucket_size, abort=exc)
        raise


async def send_update(io: Channel, rank: int, layouts: dict[int, RolloutLayout | None],
                      parts: Sequence[tuple[torch.Tensor, Holding]], step: int | None, bucket_size: int,
                      abort: BaseException | None = None) -> None:
    """Send every rollout rank of ``layouts`` (``None``: the whole model) its pieces of ``parts``.

    Returns once every send completed (the caller may then change its tensors). ``abort``: this rank's weights
    failed; the rollouts are told (they raise :class:`TransferAbortedError` at once) and ``abort`` is raised.

    Raises:
        PlanError: this rank cannot plan a pair (the rollouts are told and refuse the update).
        TransferError: a rollout refused (its reason), or its transfer failed (after the other pairs finished).
    """
    held = [h for _, h in parts]
    pair_bucket = max(64, bucket_size // max(1, len(layouts)))
    plans, error = {}, abort
    for r, layout in layouts.items() if abort is None else ():
        try:  # a rollout without a layout keeps the whole model (no digest: its tensors are the union of ours)
            plans[r] = (pair_plan(held, layout or RolloutLayout.whole(held), rank, r),
                        layout and layout_digest(layout))
        except PlanError as exc:
            error = error or exc
    works, verdicts, heads = {}, {}, []
    for r in layouts:
        meta = json.dumps({"step": step, "held": [h.to_list() for h in held], "pair_bucket": pair_bucket,
                           "digest": plans[r][1] if r in plans else None,
                           "error": None if error is None else str(error),
                           "abort": abort is not None and f"{type(abort).__name__}: {abort}"}).encode()
        head = torch.tensor([MAGIC, len(meta)], dtype=torch.int64, device=io.device)
        body = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(io.device)
        heads += [head, body]
        verdicts[r] = torch.zeros(NOTE_BYTES, dtype=torch.uint8, device=io.device)
        works[r] = [io.send(head, r), io.send(body, r), io.recv(verdicts[r], r)]
    failed: dict[int, BaseException] = {}
    for r, pending in works.items():
        try:
            await io.wait(pending, f"plan exchange of step {step} with rollout rank {r}")
        except TransferError as exc:
            failed[r] = exc
    if error is not None:
        raise error
    refused = {r: text for r, (code, text) in ((r, read_note(v)) for r, v in verdicts.items())
               if code != ACCEPT and r not in failed}
    pairs = {r: bucket_plan(plans[r][0], pair_bucket) for r in layouts if r not in refused and r not in failed}
    in_flight: dict[tuple[int, int], tuple[list, Any]] = {}

    async def settle(r: int, slot: int) -> None:
        works, _ = in_flight.pop((r, slot), ([], None))
        if works and r not in failed:
            try:
                await io.wait(works, f"bucket send of step {step} to rollout rank {r}")
            except TransferError as exc:
                failed[r] = exc

    for k in range(max((len(b) for b in pairs.values()), default=0)):
        for r, buckets in pairs.items():
            if k >= len(buckets) or r in failed:
                continue
            await settle(r, k % 2)
            if r in failed:
                continue
            bucket = buckets[k]
            source = _direct(bucket, lambda p: parts[p.index][0][p.source.index()])
            if source is None:
                source = io.bucket(r, k % 2, pair_bucket)
                for item in bucket:
                    p = item.piece
                    byte_view(source, item.offset, p.dtype, p.region.sizes).copy_(parts[p.index][0][p.source.index()])
                source = source[:bucket_bytes(bucket)]
            in_flight[(r, k % 2)] = ([io.send_bucket(source, r, k % 2)], source)
    for r, slot in list(in_flight):
        await settle(r, slot)
    tails = [(r, note(DONE, "", io.device)) for r in pairs if r not in failed]
    try:
        await io.wait([io.send(t, r) for r, t in tails], f"end of step {step} on trainer rank {rank}")
    except TransferError as exc:
        failed.setdefault(-1, exc)
    if refused:
        r = min(refused)
        raise TransferError(f"rollout rank {r} refused step {step}: {refused[r]}")
    if failed:
        r = min(failed)
        raise failed[r] if r < 0 else TransferError(f"sending step {step} to rollout rank {r} failed: {failed[r]}")


def _direct(bucket: Sequence[Any], view: Any) -> torch.Tensor | None:
    """The one contiguous tensor a bucket of a single piece can be sent from or received into, else ``None``."""
    if len(bucket) != 1:
        return None
    t = view(bucket[0].piece)
    return flat(t) if isinstance(t, torch.Tensor) and t.is_contiguous() else None


async def receive_update(io: Channel, rank: int, senders: Sequence[int], layout: RolloutLayout | None,
                         asked: int | None, placement: ReceivePlacement | None, on_step: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Receive this rollout rank's pieces from every sender; yield ``(target, tensor)`` as each completes.

    A yielded tensor is the placement's (``placement.target(name, dtype, shape)``, where it is contiguous on
    ``io.device``) or an engine-owned one, dropped once the consumer asks for the next. ``on_step(step)`` is
    called with the agreed step before the first yield.

    Raises:
        VersionMismatchError, PlanError: refused before any byte of the update moved (the senders are told).
        TransferAbortedError, TransferError: a sender stopped or failed; what arrived is not a whole update.
    """
    heads = {s: torch.zeros(2, dtype=torch.int64, device=io.device) for s in senders}
    await io.wait([io.recv(heads[s], s) for s in senders], f"plan exchange on rollout rank {rank}")
    bodies = {}
    for s, head in heads.items():
        magic, size = (int(v) for v in head.cpu())
        if magic != MAGIC:
            raise TransferError(f"rollout rank {rank} got no resharding head from trainer rank {s} (word {magic:#x})")
        bodies[s] = torch.zeros(size, dtype=torch.uint8, device=io.device)
    await io.wait([io.recv(b, s) for s, b in bodies.items()], f"plan exchange on rollout rank {rank}")
    metas = {s: json.loads(bytes(b.cpu().numpy().tobytes())) for s, b in bodies.items()}
    held = {s: [Holding.from_list(v) for v in m["held"]] for s, m in metas.items()}
    refusal: Exception | None = None
    try:
        aborted = next((s for s, m in metas.items() if m.get("abort")), None)
        if aborted is not None:
            raise TransferAbortedError(f"trainer rank {aborted} stopped step {metas[aborted]['step']} before "
                                       f"sending (rollout rank {rank} keeps nothing of it): {metas[aborted]['abort']}")
        refusal_from = next((s for s, m in metas.items() if m["error"]), None)
        if refusal_from is not None:
            raise PlanError(f"trainer rank {refusal_from} cannot plan: {metas[refusal_from]['error']}")
        steps = {m["step"] for m in metas.values()}
        if len(steps) > 1:
            by = ", ".join(f"trainer rank {s}: step {m['step']}" for s, m in metas.items())
            raise VersionMismatchError(asked, sorted(steps, key=str)[0], f"rollout rank {rank} (the senders disagree: {by})")
        step = steps.pop()
        if asked is not None and step != asked:
            raise VersionMismatchError(asked, step, f"resharded receive on rollout rank {rank}")
        declared = layout is not None
        if not declared:
            union: dict[str, Holding] = {}
            for hs in held.values():
                for h in hs:
                    union.setdefault(h.name, h)
            layout = RolloutLayout.whole(union.values())
        digest = layout_digest(layout) if declared else None
        plans = {s: pair_plan(held[s], layout, s, rank) for s in senders}
        for s, m in metas.items():
            if m["digest"] != digest:
                raise PlanError(f"trainer rank {s} planned rollout rank {rank} from another layout than the one it "
                                "keeps (the rollout changed its layout without a new topology)")
        check_coverage(layout, plans, held, rank)
    except (PlanError, VersionMismatchError, TransferAbortedError) as exc:
        refusal = exc
    verdict = note(ACCEPT, "", io.device) if refusal is None else note(REFUSE, f"{type(refusal).__name__}: {refusal}",
                                                                        io.device)
    await io.wait([io.send(verdict, s) for s in senders], f"plan verdict on rollout rank {rank}")
    if refusal is not None:
        raise refusal
    if on_step is not None:
        on_step(step)
    stream = _receive_data(io, rank, senders, layout, plans, metas, placement, step)
    try:
        async for item in stream:
            yield item
    finally:  # an early aclose() reaches the inner stream now, which drains the rest (not the garbage collector)
        await stream.aclose()


async def _receive_data(io: Channel, rank: int, senders: Sequence[int], layout: RolloutLayout,
                        plans: dict[int, list], metas: dict[int, dict], placement: ReceivePlacement | None,
                        step: int | None) -> AsyncIterator[tuple[str, torch.Tensor]]:
    targets: dict[str, torch.Tensor] = {}
    left = {t: torch.Size(shape).numel() for t, (shape, _) in layout.targets.items()}

    def target(name: str) -> torch.Tensor:
        if name not in targets:
            shape, dtype = layout.targets[name]
            dest = placement.target(name, dtype, torch.Size(shape)) if placement is not None else None
            if not (isinstance(dest, torch.Tensor) and dest.dtype == dtype and tuple(dest.shape) == tuple(shape)
                    and dest.device == io.device):
                dest = torch.empty(shape, dtype=dtype, device=io.device)
            targets[name] = dest
        return targets[name]

    buckets = {s: bucket_plan(plans[s], metas[s]["pair_bucket"]) for s in senders}
    posted: dict[tuple[int, int], Any] = {}
    failed: dict[int, BaseException] = {}
    discard = False

    def post(s: int, k: int) -> None:
        if k >= len(buckets[s]) or s in failed:
            return
        bucket = buckets[s][k]
        into = None if discard else _direct(bucket, lambda p: target(p.target)[p.dest.index()])
        posted[(s, k)] = io.recv_bucket(into, s, k % 2, bucket_bytes(bucket))

    for s in senders:
        post(s, 0)
        post(s, 1)
    try:
        for name in [t for t, n in left.items() if n == 0]:  # empty tensors: complete with no piece
            yield name, target(name)
            targets.pop(name)
        for k in range(max((len(b) for b in buckets.values()), default=0)):
            for s in senders:
                if (s, k) not in posted:
                    continue
                work = posted.pop((s, k))
                try:
                    await io.wait([work], f"bucket {k} of step {step} from trainer rank {s}")
                except TransferError as exc:
                    failed[s] = exc
                    continue
                done = []
                buf = work.buffer
                for item in buckets[s][k]:
                    p = item.piece
                    if not work.direct and not discard:
                        target(p.target)[p.dest.index()].copy_(byte_view(buf, item.offset, p.dtype, p.region.sizes))
                    left[p.target] -= p.region.numel
                    if left[p.target] == 0:
                        done.append(p.target)
                io.release(work, s, k % 2)
                post(s, k + 2)
                for name in done:
                    if not discard and not failed:
                        yield name, target(name)
                    targets.pop(name, None)
        tails = {s: torch.zeros(NOTE_BYTES, dtype=torch.uint8, device=io.device) for s in senders if s not in failed}
        if tails:
            await io.wait([io.recv(t, s) for s, t in tails.items()], f"end of step {step} on rollout rank {rank}")
    except GeneratorExit:
        discard = True  # the consumer stopped early: the rest is received and dropped below (the group stays in step)
        raise
    finally:
        if discard:
            await _drain(io, posted, buckets, failed, post, senders, metas)
    if failed:
        s = min(failed)
        raise TransferError(f"rollout rank {rank} lost trainer rank {s} in step {step}: {failed[s]}")
    for s, t in tails.items():
        code, text = read_note(t)
        if code != DONE:
            raise TransferAbortedError(f"trainer rank {s} stopped step {step}: {text}")
    incomplete = [t for t, n in left.items() if n]
    if incomplete:
        raise TransferError(f"step {step} ended without {len(incomplete)} of rollout rank {rank}'s tensors "
                            f"({incomplete[0]}, ...)")


async def _drain(io: Channel, posted: dict, buckets: dict, failed: dict, post: Any, senders: Sequence[int],
                 metas: dict) -> None:
    """Receive and drop the rest of an update whose consumer stopped early."""
    for k in range(max((len(b) for b in buckets.values()), default=0)):
        for s in senders:
            if (s, k) in posted and s not in failed:
                work = posted.pop((s, k))
                try:
                    await io.wait([work], "drain")
                except TransferError as exc:
                    failed[s] = exc
                    continue
                io.release(work, s, k % 2)
                post(s, k + 2)
    tails = [torch.zeros(NOTE_BYTES, dtype=torch.uint8, device=io.device) for s in senders if s not in failed]
    alive = [s for s in senders if s not in failed]
    if alive:
        try:
            await io.wait([io.recv(t, s) for s, t in zip(alive, tails)], "drain")
        except TransferError:
            pass


__all__ = ["Channel", "PairBuffers", "Posted", "held_or_abort", "layouts_by_rank", "receive_update", "send_update"]
