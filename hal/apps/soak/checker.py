"""The soak's checker: reads a run's whole history afterwards (as Jepsen's checker does) and says what held.

Rules, per update ``g``:

* **Bytes served.** Every step a rollout serves equals, CRC-32 per tensor, what the trainer staged for it
  (``wrong_bytes_served``, also when the job's verification caught it afterwards).
* **Reported = served.** What a rollout reported for ``g`` is what it serves after it
  (``misreported_steps``); serving ``g`` after an error or without being asked is ``unreported_steps``.
* **Faults end in errors** naming the target or the update within ``timeout + margin`` seconds of the strike;
  a kind in :data:`~hal.apps.soak.faults.ABSORBABLE` may instead leave the update verified.
* **Only a kill kills** (``unexpected_deaths``). **Recovery:** the update after a fault succeeds, as does every
  update without one. **No hang:** no step outlives the watchdog, no worker is busy past the bound (``hangs``).
* **Nothing leaks** (:func:`check_leaks`): descriptors, held memory (< one bucket of growth), ``/dev/shm``
  segments and temporary directories stay flat.

A failure names its update; :func:`replay_command` replays the plan up to there.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

LEAK_WINDOW = 5  # clean samples per window of the leak verdict
LEAK_SPAN = 10  # updates between the first and last window, at least


@dataclasses.dataclass
class UpdateRecord:
    """What happened in one update (``update`` 0: the initial weights); times are wall-clock seconds.

    ``observed``: ``{rollout index: Host.observe()}``, ``sums`` replaced by their :func:`digest` where they equal
    the published step's. ``resources``: each process's after a clean update. ``hangs``: what overran its bound.
    """

    update: int
    fault: Any
    struck: list[tuple[Any, float]]
    started_at: float
    ended_at: float
    ok: bool
    errors: list[tuple[float, str]]
    restarted: list[int] = dataclasses.field(default_factory=list)
    observed: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    resources: list[dict[str, Any]] | None = None
    shm: list[str] | None = None
    temp: list[str] | None = None
    hangs: list[str] = dataclasses.field(default_factory=list)
    stopped: bool = False


@dataclasses.dataclass
class History:
    """A run's history: its options, the trainer's published checksums per step, one record per update."""

    options: Any
    published: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)
    records: list[UpdateRecord] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    after_close: dict[str, list[str]] | None = None
    wall_s: float = 0.0
    stacks: list[str] = dataclasses.field(default_factory=list)

    def add(self, record: UpdateRecord) -> None:
        self.records.append(record)


def digest(sums: dict[str, str]) -> str:
    """One CRC-32 of a ``{name: CRC-32}`` mapping in name order (the history keeps digests, so it stays small)."""
    import zlib

    text = ";".join(f"{name}={value}" for name, value in sorted(sums.items()))
    return f"{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}"


def first_mismatch(expected: dict[str, str], got: dict[str, str]) -> str | None:
    """The first tensor whose checksum differs, is missing or is extra."""
    from hal.apps.weightsync.verify import first_mismatch as mismatch

    return mismatch(expected, got)


def names(text: str, target: int, update: int) -> bool:
    """Whether ``text`` names the worker ``target`` (0: ``trainer``; else ``rollout rank i``) or the update."""
    who = r"\btrainer\b" if target == 0 else rf"\b(rollout rank|rollout|rank) {target}\b"
    return bool(re.search(who, text) or re.search(rf"\b(global_steps|step) {update}\b", text))


def replay_command(options: Any, updates: int) -> str:
    """The shortest ``hal soak`` command that replays ``options``' run up to update ``updates``."""
    from hal.apps.soak.faults import KINDS
    from hal.apps.soak.options import SoakOptions

    default = SoakOptions()
    parts = ["hal soak", f"--device {options.device}", f"--engine {options.engine}", f"--seed {options.seed}",
             f"--updates {updates}"]
    if options.wire_format != default.wire_format:
        parts.append(f"--wire-format {options.wire_format}")
    if tuple(options.faults) != KINDS:
        parts.append("--faults " + " ".join(options.faults))
    for flag, value, base in (("--fault-rate", options.fault_rate, default.fault_rate),
                              ("--sample-every", options.sample_every, default.sample_every),
                              ("--rollouts", options.rollouts, default.rollouts),
                              ("--timeout", options.timeout, default.timeout),
                              ("--margin", options.margin, default.margin),
                              ("--model", options.model, default.model),
                              ("--rollout-apply", options.rollout_apply, default.rollout_apply)):
        if value != base:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    if options.bucket_bytes != default.bucket_bytes:
        parts.append(f"--bucket-mb {options.bucket_bytes / (1 << 20):g}")
    return " ".join(parts)


