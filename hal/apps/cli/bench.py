"""``hal bench``: the one entry point of the benchmarks (``hal.apps.benchmarks``), printed as ratio tables.

Every figure is a ratio measured side by side in one run: offload+onload against a plain copy
(``bench_offload``), the collective engine against broadcasts across bucket sizes (``bench_ckpt``), the
transfer-library engines against their own library's raw transfer (``bench_p2p``); only when named with
``--only``: the whole ``hal sync`` job (``bench_sync``), over Ray (``bench_ray``), the ipc engine
(``bench_ipc``), ``import hal`` (``bench_import``), delta updates (``bench_delta``), 1, 2, 4 senders over
emulated links (``bench_senders``) and LoRA adapters against merged weights (``bench_lora``). Bucket sizes are in MiB;
``--quick`` means :data:`QUICK_DEFAULTS`.
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


# in the order they run
BENCHMARKS = ("offload", "sync", "ipc", "delta", "main", "ray", "import", "senders", "m2n", "check", "lora")
M2N_MB = {"full": 256, "quick": 32}  # m2n's model when --size-mb is not given (six ranks each hold their part)
# a plain hal bench; main, ray, import, ipc, delta, senders, m2n, check and lora run only when named
DEFAULT_SELECTION = ("offload", "sync")
RAY_STEPS = 3  # ray: steps per run (the first a warm-up)


def _quick_default(metavar: str, full: str, quick: str) -> Any:
    """Help for a size flag whose default ``--quick`` changes."""
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
    """sync: bucket sizes of the collective engine, in MiB; the smallest is the transfer-library engines'."""
    rounds: Annotated[int | None, _quick_default("INT", "3", "2")] = None
    """Timed repetitions per figure (medians reported); main: its steps; ray: runs per launcher."""
    quick: bool = False
    """Small defaults for a smoke run (--size-mb 64, --bucket-mb 4 16, --rounds 2, --main-bucket-mb 4)."""
    only: Annotated[tuple[str, ...], tyro.conf.arg(metavar="{" + ",".join(BENCHMARKS) + "} [...]")] = DEFAULT_SELECTION
    """Benchmarks to run: offload, sync; only when named: ipc, delta, main (hal sync's loop), ray, import, senders, m2n,
    check (the weight checker against one copy of the model), lora (adapter against merged publishes)."""
    rollouts: int = 2
    """main, ray: rollout ranks, each applying every update into its model."""
    main_bucket_mb: Annotated[float | None, _quick_default("FLOAT", "256", "4")] = None
    """main, ray: bucket size of the collective engine, in MiB (256: hal sync's --bucket-mb default)."""
    main_model: Annotated[str | None, optional("MODEL", "main: the tensor mix of --size-mb; lora: qwen2.5-0.5b")] = None
    """main: a hal sync preset or safetensors path instead of the tensor mix of --size-mb; lora: the preset
    (with --quick: qwen2.5-tiny)."""
    apply: Annotated[tuple[str, ...], tyro.conf.arg(metavar="{atomic,in-place} [...]")] = ("atomic",)
    """main: rollout apply modes to run (atomic, in-place), one run each."""
    plot: Annotated[str | None, optional("FILE.png", "no plot")] = None
    """Write a PNG of sync and offload throughput (needs matplotlib, hal's plot extra)."""
    link_gbit: Annotated[float | None, optional("R", "loopback")] = None
    """delta, m2n: run over emulated links of R Gbit/s each way (root and ip netns, else skipped with the reason)."""
    json: bool = False
    """Print the figures as JSON."""


# the size flags' values when not given (None); QUICK_DEFAULTS with --quick
FULL_DEFAULTS = {"size_mb": 1024, "bucket_mb": (64.0, 256.0, 1024.0), "rounds": 3, "main_bucket_mb": 256.0}
QUICK_DEFAULTS = {"size_mb": 64, "bucket_mb": (4.0, 16.0), "rounds": 2, "main_bucket_mb": 4.0}


def with_defaults(args: Bench) -> Bench:
    """``args`` with every size flag not given set to its default (:data:`QUICK_DEFAULTS` under ``--quick``)."""
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    return dataclasses.replace(args, **{k: v for k, v in defaults.items() if getattr(args, k) is None})


def selection(args: Bench) -> list[str]:
    """The benchmarks ``args`` runs, in :data:`BENCHMARKS` order, after checking every flag (UsageError,
    MissingExtraError)."""
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
        if "delta" not in chosen and "m2n" not in chosen:
            raise UsageError(f"--link-gbit has no effect without --only delta or m2n (got --only {' '.join(args.only)})")
    if args.plot:  # before any benchmark runs: a plot that cannot be written is known now, not in an hour
        require_extra("matplotlib", "plot", "--plot")
        folder = pathlib.Path(args.plot).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--plot {args.plot}: the folder {folder} does not exist")
    if "ray" in chosen:
        require_extra("ray", "ray", "--only ray")
    return chosen


def execute(args: Bench) -> dict[str, Any]:
    """Run the chosen benchmarks; returns ``{name: figures}`` of those chosen and available."""
    from hal.apps.multiprocess import MultiprocessError

    chosen = selection(args)
    try:
        with stop_on_signals("hal bench"):  # SIGTERM: the ranks are stopped before hal bench ends
            m2n_mb = args.size_mb or M2N_MB["quick" if args.quick else "full"]
            return _execute(chosen, with_defaults(args), m2n_mb)
    except MultiprocessError as exc:
        if not exc.failures:
            raise
        raise WorkerFailedError("hal bench: " + "; ".join(f"the benchmark rank {rank} failed: {why.strip().splitlines()[0]}"
                                                          for rank, why in sorted(exc.failures.items()))) from None


def _execute(chosen: list[str], args: Bench, m2n_mb: int = M2N_MB["full"]) -> dict[str, Any]:
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
    if "m2n" in chosen:
        from hal.apps.benchmarks import bench_m2n

        from hal.apps.links import links_available

        ok, reason = (True, "") if args.link_gbit is None else links_available()
        out["m2n"] = (bench_m2n.run(m2n_mb, args.link_gbit, rounds) if ok else {"skipped": reason})
    if "check" in chosen:
        from hal.apps.benchmarks import bench_check

        out["check"] = bench_check.run(size, kind, rounds)
    if "lora" in chosen:
        from hal.apps.benchmarks import bench_lora

        model = args.main_model or ("qwen2.5-tiny" if args.quick else "qwen2.5-0.5b")
        out["lora"] = bench_lora.run(model, kind, args.rollouts, rounds, args.main_bucket_mb)
    return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Draw sync GB/s against bucket size and offload GB/s against the plain-copy limit into ``path``."""
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
              ("main", bench_sync), ("ray", bench_ray), ("import", bench_import), ("senders", None),
              ("m2n", None), ("check", None), ("lora", None))
    for key, module in tables:
        if key not in result:
            continue
        if key in ("senders", "delta", "m2n") and isinstance(result[key], dict) and "skipped" in result[key]:
            print(f"{key}: skipped: {result[key]['skipped']}")
            continue
        if module is None:  # imported only when chosen (bench_senders needs the links module's tools)
            from importlib import import_module

            module = import_module(f"hal.apps.benchmarks.bench_{key}")
        module.print_table(result[key])


def run(args: Bench) -> int:
    """``hal bench``: run the chosen benchmarks, print their tables (or JSON), write the plot; exit status 0."""
    result = execute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result)
    if args.plot:
        plot(result, pathlib.Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
