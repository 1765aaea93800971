"""The figures of a weight-sync step's row and of the whole run, from measured times, bytes and peaks."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hal.apps.weightsync.messages import Checked, Concluded, Received, Sent, Trained, rollout_row


def publish_seconds(sent: Sent, received: Sequence[Received]) -> float:
    """Seconds from when the trainer and every rollout were in the update (the latest of the send's start and
    every receive's start: launchers deliver the calls at different moments) until the last rollout applied it."""
    begun = max(sent.t0, *(r.started_at for r in received))
    return max(r.applied_at for r in received) - begun


def throughput(nbytes: int, publish_s: float) -> dict[str, Any]:
    """``{"publish_s", "bytes", "gbps"}``: ``nbytes`` published in ``publish_s`` seconds (GB/s, 10^9 bytes)."""
    return {"publish_s": publish_s, "bytes": nbytes, "gbps": nbytes / publish_s / 1e9}


def raw_figures(nbytes: int, publish_s: float, raw_s_each: Sequence[float] | None) -> dict[str, Any]:
    """The step against a raw broadcast of the same bytes: ``raw_s`` (the mean of ``raw_s_each``, seconds),
    ``raw_s_each``, ``raw_gbps`` and ``ratio_vs_raw`` (``raw_s / publish_s``: above 1, faster than raw).
    Without a raw reference (``None`` or empty): ``raw_s``, ``raw_gbps`` and ``ratio_vs_raw`` are ``None``."""
    if not raw_s_each:
        return {"raw_s": None, "raw_gbps": None, "ratio_vs_raw": None}
    raw_s = sum(raw_s_each) / len(raw_s_each)
    return {"raw_s": raw_s, "raw_s_each": list(raw_s_each), "raw_gbps": nbytes / raw_s / 1e9,
            "ratio_vs_raw": raw_s / publish_s}


def wire_figures(sent: Sent, nbytes: int) -> dict[str, Any]:
    """What the update put on the wire: ``wire_format``, ``dense_bytes`` (the published tensors' bytes),
    ``sent_bytes`` (the bytes actually sent: positions + values + specs for a delta), ``changed_fraction`` (of
    the values; ``None`` for a full update) and ``seed`` (a delta update that was a full seed; ``None`` for a
    full update), from ``sent.delta`` (``ckpt.delta.UpdateStats`` as a dict)."""
    if sent.delta is None:
        return {"wire_format": "full", "dense_bytes": nbytes, "sent_bytes": nbytes, "changed_fraction": None,
                "seed": None}
    stats = sent.delta
    total = stats["total"]
    return {"wire_format": "delta", "dense_bytes": stats["dense_bytes"], "sent_bytes": stats["sent_bytes"],
            "changed_fraction": stats["changed"] / total if total else 0.0, "seed": stats["seed"],
            "seed_reason": stats["reason"] if stats["seed"] else None}


def step_row(trained: Trained, sent: Sent, received: Sequence[Received], checked: Sequence[Checked],
             concluded: Sequence[Concluded], nbytes: int, tensors: int, tokens: list[int] | None) -> dict[str, Any]:
    """One step's row of ``--json`` (without the raw reference, which its add-on adds: :func:`raw_figures`).

    Args:
        trained: trainer rank 0's step.
        concluded: every trainer rank's end of the step; the row's ``peak_*_bytes`` and ``memory`` are the rank
            closest to (or furthest over) its bound, and with several ranks ``trainer_ranks`` lists each
            (``rank``, its peaks and bound).
        nbytes, tensors: the bytes and tensors published.
        tokens: the trainer's decode (``None``: not a preset).
    """
    publish_s = publish_seconds(sent, received)
    tightest = concluded[0] if len(concluded) == 1 else max(
        concluded, key=lambda c: c.memory["peak_bytes"] / max(1, c.memory["bound_bytes"]))
    row = {**dataclasses.asdict(trained), "send_s": sent.send_s, **throughput(nbytes, publish_s),
           "tensors": tensors, **wire_figures(sent, nbytes), **raw_figures(nbytes, publish_s, None),
           "rollouts": [rollout_row(r, c) for r, c in zip(received, checked)], **dataclasses.asdict(tightest)}
    row["memory_bound_bytes"] = tightest.memory["bound_bytes"]
    if len(concluded) > 1:
        row["trainer_ranks"] = [{"rank": rank, **dataclasses.asdict(c)} for rank, c in enumerate(concluded)]
    if tokens is not None:
        row["tokens"] = tokens
    return row


def judged_peaks(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every rank of a step's row with the bound its peak is judged by, as ``(who, memory)``: the trainer (each
    trainer rank when it is sharded; the row's own ``memory`` is then the tightest of them) and each rollout
    that reported one."""
    ranks = row.get("trainer_ranks")
    judged = ([(f"trainer rank {t['rank']}", t["memory"]) for t in ranks] if ranks
              else [("trainer", row["memory"])] if "memory" in row else [])
    return judged + [(f"rollout rank {r['rank']}", r["memory"]["judged_by"]) for r in row["rollouts"]
                     if r.get("memory")]


def memory_failures(row: dict[str, Any]) -> list[str]:
    """One sentence per rank of a step's row whose peak exceeded the bound it is judged by (empty: every
    peak within), e.g. ``"trainer: peak 19.11 GB over its bound 18.49 GB (model ... + constant)"``. A peak
    over its bound fails the step as a wrong checksum does: the bound is what the job promises."""
    return [f"{who}: peak {m['peak_bytes'] / 1e9:.2f} GB over its bound {m['bound_bytes'] / 1e9:.2f} GB ({m['form']})"
            for who, m in judged_peaks(row) if not m["within"]]


def row_ok(row: dict[str, Any]) -> bool:
    """A step's row is ok when every rollout verified it and every peak stayed within its bound."""
    return all(r["error"] is None for r in row["rollouts"]) and not memory_failures(row)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over every step: the smallest ratio to the raw broadcast (``None`` without one), and whether every
    rank's peak stayed within the bound it is judged by (``None`` where no step reported one)."""
    ratios = [row["ratio_vs_raw"] for row in rows if row.get("ratio_vs_raw") is not None]
    judged = [memory["within"] for row in rows for _, memory in judged_peaks(row)]
    return {"ratio_vs_raw_min": min(ratios) if ratios else None, "memory_within": all(judged) if judged else None}


__all__ = ["judged_peaks", "memory_failures", "publish_seconds", "raw_figures", "row_ok", "step_row", "summary",
           "throughput", "wire_figures"]
