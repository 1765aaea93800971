"""``hal sync``: the RL weight-sync job a user runs first, shaped like an RL job's trainer and rollouts.

One trainer (``--trainer-ranks N``: FSDP2 over N ranks, each publishing its own shards) and ``--rollouts``
rollout ranks on one device kind. Each of ``--steps`` steps: the trainer takes an AdamW step on fp32 master
weights and offloads per ``--offload``; it publishes them cast to bf16 (presets) with ``global_steps`` through
the chosen engine, as verl's ``CheckpointEngineManager`` runs an update; every rollout loads the update into
its model's existing parameters (all-or-nothing unless ``--rollout-apply in-place``), then proves what it
serves (greedy-decode tokens and logits against the trainer's, a CRC-32 per tensor); a raw broadcast of the same
bytes before and after is the throughput reference (:mod:`hal.apps.weightsync.raw`); the trainer onloads.
``--wire-format delta`` sends only changed values (:mod:`hal.apps.weightsync.delta`). The job is the library
:mod:`hal.apps.weightsync`; this module is its options and a call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Annotated, Any, Literal

import tyro

import hal
from hal.apps.errors import UsageError, mib_to_bytes
from hal.apps.cli.helptext import DEVICE_DEFAULT, flowing_help, optional
from hal.apps.weightsync.options import JobOptions


@flowing_help
@dataclasses.dataclass
class Sync:
    """Run an RL weight-sync loop: train, offload, publish with global_steps, load into rollout models,
    verify by greedy decode and checksums, onload."""

    device: Annotated[str | None, optional("KIND", DEVICE_DEFAULT)] = None
    """Device kind (npu, cuda, cpu, npu-sim, a plugin kind; npu:1 picks an index)."""
    model: Annotated[str, tyro.conf.arg(metavar="{qwen2.5-0.5b,qwen2.5-tiny}|PATH")] = "qwen2.5-0.5b"
    """A preset (qwen2.5-0.5b: Qwen2.5-0.5B's configuration, 0.99 GB in bf16; qwen2.5-tiny) or a safetensors path."""
    rollouts: int = 2
    """Rollout ranks receiving each step."""
    trainer_ranks: int = 1
    """Trainer ranks; N > 1: FSDP2 shards the model over N processes, each publishing its own shards."""
    rollout_tp: int = 1
    """Tensor-parallel size of each rollout server (--rollouts ranks in servers of T); each rank receives only its slices."""
    steps: int = 3
    """Training steps, each published as global_steps 1..steps."""
    offload: Literal["none", "optimizer", "model", "all"] = "none"
    """What the trainer offloads to the host between its step and the next."""
    engine: Literal["collective", "file", "colocated", "ipc", "nixl", "mooncake", "kimi"] = "collective"
    """Checkpoint engine publishing the weights (ipc: on this host; nixl, mooncake, kimi: where hal info lists them)."""
    rollout_apply: Literal["atomic", "in-place"] = "atomic"
    """atomic: rollouts load into a second weight bank and switch when the update is whole (a failed update
    leaves the previous step in service; memory 2 x model). in-place: into the served weights (memory
    1 x model; a failed update leaves the rollout serving no step)."""
    bucket_mb: float = 256.0
    """Bucket size of the bucketed engines (collective, ipc, nixl, mooncake, kimi), in MiB."""
    lr: float = 1e-4
    """AdamW learning rate."""
    decode_tokens: int = 4
    """Tokens of the greedy decode each rollout and the trainer run after every update (presets only)."""
    logits_atol: float = 1e-2
    """Largest absolute difference allowed between a rollout's decode logits and the trainer's."""
    timeout: float = 300.0
    """Seconds any rendezvous, transfer or wait may take before it is an error."""
    file_root: Annotated[str | None, optional("DIR", "a new temporary directory, removed at exit")] = None
    """With --engine file: the directory its steps are published under (kept at exit)."""
    json: bool = False
    """Print the per-step results as JSON on stdout (progress goes to stderr)."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Who starts the ranks: torchrun (one machine) or Ray actors (engine collective, or ipc on one node)."""
    address: Annotated[str | None, optional("auto|HOST:PORT", "start a one-node cluster for the run")] = None
    """With --launcher ray: the cluster, 'auto' (the cluster of this node) or HOST:PORT of its head."""
    placement: Annotated[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None,
                         optional("{PACK,SPREAD,STRICT_PACK,STRICT_SPREAD}", "PACK")] = None
    """With --launcher ray: how the trainer's and rollouts' bundles are placed across nodes."""
    rollout: Literal["hal", "vllm"] = "hal"
    """Who serves each rollout: hal (a transformers model) or vllm (a vLLM engine; scripts/setup_vllm.sh)."""
    publish_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The dtype a preset is published and served in; auto: float32 with --rollout vllm, else bfloat16."""
    compare_hal: bool = True
    """With --rollout vllm: run the job with --rollout hal after and compare the update times."""
    wire_format: Literal["full", "delta"] = "full"
    """full: every tensor each step; delta: only the values that changed (verl's delta_flush, a full seed first)."""
    hybrid: bool = False
    """verl's hybrid engine: trainer and rollouts on device 0, the trainer offloading all around each update."""
    compare_full: bool = False
    """With --wire-format delta: also publish each step in full before and after, and report delta_vs_full."""
    check_every: int = 0
    """Weight-check every K-th step: each rollout digests its live parameters and the trainer names every tensor
    that differs from what it published (ckpt.checker); 0: never."""
    link_gbit: Annotated[float | None, optional("R", "the host's loopback")] = None
    """Give every process a network namespace joined by emulated links of R Gbit/s each way (root, iproute2)."""
    lora_rank: Annotated[int, tyro.conf.arg(metavar="R")] = 0
    """Train a peft LoRA adapter of rank R on the frozen base (0: train every weight)."""
    lora_alpha: int = 16
    """With --lora-rank: LoRA's alpha (the adapter is scaled by alpha / rank)."""
    lora_targets: Annotated[tuple[str, ...], tyro.conf.arg(metavar="NAME [NAME ...]")] = ()
    """With --lora-rank: the modules the adapter targets (e.g. q_proj v_proj); default every linear layer."""
    lora_publish: Literal["adapter", "merged"] = "adapter"
    """With --lora-rank: adapter publishes the base once, then the adapter alone (peft_config, base_sync_done);
    merged publishes base and adapter merged into whole weights every step."""


LINK_ENGINES = ("collective",)  # bytes cross TCP between processes
# collective across nodes; ipc with every actor on one node (its build_topology refuses two hosts)
RAY_ENGINES = ("collective", "ipc")


def validate(args: Sync) -> None:
    """Check the arguments before any process starts; raises UsageError, MissingFileError or a device error."""
    from hal.apps.weightsync.models import resolve_model

    refuse_flags_without_effect(args)
    for flag, value in (("--rollouts", args.rollouts), ("--trainer-ranks", args.trainer_ranks),
                        ("--steps", args.steps), ("--timeout", args.timeout),
                        ("--lr", args.lr), ("--decode-tokens", args.decode_tokens)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    mib_to_bytes(args.bucket_mb, "--bucket-mb")
    if not args.logits_atol >= 0:
        raise UsageError(f"--logits-atol must be >= 0, got {args.logits_atol}")
    if not args.check_every >= 0:
        raise UsageError(f"--check-every must be >= 0 (0: never), got {args.check_every}")
    if args.check_every and args.rollout == "vllm":
        raise UsageError("--check-every checks hal's rollouts; --rollout vllm verifies each update by its checksums "
                         "before loading it")
    if args.check_every and args.rollout_tp != 1:
        raise UsageError(f"--check-every checks whole-model rollouts; a --rollout-tp {args.rollout_tp} rank keeps "
                         "slices, which each step's per-slice checksums verify")
    resolve_model(args.model)
    if args.file_root is not None and os.path.exists(args.file_root) and not os.path.isdir(args.file_root):
        raise UsageError(f"--file-root {args.file_root} is not a directory (give a directory, new or existing, for "
                         "the file engine's steps)")
    import ckpt

    ok, reason = ckpt.checkpoint_engine_availability(args.engine, args.device)  # each engine's own probe
    if not ok:
        raise UsageError(f"--engine {args.engine} is unavailable here: {reason}")
    if args.compare_full:
        from hal.apps.weightsync.full_reference import REFERENCE_FACT

        if not ckpt.checkpoint_engine_says(args.engine, REFERENCE_FACT):
            raise UsageError(f"--compare-full publishes each step twice, which engines "
                             f"{', '.join(ckpt.checkpoint_engines_where(REFERENCE_FACT))} take; got --engine "
                             f"{args.engine}")
    if args.launcher == "ray" and args.engine not in RAY_ENGINES:
        raise UsageError(f"--launcher ray runs engines {', '.join(RAY_ENGINES)} (collective across nodes, ipc with "
                         f"every actor on one node), got --engine {args.engine}")
    if args.lora_rank:
        validate_lora(args)
    if args.rollout == "vllm":
        if args.wire_format != "full":  # the vLLM role loads whole tensors (reload_weights), not delta flushes
            raise UsageError(f"--rollout vllm takes --wire-format full, got --wire-format {args.wire_format}")
        validate_vllm(args)
    if args.trainer_ranks > 1:
        validate_sharded(args)
    if args.rollout_tp != 1:
        validate_tp(args)
    if args.link_gbit is not None:
        validate_links(args)
    spec = hal.resolve_device(args.device)
    if args.hybrid:
        validate_hybrid(args, spec)
    elif not ckpt.checkpoint_engine_says(args.engine, "one_process") and args.launcher != "ray":  # one local process, and device, per rank
        from hal.apps.cli.launch import require_devices

        require_devices(spec, args.trainer_ranks + args.rollouts,
                        what=f"{args.trainer_ranks} trainer + --rollouts {args.rollouts} processes")


def refuse_flags_without_effect(args: Sync) -> None:
    """Refuse a flag the given combination ignores, naming the flag it needs (``--address`` without ``--launcher
    ray``, ...)."""
    import ckpt
    from hal.apps.weightsync.models import PRESETS, resolve_model

    needs = (("--address", args.address is not None, args.launcher == "ray", "--launcher ray",
              f"--launcher {args.launcher}"),
             ("--placement", args.placement is not None, args.launcher == "ray", "--launcher ray",
              f"--launcher {args.launcher}"),
             ("--compare-full", args.compare_full, args.wire_format == "delta", "--wire-format delta",
              f"--wire-format {args.wire_format}"),
             ("--file-root", args.file_root is not None, ckpt.checkpoint_engine_says(args.engine, "publishes_to_files"),
              f"--engine {' or '.join(ckpt.checkpoint_engines_where('publishes_to_files'))}", f"--engine {args.engine}"),
             ("--no-compare-hal", not args.compare_hal, args.rollout == "vllm", "--rollout vllm",
              f"--rollout {args.rollout}"),
             *((flag, given, args.lora_rank > 0, "--lora-rank R", f"--lora-rank {args.lora_rank}")
               for flag, given in (("--lora-alpha", args.lora_alpha != 16), ("--lora-targets", bool(args.lora_targets)),
                                   ("--lora-publish", args.lora_publish != "adapter"))))
    for flag, given, applies, needed, got in needs:
        if given and not applies:
            raise UsageError(f"{flag} has no effect without {needed} (got {got})")
    if args.publish_dtype != "auto" and resolve_model(args.model) not in PRESETS:
        raise UsageError(f"--publish-dtype applies to a preset --model ({', '.join(sorted(PRESETS))}); "
                         f"{args.model} is published in the dtypes it stores")


def validate_lora(args: Sync) -> None:
    """``--lora-rank R``'s own checks."""
    import importlib.util

    from hal.apps.weightsync.models import PRESETS, resolve_model
    from hal.apps.weightsync.lora import MAX_LORA_RANKS

    flag = f"--lora-rank {args.lora_rank}"
    if args.lora_rank < 0 or args.lora_alpha <= 0:
        raise UsageError(f"--lora-rank and --lora-alpha must be positive, got {args.lora_rank} and {args.lora_alpha}")
    if resolve_model(args.model) not in PRESETS:
        raise UsageError(f"{flag} trains an adapter on a preset's linear layers ({', '.join(sorted(PRESETS))}), got "
                         f"--model {args.model}")
    for name, value, accepted, why in (
            ("--trainer-ranks", args.trainer_ranks, 1, "the adapter is trained and published by one rank"),
            ("--wire-format", args.wire_format, "full", "an adapter update is whole tensors, already small"),
            ("--rollout-tp", args.rollout_tp, 1, "adapters are not resharded across tensor-parallel ranks")):
        if value != accepted:
            raise UsageError(f"{flag} runs with {name} {accepted} ({why}), got {name} {value}")
    if args.rollout == "vllm" and args.lora_publish == "adapter" and args.lora_rank > max(MAX_LORA_RANKS):
        raise UsageError(f"{flag}: vLLM serves adapters up to rank {max(MAX_LORA_RANKS)}")
    if importlib.util.find_spec("peft") is None:
        raise UsageError(f"{flag} needs peft in this environment (the verl extra; scripts/setup_vllm.sh for .venv-vllm)")


def validate_sharded(args: Sync) -> None:
    """``--trainer-ranks N > 1``'s own checks."""
    import ckpt
    from hal.apps.weightsync.models import PRESETS, resolve_model

    flag = f"--trainer-ranks {args.trainer_ranks}"
    resharded = args.rollout_tp > 1 and ckpt.checkpoint_engine_says(args.engine, "supports_reshard")
    if not ckpt.checkpoint_engine_says(args.engine, "supports_multi_sender") and not resharded:
        raise UsageError(f"{flag} needs an engine whose every trainer rank sends (collective; ipc with --rollout-tp), "
                         f"got --engine {args.engine}")
    if args.rollout == "vllm" and args.rollout_tp == 1:  # the vLLM rollout checks a sharded trainer per slice
        raise UsageError(f"{flag} runs with --rollout hal, or --rollout vllm as tensor-parallel servers "
                         f"(--rollout-tp > 1); got --rollout vllm")
    for name, value, accepted in (("--launcher", args.launcher, "torchrun"), ("--wire-format", args.wire_format, "full")):
        if value != accepted:
            raise UsageError(f"{flag} runs with {name} {accepted}, got {name} {value}")
    if resolve_model(args.model) not in PRESETS:
        raise UsageError(f"{flag} trains a preset ({', '.join(sorted(PRESETS))}), got --model {args.model}")


def validate_tp(args: Sync) -> None:
    """``--rollout-tp T``'s own checks."""
    import ckpt
    from hal.apps.weightsync.models import PRESETS, qwen2_config, resolve_model
    from hal.apps.weightsync.tp import check_tp

    flag = f"--rollout-tp {args.rollout_tp}"
    if args.rollout_tp < 1 or args.rollouts % args.rollout_tp:
        raise UsageError(f"{flag} groups the --rollouts ranks into servers of {args.rollout_tp}: --rollouts must be a "
                         f"multiple of it, got --rollouts {args.rollouts}")
    if not ckpt.checkpoint_engine_says(args.engine, "supports_reshard"):
        raise UsageError(f"{flag} sends each rank only its slices, over point-to-point transfers, which --engine "
                         f"{' or '.join(ckpt.checkpoint_engines_where('supports_reshard'))} has; got --engine {args.engine}")
    for name, value, accepted in (("--launcher", args.launcher, "torchrun"), ("--wire-format", args.wire_format, "full")):
        if value != accepted:
            raise UsageError(f"{flag} runs with {name} {accepted}, got {name} {value}")
    if args.hybrid and not args.trainer_ranks == args.rollouts == args.rollout_tp:
        raise UsageError(f"--hybrid {flag} puts trainer rank r and rollout rank r on device r: --trainer-ranks and "
                         f"--rollouts must be {args.rollout_tp}, got {args.trainer_ranks} and {args.rollouts}")
    if resolve_model(args.model) not in PRESETS:
        raise UsageError(f"{flag} splits a preset by its tensor-parallel plan ({', '.join(sorted(PRESETS))}), got "
                         f"--model {args.model}")
    check_tp(qwen2_config(resolve_model(args.model)), args.rollout_tp)


def validate_links(args: Sync) -> None:
    """``--link-gbit R``'s own checks, including whether this machine can build emulated links."""
    from hal.apps.links import link_gbit_to_bps, links_available

    link_gbit_to_bps(args.link_gbit)
    if args.engine not in LINK_ENGINES:
        raise UsageError(f"--link-gbit emulates the network between processes, which --engine "
                         f"{', '.join(LINK_ENGINES)} crosses; got --engine {args.engine}")
    for name, value, accepted in (("--launcher", args.launcher, "torchrun"), ("--rollout", args.rollout, "hal"),
                                  ("--trainer-ranks", args.trainer_ranks, 1), ("--hybrid", args.hybrid, False)):
        if value != accepted:
            raise UsageError(f"--link-gbit runs with {name} {accepted}, got {name} {value}")
    ok, reason = links_available()
    if not ok:
        raise UsageError(f"--link-gbit needs emulated links, which this machine cannot build: {reason}")


def validate_hybrid(args: Sync, spec: Any) -> None:
    """``--hybrid``'s own checks (``spec``: the resolved device kind)."""
    import ckpt

    if spec.host_memory:
        raise UsageError(f"--hybrid puts every rank on one device; the {spec.kind} kind has none (use a device kind, "
                         "e.g. --device npu-sim)")
    if not ckpt.checkpoint_engine_says(args.engine, "ranks_may_share_a_device"):
        raise UsageError(f"--hybrid needs an engine whose trainer and rollouts may share a device "
                         f"({', '.join(ckpt.checkpoint_engines_where('ranks_may_share_a_device'))}), got --engine "
                         f"{args.engine}")
    if args.offload not in ("none", "all"):
        raise UsageError(f"--hybrid offloads the model, gradients and optimizer states (--offload all), got --offload "
                         f"{args.offload}")
    for name, value, accepted in (("--launcher", args.launcher, "torchrun"), ("--rollout", args.rollout, "hal"),
                                  ("--trainer-ranks", args.trainer_ranks, args.rollout_tp)):
        if value != accepted:
            raise UsageError(f"--hybrid runs with {name} {accepted}, got {name} {value}")
    from hal.apps.cli.launch import require_devices

    if args.rollout_tp > 1:
        require_devices(spec, args.rollout_tp, what=f"--hybrid --rollout-tp {args.rollout_tp} (device r: trainer rank r "
                                                    "and rollout rank r)")
    else:
        require_devices(spec, 1, what="--hybrid (every process on device 0)")


def validate_vllm(args: Sync) -> None:
    """``--rollout vllm``'s own checks."""
    import importlib.util

    import ckpt
    from hal.apps.weightsync.models import PRESETS, resolve_model

    if args.launcher != "torchrun":
        raise UsageError(f"--rollout vllm runs under --launcher torchrun, got --launcher {args.launcher}")
    if not ckpt.checkpoint_engine_says(args.engine, "receives_inside_vllm"):
        raise UsageError(f"--rollout vllm receives through --engine "
                         f"{' or '.join(ckpt.checkpoint_engines_where('receives_inside_vllm'))}, got --engine "
                         f"{args.engine}")
    if resolve_model(args.model) not in PRESETS:
        raise UsageError(f"--rollout vllm serves a preset ({', '.join(sorted(PRESETS))}), got --model {args.model}")
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--rollout vllm needs vLLM in this environment (scripts/setup_vllm.sh builds .venv-vllm)")


def job_options(args: Sync) -> JobOptions:
    """The job's options for ``args``: the device kind resolved, a preset by its key, the bucket in bytes."""
    from hal.apps.weightsync.models import resolve_model

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(JobOptions) if hasattr(args, f.name)}
    fields.update(device=hal.resolve_device(args.device).kind, model=resolve_model(args.model),
                  bucket_bytes=mib_to_bytes(args.bucket_mb, "--bucket-mb"), placement=args.placement or "PACK",
                  publish_dtype=None if args.publish_dtype == "auto" else args.publish_dtype,
                  offload="all" if args.hybrid else args.offload)
    return JobOptions(**fields)


def execute(args: Sync) -> dict[str, Any]:
    """Run the job; returns the ``--json`` output (``rows`` per step, ``verified``, ``errors``, ...).

    Raises what :func:`validate` raises, WorkerFailedError naming a failed process, UpdateError (Ray).
    """
    import ckpt
    from hal.apps.weightsync.launchers import launch
    from hal.apps.weightsync.raw import RawReference

    validate(args)
    options = job_options(args)
    start = time.perf_counter()
    vllm = options.rollout == "vllm"
    # the raw broadcast lands in hal's adapter's staging buffer: none in vLLM's worker, a sharded trainer or --hybrid
    # LoRA adapters: the published bytes change from step to step, the staging buffers' do not
    hooks: list[Any] = ([] if options.colocated or vllm or options.sharded or options.hybrid or options.resharded
                        or options.lora_adapters else [RawReference()])
    if options.compare_full:
        from hal.apps.weightsync.full_reference import FullReference

        hooks.append(FullReference())
    result = launch(options, hooks)
    out = {"device": options.device, "engine": options.engine,
           "transport": ckpt.checkpoint_engine_transport(options.engine, hal.resolve_device(options.device)),
           "model": options.model, "offload": options.offload,
           "trainer_ranks": options.trainer_ranks, "rollout_tp": options.rollout_tp, "hybrid": options.hybrid,
           "rollout_apply": options.rollout_apply, "launcher": options.launcher, "rollout": options.rollout,
           "publish_dtype": options.published_dtype, "wire_format": options.wire_format,
           "link_gbit": options.link_gbit,
           "lora": {"rank": options.lora_rank, "alpha": options.lora_alpha, "targets": list(options.lora_targets),
                    "publish": options.lora_publish} if options.lora else None,
           **result.report(options.steps), "wall_s": time.perf_counter() - start}
    if vllm and args.compare_hal:
        from hal.apps.weightsync.vllm_role import update_time_comparison

        hal_result = launch(dataclasses.replace(options, rollout="hal", publish_dtype=options.published_dtype))
        out["compare_hal"] = {**update_time_comparison(result.rows, hal_result.rows),
                              "hal_verified": hal_result.report(options.steps)["verified"]}
    return out


TABLE_WIDTH = 140  # at least; wider where the rows need it


def print_table(result: dict[str, Any]) -> None:
    """Print :func:`execute`'s result as a rich table (a row per step), its mismatches and the verdict."""
    from rich.table import Table

    from hal.apps.cli.tables import console_for
    from hal.apps.weightsync.figures import row_ok

    rows = result["rows"]
    tensors = rows[0]["tensors"] if rows else 0
    model = result["model"]  # a preset name or the path as the user gave it
    transport = f" ({result['transport']})" if result.get("transport") else ""
    table = Table(title=f"hal sync: {model} ({tensors} tensors) on {result['device']}, engine {result['engine']}"
                        f"{transport}, launcher {result.get('launcher', 'torchrun')}, "
                        f"rollout {result.get('rollout', 'hal')}, "
                        f"offload {result['offload']}, rollouts {result['rollout_apply']}"
                        + (f", {result['trainer_ranks']} trainer ranks" if result.get("trainer_ranks", 1) > 1 else "")
                        + (f", rollout TP {result['rollout_tp']}" if result.get("rollout_tp", 1) > 1 else "")
                        + (f", emulated {result['link_gbit']:g} Gbit/s links" if result.get("link_gbit") else "")
                        + (f", LoRA rank {result['lora']['rank']} ({result['lora']['publish']})" if result.get("lora")
                           else ""),
                  caption="publish s: trainer's send until every rollout serves the step; x raw: a raw broadcast "
                          "of the same bytes to the same rollouts (mean of one before and one after the publish), "
                          "its time / publish s (above 1: faster than raw); "
                          "MB = 10^6 bytes; GB: peak resident / stated bound")
    for col in ("step", "loss", "MB", "publish s", "GB/s", "x raw", "offload s", "onload s", "trainer GB",
                "rollout GB", "tokens", "served", "ok"):
        table.add_column(col, justify="right")
    for row in rows:
        served = sorted({r["served_step"] for r in row["rollouts"]}, key=lambda s: (s is None, s))
        ok = row_ok(row)
        peaks = [r.get("peak_host_bytes") for r in row["rollouts"] if r.get("peak_host_bytes")]
        bounds = [r.get("memory_bound_bytes") for r in row["rollouts"] if r.get("memory_bound_bytes")]
        ratio = row.get("ratio_vs_raw")
        table.add_row(str(row["global_steps"]), f"{row['loss']:.6g}", f"{row['bytes'] / 1e6:.0f}",
                      f"{row['publish_s']:.2f}", f"{row['gbps']:.2f}", "-" if ratio is None else f"{ratio:.2f}",
                      f"{row['offload_s']:.2f}", f"{row['onload_s']:.2f}",
                      f"{row['peak_host_bytes'] / 1e9:.2f}/{row['memory_bound_bytes'] / 1e9:.2f}",
                      f"{max(peaks) / 1e9:.2f}/{max(bounds) / 1e9:.2f}" if peaks and bounds else "-",
                      " ".join(map(str, row.get("tokens") or [])) or "-", ",".join(map(str, served)),
                      "[green]yes[/green]" if ok else "[red]NO[/red]")
    console = console_for(table, TABLE_WIDTH)  # 13 columns: a decode of 4 tokens wrapped at 140
    console.print(table)
    if result.get("rollout") == "vllm":
        print_vllm(result, console)
    if rows and rows[-1].get("trainer_ranks"):  # each rank's share of the publish and its peak, last step
        console.print(f"trainer ranks at step {rows[-1]['global_steps']}: " + "; ".join(
            f"rank {t['rank']} published {t['memory']['terms']['published_shard_bytes'] / 1e6:.0f} of "
            f"{rows[-1]['bytes'] / 1e6:.0f} MB, peak {t['peak_host_bytes'] / 1e9:.2f}/{t['memory']['bound_bytes'] / 1e9:.2f} GB"
            for t in rows[-1]["trainer_ranks"]))
    if rows and result.get("rollout_tp", 1) > 1:  # what each tensor-parallel rank received of the model
        console.print("received per rollout rank (of the model's bytes): " + ", ".join(
            f"rank {r['rank']} {r['received_fraction']:.3f}" for r in rows[-1]["rollouts"] if "received_fraction" in r))
    if result.get("lora"):  # what each LoRA publish carried against a merged publish of the same weights
        for row in [result["warmup"], *rows]:
            lora = row["lora"]
            what = "merged weights" if lora["publish"] == "merged" else \
                "the adapter" if lora["base_sync_done"] else "the base and the adapter"
            nbytes, merged = row.get("bytes", row["sent_bytes"]), lora["merged_bytes"]
            console.print(f"step {row.get('global_steps', 0)}: published {what}, {nbytes / 1e6:.2f} MB ("
                          f"{100 * nbytes / merged:.2f}% of a merged publish, {merged / 1e6:.2f} MB) in "
                          f"{row['publish_s']:.3f} s")
    if result.get("wire_format") == "delta":  # what each delta update put on the wire
        for row in rows:
            ratio = row.get("delta_vs_full")
            console.print(f"step {row['global_steps']}: sent {row['sent_bytes'] / 1e6:.2f} of {row['dense_bytes'] / 1e6:.2f} MB"
                          f" ({100 * row['changed_fraction']:.2f}% of values changed){', a full seed' if row['seed'] else ''}"
                          + ("" if ratio is None else f"; {delta_versus_full(ratio)}"))
    checked = [row for row in rows if row.get("check") is not None]
    if checked:  # --check-every: the weight checker's verdict per checked step
        console.print("weight check: " + "; ".join(
            f"step {row['global_steps']} {'differs' if row['check']['mismatches'] else 'matches'} on "
            f"{row['check']['checked']} rollout(s)" for row in checked))
    for error in result["errors"]:
        console.print(f"[red]failed:[/red] {error}")
    how = "tokens, logits and checksums" if rows and rows[0].get("tokens") else "checksums"
    console.print(f"[green]every step verified ({how}), {result['wall_s']:.1f} s[/green]" if result["verified"]
                  else "[red]verification failed[/red]")


def delta_versus_full(ratio: float) -> str:
    """``delta_vs_full`` in words that say which way (``"delta publish 5.48x slower than a full publish ..."``)."""
    if ratio > 1:
        return f"delta publish {ratio:.2f}x slower than a full publish of the same weights"
    return f"delta publish {1 / ratio:.2f}x faster than a full publish of the same weights"


def print_vllm(result: dict[str, Any], console: Any) -> None:
    """With --rollout vllm: vLLM's start-up and peak memory per rollout; the update's time inside vLLM per step."""
    from rich.table import Table

    rows = result["rows"]
    first = {r["rank"]: r for r in rows[0]["rollouts"]} if rows else {}
    peaks = {rank: max(row_r.get("peak_host_bytes") or 0 for row in rows for row_r in row["rollouts"]
                       if row_r["rank"] == rank) for rank in first}
    console.print("vLLM rollouts (in-process, published " + str(result.get("publish_dtype")) + "): " + "; ".join(
        f"rank {rank}: start-up {r['vllm']['startup_s']:.1f} s, peak {peaks[rank] / 1e9:.2f} GB"
        for rank, r in first.items() if r.get("vllm")))
    compare = {s["global_steps"]: s for s in (result.get("compare_hal") or {}).get("steps", [])}
    table = Table(title="the update inside vLLM (mean over rollouts) against hal's adapter, same bytes",
                  caption="vLLM: receive into its worker + CRC-32, then reload_weights; hal: receive + apply")
    for col in ("step", "MB", "vLLM receive s", "vLLM load s", "vLLM s", "hal s", "vLLM / hal"):
        table.add_column(col, justify="right")
    for row in rows:
        got = [r["vllm"] for r in row["rollouts"] if r.get("vllm")]
        c = compare.get(row["global_steps"])
        table.add_row(str(row["global_steps"]), f"{row['bytes'] / 1e6:.1f}",
                      f"{sum(g['receive_s'] for g in got) / len(got):.4f}",
                      f"{sum(g['load_s'] for g in got) / len(got):.4f}",
                      f"{sum(g['receive_s'] + g['load_s'] for g in got) / len(got):.4f}",
                      "-" if c is None else f"{c['hal_update_s']:.4f}", "-" if c is None else f"{c['ratio']:.2f}")
    console.print(table)


def run(args: Sync) -> int:
    """``hal sync``: run the job, print the table (or ``--json``); exit status 0 when every step verified, else 1."""
    result = execute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if args.file_root is not None:  # accepted only with an engine that publishes to files
        print(f"hal sync: the {args.engine} engine's last steps are kept in {args.file_root} (--file-root)", file=sys.stderr)
    if not result["verified"]:
        print(f"hal sync: {len(result['errors'])} failure(s); first: {result['errors'][:1]}", file=sys.stderr)
        return 1
    return 0
