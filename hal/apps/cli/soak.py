"""``hal soak``: the weight-sync job for many updates under seeded faults, judged by a checker over its history.

One run of :func:`hal.apps.soak.run.soak` per engine, wire format and seed; see :mod:`hal.apps.soak`. A failed
run prints its seed and the shortest command that replays it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated, Any, Literal

from hal.apps.cli.helptext import DEVICE_DEFAULT, flowing_help, optional
from hal.apps.errors import UsageError, mib_to_bytes
from hal.apps.shutdown import stop_on_signals
from hal.apps.soak.faults import KINDS

# the engines a soak can run, in the order a run of several goes through them
ENGINES = ("collective", "file", "colocated", "ipc", "nixl", "mooncake", "kimi")
Engine = Literal["collective", "file", "colocated", "ipc", "nixl", "mooncake", "kimi"]
TABLE_WIDTH = 132  # columns at least
FaultKind = Literal["kill", "stop", "flip", "cut_link", "slow_link", "full_disk", "full_shm"]


@flowing_help
@dataclasses.dataclass
class Soak:
    """Run the weight-sync job for many updates while seeded faults strike, then check the whole history:
    bytes served, steps reported, errors within their bound, recovery, leaks."""

    device: Annotated[str | None, optional("KIND", DEVICE_DEFAULT)] = None
    """Device kind (cpu, npu-sim, ...)."""
    engine: Annotated[tuple[Engine, ...] | None,
                      optional("{" + ",".join(ENGINES) + "} [...]", "every engine available on the kind")] = None
    """Checkpoint engines to soak, one run each (per wire format and seed)."""
    wire_format: tuple[Literal["full", "delta"], ...] = ("full",)
    """Wire formats: full (every tensor each update) and/or delta (verl's delta_flush, checksummed flushes)."""
    seed: tuple[int, ...] = (0,)
    """Seeds of the fault plan, one run each; a run replays exactly from its seed."""
    updates: int = 40
    """Updates per run (global_steps 1..N, after step 0, the initial weights)."""
    faults: tuple[FaultKind, ...] = KINDS
    """Fault kinds the plan draws from (those the engine or machine cannot produce are skipped, with the reason)."""
    fault_rate: float = 0.25
    """Probability that an update gets a fault (never the first two, nor the one right after a fault)."""
    rollouts: int = 2
    """Rollout processes."""
    timeout: float = 5.0
    """Seconds any transfer or wait of the engines and the job may take before it is an error."""
    margin: float = 10.0
    """Seconds beyond --timeout within which every fault must end in an error naming its target or the update."""
    bucket_mb: float = 1.0
    """Bucket size of the bucketed engines, in MiB; also the bound on each process's resident-memory growth."""
    model: Literal["tensors", "qwen2.5-tiny", "qwen2.5-0.5b"] = "tensors"
    """What is trained and published: tensors (a 2.3 MB checkpoint), qwen2.5-tiny (decode verified) or qwen2.5-0.5b."""
    rollout_apply: Literal["atomic", "in-place"] = "atomic"
    """How rollouts apply an update: atomic (a second bank, switched when whole) or in place."""
    sample_every: int = 5
    """Every how many updates each process's descriptors and resident memory are sampled (a full gc each)."""
    json: bool = False
    """Print every run's report as JSON on stdout (progress goes to stderr)."""


def resolve(args: Soak) -> tuple[str, list[str]]:
    """The device kind and the engines of ``args``, checked before anything starts."""
    import ckpt
    import hal

    for flag, value in (("--updates", args.updates), ("--rollouts", args.rollouts), ("--timeout", args.timeout),
                        ("--margin", args.margin), ("--sample-every", args.sample_every)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if not 0.0 <= args.fault_rate <= 1.0:
        raise UsageError(f"--fault-rate must be a probability in [0, 1], got {args.fault_rate}")
    mib_to_bytes(args.bucket_mb, "--bucket-mb")
    for flag, values in (("--seed", args.seed), ("--wire-format", args.wire_format), ("--faults", args.faults)):
        if not values:
            raise UsageError(f"{flag} needs at least one value")
    kind = hal.resolve_device(args.device).kind
    if args.engine is None:
        engines = [e for e in ENGINES if ckpt.checkpoint_engine_availability(e, kind)[0]]
    else:
        engines = list(dict.fromkeys(args.engine))
        for engine in engines:
            ok, reason = ckpt.checkpoint_engine_availability(engine, kind)
            if not ok:
                raise UsageError(f"--engine {engine} is unavailable on {kind}: {reason}")
    return kind, engines


def runs(args: Soak) -> list[Any]:
    """Every run's :class:`~hal.apps.soak.run.SoakOptions`, engine by engine, then wire format, then seed."""
    from hal.apps.soak.options import SoakOptions

    kind, engines = resolve(args)
    return [SoakOptions(engine=engine, device=kind, seed=seed, updates=args.updates, wire_format=wire,
                        faults=tuple(dict.fromkeys(args.faults)), fault_rate=args.fault_rate, rollouts=args.rollouts,
                        timeout=args.timeout, margin=args.margin, bucket_bytes=mib_to_bytes(args.bucket_mb, "--bucket-mb"),
                        model=args.model, rollout_apply=args.rollout_apply, sample_every=args.sample_every)
            for engine in engines for wire in args.wire_format for seed in args.seed]


def print_table(reports: list[dict[str, Any]]) -> None:
    """One row per run, then each run's faults by kind and what it skipped."""
    from rich.table import Table

    from hal.apps.cli.tables import console_for

    table = Table(title="hal soak")
    columns = ("engine", "wire", "seed", "updates ok", "faults", "wrong", "hangs", "misrep/unrep", "unrecov",
               "deaths", "detect s", "recover s", "fd +", "held + KiB", "ok")
    for column in columns:
        table.add_column(column, justify="left" if column in ("engine", "wire") else "right", no_wrap=True)
    for r in reports:
        leaks = r["leaks"]
        table.add_row(r["engine"], r["wire_format"], str(r["seed"]), f"{r['updates_ok']}/{r['updates']}",
                      str(r["faults_struck"]), str(r["wrong_bytes_served"]), str(r["hangs"]),
                      f"{r['misreported_steps']}/{r['unreported_steps']}", str(r["unrecovered"]),
                      str(r["unexpected_deaths"]), f"{r['longest_detection_s']:.1f}", f"{r['longest_recovery_s']:.1f}",
                      str(leaks["fd_growth_max"]), f"{leaks['held_growth_max_bytes'] / 1024:.0f}",
                      "yes" if r["ok"] else "NO")
    console = console_for(table, TABLE_WIDTH)  # 15 columns outgrow 132 (cut: "y…")
    console.print(table)
    for r in reports:
        faults = ", ".join(f"{kind} {n}" for kind, n in r["faults"].items()) or "none"
        console.print(f"{r['engine']} ({r['wire_format']}), seed {r['seed']}: faults {faults}; outcomes "
                      f"{r['outcomes']['error']} errors, {r['outcomes']['absorbed']} absorbed, {r['not_struck']} not "
                      f"struck" + (f"; skipped: {', '.join(sorted(r['skipped']))}" if r["skipped"] else ""))


def report_failures(reports: list[dict[str, Any]]) -> None:
    """On stderr, for each failed run: its seed, its first failures and the command that replays it."""
    for r in reports:
        if r["ok"]:
            continue
        print(f"hal soak: {r['engine']} ({r['wire_format']}) on {r['device']}, seed {r['seed']}: "
              f"{len(r['failures'])} failure(s)", file=sys.stderr)
        for text in r["failures"][:5]:
            print(f"  {text}", file=sys.stderr)
        print(f"  replay: {r['replay']}", file=sys.stderr)


def run(args: Soak) -> int:
    """``hal soak``: every run, then the table (or ``--json``); exit status 0 when every run held, else 1."""
    from hal.apps.soak.run import soak

    reports = []
    with stop_on_signals("hal soak"):  # its finally blocks stop the workers, remove namespaces and scratch
        for options in runs(args):
            print(f"hal soak: {options.engine} ({options.wire_format}) on {options.device}, seed {options.seed}, "
                  f"{options.updates} updates", file=sys.stderr)
            reports.append(soak(options, progress=_progress(options.updates)))
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        print_table(reports)
    report_failures(reports)
    return 0 if all(r["ok"] for r in reports) else 1


def _progress(updates: int):
    """A callback printing ``update g/N`` on stderr every tenth of the run."""
    every = max(1, updates // 10)

    def show(update: int) -> None:
        if update % every == 0 or update == updates:
            print(f"hal soak:   update {update}/{updates}", file=sys.stderr, flush=True)
    return show


def check(args: Soak) -> None:
    """What ``hal soak`` checks before it starts (:func:`resolve`), for the README's command checker."""
    resolve(args)


__all__ = ["ENGINES", "Soak", "check", "run", "runs"]
