"""Histories written by hand for the soak's checker tests (hal.apps.soak.checker): clean updates and runs of
them, which a test then spoils one field at a time."""

from __future__ import annotations

from hal.apps.soak.checker import History, UpdateRecord
from hal.apps.soak.options import SoakOptions

OPTIONS = SoakOptions(engine="collective", device="cpu", seed=4, updates=30)
SUMS = {g: {"a": f"{g:08x}", "b": f"{g + 1000:08x}"} for g in range(0, 41)}
T0 = 1000.0


def clean(g: int, *, served: dict[int, int] | None = None, resources: list | None = None, **fields) -> UpdateRecord:
    """Update ``g`` that went well: every rollout serves ``g`` (or ``served``), reported so."""
    served = served or {1: g, 2: g}
    observed = {i: {"served_step": s, "sums": dict(SUMS[s]) if s is not None else {},
                    "reported": {"update": g, "served_step": s, "error": None, "raised": False}}
                for i, s in served.items()}
    record = UpdateRecord(update=g, fault=None, struck=[], started_at=T0 + 10 * g, ended_at=T0 + 10 * g + 1, ok=True,
                          errors=[], observed=observed, resources=resources)
    for key, value in fields.items():
        setattr(record, key, value)
    return record


def history(records: list[UpdateRecord], options: SoakOptions = OPTIONS) -> History:
    return History(options=options, published={g: dict(s) for g, s in SUMS.items()}, records=records)


def run_of(n: int = 30, **changes) -> list[UpdateRecord]:
    records = [clean(g) for g in range(0, n + 1)]
    for g, record in changes.items():
        records[int(g[1:])] = record
    return records