class Verdict:
    """The checker's tallies while it reads a history (see :func:`judge`)."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.failures: list[tuple[int, str]] = []
        self.wrong: list[dict[str, Any]] = []
        self.misreported = 0
        self.unreported = 0
        self.hangs = 0
        self.faults: dict[str, int] = {}
        self.outcomes = {"error": 0, "absorbed": 0}
        self.not_struck = 0
        self.deaths = 0
        self.unrecovered = 0
        self.longest_recovery = 0.0
        self.longest_detection = 0.0

    def fail(self, update: int, text: str) -> None:
        self.failures.append((update, f"update {update}: {text}"))


def check_served(verdict: Verdict, record: UpdateRecord, previous: dict[int, Any]) -> None:
    """The bytes-served and reported-equals-served rules for one update."""
    published = verdict.history.published
    g = record.update
    for index, seen in record.observed.items():
        step = seen["served_step"]
        if step is not None:
            expected = published.get(step)
            if expected is None:
                mismatch = "the trainer never staged that step"
            elif seen.get("sums") is None and seen.get("digest") == digest(expected):
                mismatch = None  # the history kept the digest only: it matched when it was taken
            else:
                mismatch = first_mismatch(expected, seen["sums"]) if seen.get("sums") is not None else \
                    f"the served tensors' digest {seen.get('digest')} differs from the trainer's {digest(expected)}"
            if mismatch is not None:
                verdict.wrong.append({"update": g, "rollout": index, "served_step": step, "what": mismatch})
                reported = any(names(text, index, g) for _, text in record.errors)
                verdict.fail(g, f"rollout rank {index} serves step {step} with bytes that differ from the "
                                f"trainer's: {mismatch}" + (" (reported by the job's verification)" if reported else
                                                           " (no error reported)"))
        if index in record.restarted:
            continue  # a new process: it serves nothing yet, and reported nothing
        report = seen.get("reported")
        this = report is not None and report.get("update") == g
        if g == 0 or not this:
            if step == g and g != 0 and previous.get(index) != g:
                verdict.unreported += 1
                verdict.fail(g, f"rollout rank {index} serves step {g} but its update was never reported")
            continue
        if report["raised"] or report["error"] is not None:
            if step == g:
                verdict.unreported += 1
                verdict.fail(g, f"rollout rank {index} serves step {g} but reported its update failed "
                                f"({report['error']})")
            elif report["served_step"] != step and not report["raised"]:
                verdict.misreported += 1
                verdict.fail(g, f"rollout rank {index} reported serving step {report['served_step']} after a failed "
                                f"update, but serves step {step}")
        elif report["served_step"] != g or step != g:
            verdict.misreported += 1
            verdict.fail(g, f"rollout rank {index} reported step {report['served_step']} without error, but serves "
                            f"step {step} (expected {g})")


def check_fault(verdict: Verdict, record: UpdateRecord, following: UpdateRecord | None, bound_s: float) -> None:
    """The faults-end-in-errors and recovery rules for one update with a fault."""
    from hal.apps.soak.faults import ABSORBABLE

    fault, g = record.fault, record.update
    deaths = [i for i in record.restarted if not (fault.kind == "kill" and i == fault.target)]
    if deaths:
        verdict.deaths += len(deaths)
        texts = "; ".join(text for _, text in record.errors) or "no error text"
        verdict.fail(g, f"{fault.describe()} killed worker(s) {deaths} instead of failing the update with an error "
                        f"({texts})")
    struck = [at for f, at in record.struck if f == fault]
    if not struck:
        verdict.not_struck += 1
        return
    at = struck[0]
    verdict.faults[fault.kind] = verdict.faults.get(fault.kind, 0) + 1
    named = [(t, text) for t, text in record.errors if names(text, fault.target, g)]
    if named:
        verdict.outcomes["error"] += 1
        detection = max(0.0, min(t for t, _ in named) - at)
        verdict.longest_detection = max(verdict.longest_detection, detection)
        if detection > bound_s:
            verdict.hangs += 1
            verdict.fail(g, f"{fault.describe()}: the first error naming it came {detection:.1f} s after the strike, "
                            f"beyond the bound of {bound_s:g} s")
    elif record.ok and fault.kind in ABSORBABLE:
        verdict.outcomes["absorbed"] += 1
    elif record.ok:
        verdict.fail(g, f"{fault.describe()}: the update succeeded as if nothing happened")
    else:
        texts = "; ".join(text for _, text in record.errors) or "no error at all"
        verdict.fail(g, f"{fault.describe()}: no error named the target or the update ({texts})")
    if following is None:
        return
    if following.ok and not following.hangs:
        verdict.longest_recovery = max(verdict.longest_recovery, following.ended_at - at)
    else:
        verdict.unrecovered += 1
        texts = "; ".join(text for _, text in following.errors) or "the step hung"
        verdict.fail(following.update, f"the update after {fault.describe()} failed: {texts}")


def median(values: list[int]) -> int:
    """The median of ``values`` (the lower middle one of an even count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def check_leaks(verdict: Verdict, bucket_bytes: int) -> dict[str, Any]:
    """The nothing-leaks rule; returns the ``leaks`` figures.

    Each process is judged on clean samples past its warm-up (and past its first failure path): the median of its
    next :data:`LEAK_WINDOW` samples against its last, at least :data:`LEAK_SPAN` updates apart. The fewest
    descriptors must not grow (a closed peer's socket may linger tens of seconds); ``held_bytes`` must grow by less
    than one bucket. ``rss_bytes`` and the driver's memory are reported, not judged.
    """
    samples: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    failed = [r.update for r in verdict.history.records if r.fault is not None or not r.ok]
    for record in verdict.history.records:
        for sample in record.resources or []:
            samples.setdefault(sample["pid"], []).append((record.update, sample))
    fds, rss, helds, judged, driver_rss = [], [], [], 0, None
    w = LEAK_WINDOW
    for pid, seen in samples.items():
        first_failure = next((g for g in failed if g > seen[0][0]), None)
        warm = [i for i, (g, _) in enumerate(seen) if i >= w and (first_failure is None or g > first_failure)]
        if not warm or len(seen) - warm[0] < 2 * w or seen[-w][0] - seen[warm[0] + w - 1][0] < LEAK_SPAN:
            continue
        judged += 1
        base, end = seen[warm[0]:warm[0] + w], seen[-w:]
        first_update, last_update = base[0][0], end[-1][0]
        fd_growth = min(s["fds"] for _, s in end) - min(s["fds"] for _, s in base)
        rss_growth = median([s["rss_bytes"] for _, s in end]) - median([s["rss_bytes"] for _, s in base])
        held = "held_bytes" if all("held_bytes" in s for _, s in base + end) else "rss_bytes"
        held_growth = median([s[held] for _, s in end]) - median([s[held] for _, s in base])
        fds.append(fd_growth)
        driver = bool(base[0][1].get("driver"))
        who = "the driver" if driver else f"pid {pid}"
        if fd_growth > 0:
            verdict.fail(last_update, f"{who} held {fd_growth:+d} file descriptors (the fewest of updates "
                                      f"..{last_update} against the fewest of {first_update}..)")
        if driver:
            driver_rss = rss_growth
            continue
        rss.append(rss_growth)
        helds.append(held_growth)
        if held_growth >= bucket_bytes:
            what = "resident memory less file-backed pages" if held == "held_bytes" else "resident memory"
            verdict.fail(last_update, f"{who}'s {what} grew by {held_growth} bytes (medians) from updates "
                                      f"{first_update}.. to ..{last_update}, not under one bucket ({bucket_bytes} bytes)")
    leaks: dict[str, Any] = {"processes_judged": judged, "fd_growth_max": max(fds, default=0),
                             "held_growth_max_bytes": max(helds, default=0), "rss_growth_max_bytes": max(rss, default=0),
                             "rss_bound_bytes": bucket_bytes, "driver_rss_growth_bytes": driver_rss}
    for name in ("shm", "temp"):
        counted = [(r.update, getattr(r, name)) for r in verdict.history.records if getattr(r, name) is not None]
        after = (verdict.history.after_close or {}).get(name)
        key = "shm_segments" if name == "shm" else "temp_entries"
        leaks[key] = {"first": len(counted[0][1]) if counted else None,
                      "last": len(counted[-1][1]) if counted else None,
                      "after_close": len(after) if after is not None else None}
        if counted and len(counted[-1][1]) > len(counted[0][1]):
            verdict.fail(counted[-1][0], f"{key.replace('_', ' ')} grew from {len(counted[0][1])} to "
                                         f"{len(counted[-1][1])}: {sorted(set(counted[-1][1]) - set(counted[0][1]))}")
        if after:
            verdict.fail(verdict.history.records[-1].update if verdict.history.records else 0,
                         f"{key.replace('_', ' ')} left after the engines closed: {after}")
    return leaks


def judge(history: History, clean_start: int) -> dict[str, Any]:
    """Read ``history`` against the rules of the module docstring; returns the run's report (``ok``, the tallies,
    ``failures`` first first, ``stacks`` when something hung, ``replay``)."""
    options = history.options
    verdict = Verdict(history)
    records = history.records
    previous: dict[int, Any] = {}
    for i, record in enumerate(records):
        for text in record.hangs:
            verdict.hangs += 1
            verdict.fail(record.update, f"a hang: {text}")
        if record.stopped:
            verdict.fail(record.update, "the soak stopped here: a worker did not answer at all")
            continue
        check_served(verdict, record, previous)
        previous = {index: seen["served_step"] for index, seen in record.observed.items()}
        if record.fault is not None:
            following = records[i + 1] if i + 1 < len(records) else None
            check_fault(verdict, record, following, options.detection_bound_s)
        elif record.restarted:
            verdict.deaths += len(record.restarted)
            verdict.fail(record.update, f"worker(s) {record.restarted} died without a fault: "
                                        + ("; ".join(text for _, text in record.errors) or "no error text"))
        elif record.update > 0 and not record.ok and not (i > 0 and records[i - 1].fault is not None):
            texts = "; ".join(text for _, text in record.errors) or "no error text"
            verdict.fail(record.update, f"the update failed without a fault: {texts}")
    leaks = check_leaks(verdict, options.bucket_bytes)
    ran = max((r.update for r in records), default=0)
    if ran < options.updates and not any(r.stopped for r in records):
        verdict.fail(ran, f"the run ended after update {ran} of {options.updates}")
    failures = sorted(verdict.failures, key=lambda f: f[0])
    first = failures[0][0] if failures else None
    return {
        "ok": not failures, "engine": options.engine, "device": options.device, "wire_format": options.wire_format,
        "seed": options.seed, "updates": ran, "updates_ok": sum(r.ok for r in records if r.update > 0),
        "faults": dict(sorted(verdict.faults.items())), "faults_struck": sum(verdict.faults.values()),
        "outcomes": verdict.outcomes, "not_struck": verdict.not_struck, "skipped": history.skipped,
        "wrong_bytes_served": len(verdict.wrong), "wrong_servings": verdict.wrong, "hangs": verdict.hangs,
        "unreported_steps": verdict.unreported, "misreported_steps": verdict.misreported,
        "unrecovered": verdict.unrecovered, "unexpected_deaths": verdict.deaths, "longest_detection_s": round(verdict.longest_detection, 3),
        "detection_bound_s": options.detection_bound_s, "longest_recovery_s": round(verdict.longest_recovery, 3),
        "restarts": sum(len(r.restarted) for r in records), "leaks": leaks, "wall_s": round(history.wall_s, 1),
        "failures": [text for _, text in failures], "stacks": history.stacks,
        "replay": replay_command(options, max(first, 1) if first is not None and first < ran else options.updates)
        if failures else None,
    }


__all__ = ["History", "LEAK_SPAN", "LEAK_WINDOW", "digest", "UpdateRecord", "judge", "names", "replay_command"]
