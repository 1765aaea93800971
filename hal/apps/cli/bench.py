"""``hal bench``: the one entry point of the benchmarks (``hal.apps.benchmarks``), printed as ratio tables
(and optionally plotted).

Every figure is a ratio measured side by side in one run (the machine is shared and noisy): offload+onload
against a plain single-buffer copy of the same bytes (``hal/apps/benchmarks/bench_offload.py``), and the collective
checkpoint engine against one single-tensor broadcast and against tensor-by-tensor broadcasts, across
bucket sizes (``hal/apps/benchmarks/bench_ckpt.py``), the nixl, mooncake and kimi engines, where available on the
benchmarked kind, each against one raw transfer of the same bytes by its own library (a write; for kimi,
whose rollouts pull, a Mooncake read) (``hal/apps/benchmarks/bench_p2p.py``), and, only with ``--only main``
(three processes, minutes), the main job: ``hal sync`` itself, 1 trainer and ``--rollouts`` rollouts applying
every update into their models, each step against a raw broadcast of the same bytes to the same rollouts
(``hal/apps/benchmarks/bench_sync.py``). Also only when named: ``--only ray`` (the same job over Ray actors
against torchrun, ``bench_ray.py``), ``--only ipc`` (the same-host ipc engine into 1 and 2 rollout processes
against one memcpy and the collective engine, ``bench_ipc.py``), ``--only import`` (what ``import hal`` adds to ``import torch``,
``bench_import.py``), ``--only delta`` (delta weight sync against full updates of the same tensors at 0.5%,
2%, 10% and 50% changed, ``bench_delta.py``; over emulated links of R Gbit/s with ``--link-gbit R``) and ``--only senders`` (1, 2 and 4 senders over emulated
per-rank links, ``bench_senders.py``; needs root and ip netns, else skipped with the reason). Every bucket size is in MiB, as ``hal sync --bucket-mb`` takes it. ``--quick`` means
one thing for all of them: the small defaults of :data:`QUICK_DEFAULTS`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Annotated, Any

import tyro

import hal
from hal.apps.cli.helptext import DEVICE_DEFAULT, flowing_help, optional
from hal.apps.errors import UsageError, WorkerFailedError, mib_to_bytes, require_extra
from hal.apps.shutdown import stop_on_signals


BENCHMARKS = ("offload", "sync", "ipc", "delta", "main", "ray", "import", "senders")
"""Every benchmark ``--only`` names, in the order they run."""
DEFAULT_SELECTION = ("offload", "sync")
"""What a plain ``hal bench`` runs: the two-process ratio benchmarks. ``main`` (hal sync's loop on 1 GiB, three
processes), ``ray`` (that loop over Ray actors and under torchrun, several runs) and ``import`` run only when
named: ``--only main``, and so do ``ipc`` (the same-host engine against one memcpy and the collective engine),
``delta`` (delta against full updates at four changed fractions, about a
minute at 64 MiB on a loaded host) and ``senders`` (1, 2 and 4 senders over emulated links: root and ip netns)."""
RAY_STEPS = 3
"""ray: steps per run (the first a warm-up)."""


def _quick_default(metavar: str, full: str, quick: str) -> Any:
    """Help for a size flag whose default ``--quick`` changes: its metavar, both defaults (not ``None``)."""
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=f"(default: {full}; with --quick: {quick})")


@flowing_help
@dataclasses.dataclass
class Bench:
    """Run the offload and weight-sync benchmarks and print their ratio tables."""

    device: Annotated[str | None, optional("KIND", DEVICE_DEFAULT)] = None
    """Device kind. Offload moves nothing on cpu: use an accelerator or npu-sim for the offload figures."""
    size_mb: Annotated[int | None, _quick_default("INT", "1024", "64")] = None
    """Model / tensor-mix size in MiB."""
    bucket_mb: Annotated[tuple[float, ...] | None, _quick_default("FLOAT [FLOAT ...]", "64 256 1024", "4 16")] = None
    """sync: bucket sizes of the collective engine, in MiB (as hal sync's --bucket-mb); the smallest is the
    transfer-library engines' (nixl, mooncake, kimi)."""
    rounds: Annotated[int | None, _quick_default("INT", "3", "2")] = None
    """Timed repetitions per figure (medians are reported); main: its steps; ray: runs per launcher;
    import: fresh interpreters."""
    quick: bool = False
    """Small defaults for a smoke run, the same for every benchmark: --size-mb 64, --bucket-mb 4 16,
    --rounds 2, --main-bucket-mb 4. Only the defaults change: a size, bucket or round flag given with --quick
    is used as given."""
    only: Annotated[tuple[str, ...], tyro.conf.arg(metavar="{" + ",".join(BENCHMARKS) + "} [...]")] = DEFAULT_SELECTION
    """Which benchmarks to run: offload, sync (engine against broadcasts, 1 receiver) and, only when named,
    ipc (the same-host ipc engine into 1 and 2 rollout processes against one memcpy and the collective engine,
    bucket: the smallest --bucket-mb), delta (delta weight sync against full updates of the same tensors at
    0.5%, 2%, 10% and 50% changed, bucket: the smallest --bucket-mb), main (hal sync's whole loop: 1 trainer and --rollouts rollout processes,
    minutes on a host), ray (that loop over Ray actors against torchrun; needs the ray extra), import (import
    hal's cost) and senders (an update's bandwidth with 1, 2 and 4 senders over emulated per-rank links, 32 MiB;
    needs root and ip netns, else it says why and is skipped)."""
    rollouts: int = 2
    """main, ray: rollout ranks, each applying every update into its model."""
    main_bucket_mb: Annotated[float | None, _quick_default("FLOAT", "256", "4")] = None
    """main, ray: bucket size of the collective engine, in MiB (256: hal sync's --bucket-mb default)."""
    main_model: Annotated[str | None, optional("MODEL", "the tensor mix of --size-mb")] = None
    """main: a hal sync preset or safetensors path instead of the tensor mix of --size-mb (e.g. qwen2.5-0.5b)."""
    apply: Annotated[tuple[str, ...], tyro.conf.arg(metavar="{atomic,in-place} [...]")] = ("atomic",)
    """main: rollout apply modes to run (atomic, in-place), one run each."""
    plot: Annotated[str | None, optional("FILE.png", "no plot")] = None
    """Write a PNG: sync throughput against bucket size, offload bandwidth against the copy limit
    (needs matplotlib, hal's plot extra; checked before any benchmark runs)."""
    link_gbit: Annotated[float | None, optional("R", "loopback")] = None
    """delta: run it over emulated links of R Gbit/s each way, the trainer and the rollout each in its own
    network namespace (as senders; needs root and ip netns, else it says why and is skipped); --json gives
    delta_vs_full and wire_fraction per changed fraction."""
    json: bool = False
    """Print the figures as JSON."""


FULL_DEFAULTS = {"size_mb": 1024, "bucket_mb": (64.0, 256.0, 1024.0), "rounds": 3, "main_bucket_mb": 256.0}
"""The size flags' values when not given (a ``None`` field)."""
QUICK_DEFAULTS = {"size_mb": 64, "bucket_mb": (4.0, 16.0), "rounds": 2, "main_bucket_mb": 4.0}
"""The same with ``--quick``."""


def with_defaults(args: Bench) -> Bench:
    """``args`` with every size flag not given (``None``) set to its default, :data:`QUICK_DEFAULTS` under
    ``--quick``, else :data:`FULL_DEFAULTS`; a flag given explicitly is kept, with or without ``--quick``."""
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    return dataclasses.replace(args, **{k: v for k, v in defaults.items() if getattr(args, k) is None})


def selection(args: Bench) -> list[str]:
    """The benchmarks ``args`` runs, in :data:`BENCHMARKS` order, after checking every size and count.

    Raises:
        UsageError: an unknown name in ``--only`` or ``--apply``, a size, round or rollout count below 1, a
            bucket size (``--bucket-mb``, ``--main-bucket-mb``) that is not positive, a ``--plot`` file in a
            folder that does not exist, a ``--link-gbit`` rate that is not in (0, 400] or given without
            ``--only delta``; names the flag and value.
        MissingExtraError: ``--plot`` without matplotlib, ``--only ray`` without ray.
    """
    args = with_defaults(args)
    unknown = sorted(set(args.only) - set(BENCHMARKS))
    if unknown or not args.only:
        raise UsageError(f"--only takes {', '.join(BENCHMARKS)} (default: {' '.join(DEFAULT_SELECTION)}), "
                         f"got {list(args.only)}")
    bad = sorted(set(args.apply) - {"atomic", "in-place"})
    if bad or not args.apply:
        raise UsageError(f"--apply takes atomic and/or in-place, got {list(args.apply)}")
    for flag, value in (("--size-mb", args.size_mb), ("--rounds", args.rounds), ("--rollouts", args.rollouts)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not args.bucket_mb:
        raise UsageError("--bucket-mb needs at least one size")
    for value in args.bucket_mb:
        mib_to_bytes(value, "--bucket-mb")
    mib_to_bytes(args.main_bucket_mb, "--main-bucket-mb")
    chosen = [name for name in BENCHMARKS if name in args.only]
    if args.link_gbit is not None:
        from hal.apps.links import link_gbit_to_bps

        link_gbit_to_bps(args.link_gbit)
        if "delta" not in chosen:
            raise UsageError(f"--link-gbit has no effect without --only delta (got --only {' '.join(args.only)})")
    if args.plot:  # before any benchmark runs: a plot that cannot be written is known now, not in an hour
        require_extra("matplotlib", "plot", "--plot")
        folder = pathlib.Path(args.plot).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--plot {args.plot}: the folder {folder} does not exist")
    if "ray" in chosen:
        require_extra("ray", "ray", "--only ray")
    return chosen


def execute(args: Bench) -> dict[str, Any]:
    """Run the chosen benchmarks (:func:`selection`); returns ``{"offload": {...}, "sync": {...},
    "sync_p2p": {...}, "ipc": {...}, "main": {...}, "ray": {...}, "import": {...}}`` (those chosen and available; see each
    module's ``run``).

    Raises:
        UsageError: what :func:`selection` raises.
        WorkerFailedError: a benchmark's rank failed; names it and how.
    """
    from hal.multiprocess import MultiprocessError

    chosen = selection(args)
    try:
        with stop_on_signals("hal bench"):  # SIGTERM: the ranks are stopped before hal bench ends
            return _execute(chosen, with_defaults(args))
    except MultiprocessError as exc:
        if not exc.failures:
            raise
        raise WorkerFailedError("hal bench: " + "; ".join(f"the benchmark rank {rank} failed: {why.strip().splitlines()[0]}"
                                                          for rank, why in sorted(exc.failures.items()))) from None


def _execute(chosen: list[str], args: Bench) -> dict[str, Any]:
    size, buckets, rounds = args.size_mb, args.bucket_mb, args.rounds
    kind = hal.resolve_device(args.device).kind
    out: dict[str, Any] = {}
    if "offload" in chosen:
        from hal.apps.benchmarks import bench_offload

        out["offload"] = bench_offload.run(size, kind, rounds)
    if "sync" in chosen:
        from hal.apps.benchmarks import bench_ckpt

        out["sync"] = bench_ckpt.run(size, list(buckets), kind, rounds)
        import ckpt
        from hal.apps.benchmarks import bench_p2p

        engines = [e for e in bench_p2p.transfer_library_engines() if ckpt.checkpoint_engine_availability(e, kind)[0]]
        if engines:  # the transfer-library engines, each against its own library's raw transfer
            out["sync_p2p"] = bench_p2p.run(size, min(buckets), kind, rounds, engines)
    if "ipc" in chosen:
        from hal.apps.benchmarks import bench_ipc

        out["ipc"] = bench_ipc.run(size, kind, rounds, min(buckets))
    if "delta" in chosen:
        from hal.apps.benchmarks import bench_delta

        if args.link_gbit is None:
            out["delta"] = bench_delta.run(size, kind, rounds, min(buckets))
        else:
            from hal.apps.links import links_available

            ok, reason = links_available()
            out["delta"] = (bench_delta.run(size, kind, rounds, min(buckets), link_gbit=args.link_gbit) if ok
                            else {"skipped": reason})
    if "main" in chosen:
        from hal.apps.benchmarks import bench_sync

        out["main"] = bench_sync.run(size, kind, args.rollouts, rounds, args.main_bucket_mb, args.apply,
                                     args.main_model)
    if "ray" in chosen:
        from hal.apps.benchmarks import bench_ray

        out["ray"] = bench_ray.run(size, kind, args.rollouts, RAY_STEPS, rounds, args.main_bucket_mb)
    if "import" in chosen:
        from hal.apps.benchmarks import bench_import

        out["import"] = bench_import.run(rounds)
    if "senders" in chosen:
        from hal.apps.links import links_available

        ok, reason = links_available()
        if ok:
            from hal.apps.benchmarks import bench_senders

            out["senders"] = bench_senders.bench_senders(rounds=rounds)
        else:
            out["senders"] = {"skipped": reason}
    return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Draw sync GB/s against bucket size and offload GB/s against the plain-copy limit into ``path``.

    Raises:
        MissingExtraError: matplotlib is not installed (the ``plot`` extra).
    """
    require_extra("matplotlib", "plot", "--plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sync = result.get("sync")
    ax = axes[0]
    if sync:
        for layout in sorted({b["layout"] for b in sync["buckets"]}):
            rows = [b for b in sync["buckets"] if b["layout"] == layout]
            ax.plot([b["bucket_bytes"] / 2**20 for b in rows], [b["gbps"] for b in rows], "o-",
                    label=f"engine ({layout})")
        ax.axhline(sync["single_gbps"], color="k", ls="--", label="one single-tensor broadcast")
        ax.axhline(sync["per_tensor_gbps"], color="r", ls=":", label="tensor by tensor")
        ax.set_xscale("log", base=2)
        ax.set_title(f"weight sync on {sync['device']} ({sync['backend']})")
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    offload = result.get("offload")
    ax = axes[1]
    if offload:
        labels = ["plain copy_\n(limit)", "engine\ncold", "engine\nwarm"]
        values = [offload["plain_gbps"], offload["cold_gbps"], offload["warm_gbps"]]
        ax.bar(labels, values, color=["grey", "tab:orange", "tab:blue"])
        ax.set_title(f"offload+onload on {offload['device']}, {offload['bytes'] / 2**20:.0f} MiB")
        ax.set_ylabel("GB/s (round trip)")
        if not offload.get("moves", True):
            ax.text(0.5, 0.5, "offload moves nothing on cpu\n(tensors already live in host memory):\n"
                    "use --device npu-sim or an accelerator", ha="center", va="center", transform=ax.transAxes)
    for ax, what, flag in ((axes[0], sync, "sync"), (axes[1], offload, "offload")):
        if not what:
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"{flag} not run (--only)", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(result: dict[str, Any]) -> None:
    """Each benchmark's table (its module's ``print_table``), in :data:`BENCHMARKS` order."""
    from hal.apps.benchmarks import bench_ckpt, bench_import, bench_offload, bench_p2p, bench_ray, bench_sync

    tables = (("offload", bench_offload), ("sync", bench_ckpt), ("sync_p2p", bench_p2p), ("ipc", None), ("delta", None),
              ("main", bench_sync), ("ray", bench_ray), ("import", bench_import), ("senders", None))
    for key, module in tables:
        if key not in result:
            continue
        if key in ("senders", "delta") and isinstance(result[key], dict) and "skipped" in result[key]:
            print(f"{key}: skipped: {result[key]['skipped']}")
            continue
        if module is None:  # imported only when chosen (bench_senders needs the links module's tools)
            from importlib import import_module

            module = import_module(f"hal.apps.benchmarks.bench_{key}")
        module.print_table(result[key])


def run(args: Bench) -> int:
    """``hal bench``: run the chosen benchmarks, print their tables (or JSON), write the plot; exit status 0.

    Raises:
        UsageError, WorkerFailedError: see :func:`execute`; MissingExtraError: see :func:`plot`.
    """
    result = execute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result)
    if args.plot:
        plot(result, pathlib.Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
