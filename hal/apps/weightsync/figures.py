"""The figures of a weight-sync step's row and of the whole run, from measured times, bytes and peaks."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hal.apps.weightsync.messages import Checked, Concluded, Received, Sent, Trained, rollout_row


def publish_seconds(sent: Sent, received: Sequence[Received]) -> float:
    """Seconds from when the trainer and every rollout were in the update until the last rollout applied it."""
    begun = max(sent.t0, *(r.started_at for r in received))
    return max(r.applied_at for r in received) - begun


def throughput(nbytes: int, publish_s: float) -> dict[str, Any]:
    """``{"publish_s", "bytes", "gbps"}``: ``nbytes`` published in ``publish_s`` seconds (GB/s, 10^9 bytes)."""
    return {"publish_s": publish_s, "bytes": nbytes, "gbps": nbytes / publish_s / 1e9}


def raw_figures(nbytes: int, publish_s: float, raw_s_each: Sequence[float] | None) -> dict[str, Any]:
    """The step against a raw broadcast of the same bytes: ``raw_s`` (the mean), ``raw_s_each``, ``raw_gbps``,
    ``ratio_vs_raw`` (above 1: faster than raw); ``None`` values without one."""
    if not raw_s_each:
        return {"raw_s": None, "raw_gbps": None, "ratio_vs_raw": None}
    raw_s = sum(raw_s_each) / len(raw_s_each)
    return {"raw_s": raw_s, "raw_s_each": list(raw_s_each), "raw_gbps": nbytes / raw_s / 1e9,
            "ratio_vs_raw": raw_s / publish_s}


def wire_figures(sent: Sent, nbytes: int) -> dict[str, Any]:
    """What the update put on the wire: ``wire_format``, ``dense_bytes``, ``sent_bytes``, ``changed_fraction``,
    ``seed`` (``None`` for a full update)."""
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
    """One step's row of ``--json``; ``peak_*_bytes`` and ``memory`` are the trainer rank nearest its bound."""
    publish_s = publish_seconds(sent, received)
    tightest = concluded[0] if len(concluded) == 1 else max(
        concluded, key=lambda c: c.memory["peak_bytes"] / max(1, c.memory["bound_bytes"]))
    row = {**dataclasses.asdict(trained), "send_s": sent.send_s, **throughput(nbytes, publish_s),
           "tensors": tensors, **wire_figures(sent, nbytes), **raw_figures(nbytes, publish_s, None),
           "rollouts": [rollout_row(r, c) for r, c in zip(received, checked)], **dataclasses.asdict(tightest)}
    if sent.lora is not None:
        row["lora"] = sent.lora
    row["memory_bound_bytes"] = tightest.memory["bound_bytes"]
    for r in row["rollouts"]:  # a tensor-parallel rank: what it received of the model
        if r.get("received_bytes") is not None:
            r["received_fraction"] = r["received_bytes"] / nbytes
    if len(concluded) > 1:
        row["trainer_ranks"] = [{"rank": rank, **dataclasses.asdict(c)} for rank, c in enumerate(concluded)]
    if tokens is not None:
        row["tokens"] = tokens
    if sent.refused:
        row["refused"] = sent.refused
    if sent.check is not None:
        row["check"] = sent.check
    return row


def judged_peaks(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every rank of a step's row with the bound its peak is judged by, as ``(who, memory)``."""
    ranks = row.get("trainer_ranks")
    judged = ([(f"trainer rank {t['rank']}", t["memory"]) for t in ranks] if ranks
              else [("trainer", row["memory"])] if "memory" in row else [])
    return judged + [(f"rollout rank {r['rank']}", r["memory"]["judged_by"]) for r in row["rollouts"]
                     if r.get("memory")]


def memory_failures(row: dict[str, Any]) -> list[str]:
    """One sentence per rank of a step's row whose peak exceeded its bound (a failure, as a wrong checksum)."""
    return [f"{who}: peak {m['peak_bytes'] / 1e9:.2f} GB over its bound {m['bound_bytes'] / 1e9:.2f} GB ({m['form']})"
            for who, m in judged_peaks(row) if not m["within"]]


def row_ok(row: dict[str, Any]) -> bool:
    """A step's row is ok when every rollout verified it (and the weight check found nothing) and every peak stayed
    within its bound."""
    return (all(r["error"] is None for r in row["rollouts"]) and not (row.get("check") or {}).get("mismatches")
            and not memory_failures(row))


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over every step: the smallest ratio to the raw broadcast, and whether every peak stayed within its bound."""
    ratios = [row["ratio_vs_raw"] for row in rows if row.get("ratio_vs_raw") is not None]
    judged = [memory["within"] for row in rows for _, memory in judged_peaks(row)]
    return {"ratio_vs_raw_min": min(ratios) if ratios else None, "memory_within": all(judged) if judged else None}


__all__ = ["judged_peaks", "memory_failures", "publish_seconds", "raw_figures", "row_ok", "step_row", "summary",
           "throughput", "wire_figures"]
