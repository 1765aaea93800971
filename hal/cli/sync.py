"""``hal sync``: the RL weight-sync loop a user runs first.

One trainer rank and ``--rollouts`` rollout ranks on one device kind. Each of ``--steps`` steps:

1. the trainer engine takes a real optimizer step on a synthetic batch;
2. it offloads per ``--offload`` (none / optimizer / model / all) to the host;
3. it publishes its weights tagged with ``global_steps`` through the chosen checkpoint engine;
4. every rollout receives them, checks the step and a per-tensor checksum (BLAKE2b of the tensor's bytes)
   against the trainer's, and applies them (all-or-nothing, through ``ckpt.InMemoryRolloutAdapter``);
5. the trainer onloads what it offloaded.

``--engine collective``, ``file``, ``nixl``, ``mooncake`` and ``kimi`` run the ranks as separate processes started by
``torch.distributed.launcher`` (the library behind ``torch.distributed.run``); ``colocated`` runs trainer
and rollouts in one process, as a colocated deployment does. Processes coordinate the checksums and
per-step results through a ``torch.distributed`` TCPStore on the loopback address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import sys
import tempfile
import time
import uuid
from typing import Any, Literal

import torch

import hal
from hal.cli.errors import UsageError

OFFLOAD_FLAGS: dict[str, dict[str, bool]] = {
    # what to.("cpu", ...) moves for each --offload choice; grad moves only with the model (verl's rule)
    "none": {},
    "optimizer": {"model": False, "optimizer": True, "grad": False},
    "model": {"model": True, "optimizer": False, "grad": True},
    "all": {"model": True, "optimizer": True, "grad": True},
}


@dataclasses.dataclass
class Sync:
    """Run an RL weight-sync loop: train, offload, publish with global_steps, receive and verify, onload."""

    device: str | None = None
    """Device kind (npu, cuda, cpu, npu-sim, ...); default $HAL_DEVICE, else the first available."""
    model: str = "qwen2.5-0.5b"
    """A preset (qwen2.5-0.5b: the Qwen2.5-0.5B tensor layout, bf16, about 1 GB; qwen2.5-tiny: same layout,
    small) or a path to a .safetensors file or a directory of them."""
    rollouts: int = 2
    """Rollout ranks receiving each step."""
    steps: int = 3
    """Training steps, each published as global_steps 1..steps."""
    offload: Literal["none", "optimizer", "model", "all"] = "none"
    """What the trainer offloads to the host between its step and the next."""
    engine: Literal["collective", "file", "colocated", "nixl", "mooncake", "kimi"] = "collective"
    """Checkpoint engine publishing the weights (nixl, mooncake, kimi: where ``hal info`` lists them available)."""
    bucket_mb: float = 256.0
    """Bucket size of the bucketed engines (collective, nixl, mooncake), in MiB."""
    lr: float = 1e-4
    """AdamW learning rate."""
    timeout: float = 300.0
    """Seconds any rendezvous, transfer or wait may take before it is an error."""
    file_root: str | None = None
    """Directory of the file engine (default: a temporary one)."""
    json: bool = False
    """Print the per-step results as JSON on stdout (progress goes to stderr)."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Who starts the ranks: torchrun (one machine), or Ray actors placed by the kind's Ray resource (engine
    collective); see hal.cli.sync_ray."""
    address: str | None = None
    """With --launcher ray: the cluster, 'auto' or HOST:PORT; default: start a one-node cluster for the run."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """With --launcher ray: how the trainer's and rollouts' bundles are placed across nodes."""


def validate(args: Sync) -> None:
    """Check the arguments before any process starts.

    Raises:
        UsageError: a count or size is not positive (names the flag and value).
        MissingFileError: ``--model`` is neither a preset nor a safetensors file/directory.
        UnknownDeviceError, DeviceUnavailableError: ``--device`` cannot be used here.
        DeviceIndexError: fewer visible devices than local processes (trainer + rollouts).
    """
    from hal.cli.models import PRESETS, safetensors_files

    for flag, value in (("--rollouts", args.rollouts), ("--steps", args.steps), ("--bucket-mb", args.bucket_mb),
                        ("--timeout", args.timeout), ("--lr", args.lr)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.model not in PRESETS:
        safetensors_files(pathlib.Path(args.model))
    if args.engine in ("nixl", "mooncake", "kimi"):
        import ckpt

        ok, reason = ckpt.checkpoint_engine_availability(args.engine)
        if not ok:
            raise UsageError(f"--engine {args.engine} is unavailable here: {reason}")
    if args.launcher == "ray" and args.engine != "collective":
        raise UsageError(f"--launcher ray runs the collective engine across nodes, got --engine {args.engine}")
    spec = hal.resolve_device(args.device)
    if args.engine != "colocated" and args.launcher != "ray":  # one local process, and device, per rank
        from hal.cli.launch import require_devices

        require_devices(spec, 1 + args.rollouts, what=f"1 trainer + --rollouts {args.rollouts} processes")


def checksums(weights) -> dict[str, str]:
    """``{name: BLAKE2b-128 hex digest of the tensor's bytes}``, in iteration order (host copies as needed)."""
    out = {}
    for name, tensor in weights:
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.blake2b(data.tobytes() if data.size == 0 else data, digest_size=16).hexdigest()
    return out


def first_mismatch(expected: dict[str, str], got: dict[str, str]) -> str | None:
    """A sentence naming the first tensor that differs, is missing or is unexpected; ``None`` if equal."""
    for name, digest in expected.items():
        if name not in got:
            return f"tensor {name!r} was not received"
        if got[name] != digest:
            return f"tensor {name!r}: checksum {got[name]} differs from the trainer's {digest}"
    extra = sorted(set(got) - set(expected))
    return f"tensor {extra[0]!r} was received but not sent" if extra else None


def verify(adapter, step: int, expected: dict[str, str]) -> str | None:
    """What is wrong with a rollout after receiving ``step``: the step it serves, else the first tensor
    whose checksum differs from the trainer's; ``None`` when it serves ``step`` byte-exact."""
    if adapter.served_step != step:
        return f"rollout serves step {adapter.served_step}, expected {step}"
    return first_mismatch(expected, checksums(adapter.state_dict().items()))


def _peak_host_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class _Trainer:
    """Rank 0: a TorchEngine with AdamW on the chosen kind."""

    def __init__(self, args: Sync) -> None:
        from hal.cli.models import build
        from engines import TorchEngine

        self.kind = hal.resolve_device(args.device).kind
        module, self.loss_fn = build(args.model)
        # TorchEngine moves parameters in place, so the optimizer may be built on the host module first.
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr)
        self.engine = TorchEngine(module, optimizer, device=self.kind)
        self.flags = OFFLOAD_FLAGS[args.offload]

    def step(self) -> dict[str, Any]:
        start = time.perf_counter()
        loss = self.engine.train_step(self.loss_fn)
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        if self.flags:
            self.engine.to("cpu", **self.flags)
        offload_s = time.perf_counter() - start
        return {"loss": loss, "train_s": train_s, "offload_s": offload_s,
                "placement": dataclasses.asdict(self.engine.placement())}

    def finish(self, row: dict[str, Any]) -> dict[str, Any]:
        """Onload what ``step`` offloaded and add the onload time and peak memory figures to ``row``."""
        start = time.perf_counter()
        if self.flags:
            self.engine.to(self.kind, **self.flags)
        row["onload_s"] = time.perf_counter() - start
        row["peak_device_bytes"] = hal.memory_stats(self.kind)["max_allocated"]
        row["peak_host_bytes"] = _peak_host_bytes()
        return row

    def sums(self) -> tuple[dict[str, str], int]:
        total, sums = 0, {}
        for name, tensor in self.engine.get_per_tensor_param()[0]:
            sums.update(checksums([(name, tensor)]))
            total += tensor.numel() * tensor.element_size()
        return sums, total


def _make_checkpoint_engine(args: Sync, rank: int, world_size: int, port: int, root: str):
    import ckpt

    if args.engine in ("collective", "nixl", "mooncake", "kimi"):
        return ckpt.get_checkpoint_engine(args.engine, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                          master_port=port, bucket_size=int(args.bucket_mb * (1 << 20)),
                                          device=hal.resolve_device(args.device).kind, timeout=args.timeout)
    return ckpt.get_checkpoint_engine("file", root=root, keep_last=2, device=hal.resolve_device(args.device).kind,
                                      timeout=args.timeout)


def _release(engine) -> None:
    """End of the run: verl's per-update ``finalize()``, then ``close()`` (the group too) where there is one."""
    engine.finalize()
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False)


def _rank_main(args_dict: dict[str, Any], ckpt_port: int, ctl_port: int, root: str) -> dict[str, Any]:
    """One process of a multi-process sync: rank 0 trains and publishes, the others receive and verify."""
    args = Sync(**args_dict)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hal.bind_local_device(args.device)  # one device per rank: LOCAL_RANK's
    store = hal.connect_store("127.0.0.1", ctl_port, rank, world_size, timeout=args.timeout)
    engine = _make_checkpoint_engine(args, rank, world_size, ckpt_port, root)
    if rank == 0:
        return asyncio.run(_trainer_loop(args, engine, store, world_size))
    return asyncio.run(_rollout_loop(args, engine, store, rank))


async def _trainer_loop(args: Sync, engine, store, world_size: int) -> dict[str, Any]:
    import ckpt

    trainer = _Trainer(args)
    publisher = ckpt.TrainerWorker(trainer.engine, engine)
    rows = []
    with _progress() as progress:
        task = progress.add_task("sync", total=args.steps)
        for step in range(1, args.steps + 1):
            progress.update(task, description=f"step {step}: train")
            row = {"global_steps": step, **trainer.step()}
            sums, nbytes = trainer.sums()
            store.set(f"sums/{step}", json.dumps(sums))
            progress.update(task, description=f"step {step}: publish")
            hal.synchronize(trainer.kind)
            start = time.perf_counter()
            await publisher.update_weights(step)
            row["publish_s"] = time.perf_counter() - start
            row["bytes"] = nbytes
            row["tensors"] = len(sums)
            results = [json.loads(store.get(f"result/{step}/{r}")) for r in range(1, world_size)]
            row["rollouts"] = results
            rows.append(trainer.finish(row))
            progress.advance(task)
    _release(engine)
    return {"rows": rows}


async def _rollout_loop(args: Sync, engine, store, rank: int) -> dict[str, Any]:
    import ckpt

    adapter = ckpt.InMemoryRolloutAdapter()
    worker = ckpt.CheckpointEngineWorker(engine, adapter)
    for step in range(1, args.steps + 1):
        result: dict[str, Any] = {"rank": rank, "served_step": None, "error": None}
        start = time.perf_counter()
        try:
            await worker.update_weights(step)
            result["receive_s"] = time.perf_counter() - start
            result["served_step"] = adapter.served_step
            result["error"] = verify(adapter, step, json.loads(store.get(f"sums/{step}")))
        except hal.HalError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["peak_host_bytes"] = _peak_host_bytes()
        store.set(f"result/{step}/{rank}", json.dumps(result))
        if result["error"]:
            break
    _release(engine)
    return {"rank": rank}


async def _colocated(args: Sync) -> dict[str, Any]:
    """Trainer and ``args.rollouts`` rollouts in this process, one colocated engine per rollout."""
    import ckpt

    trainer = _Trainer(args)
    channels = [ckpt.get_checkpoint_engine("colocated") for _ in range(args.rollouts)]
    adapters = [ckpt.InMemoryRolloutAdapter() for _ in channels]
    rows = []
    with _progress() as progress:
        task = progress.add_task("sync", total=args.steps)
        for step in range(1, args.steps + 1):
            row = {"global_steps": step, **trainer.step()}
            sums, nbytes = trainer.sums()
            start = time.perf_counter()
            sends = [ckpt.TrainerWorker(trainer.engine, ch).update_weights(step) for ch in channels]
            receives = [ckpt.CheckpointEngineWorker(ch, ad).update_weights(step) for ch, ad in zip(channels, adapters)]
            await asyncio.gather(*sends, *receives)
            row.update(publish_s=time.perf_counter() - start, bytes=nbytes, tensors=len(sums))
            row["rollouts"] = [{"rank": i + 1, "served_step": ad.served_step, "error": verify(ad, step, sums)}
                               for i, ad in enumerate(adapters)]
            rows.append(trainer.finish(row))
            progress.advance(task)
    return {"rows": rows}


def execute(args: Sync) -> dict[str, Any]:
    """Run the loop; returns ``{"rows": [...per step...], "verified": bool, "errors": [...]}``.

    Raises what :func:`validate` raises, and ``RuntimeError`` when a rank process fails.
    """
    validate(args)
    kind = hal.resolve_device(args.device).kind
    if args.launcher == "ray":
        from hal.cli.sync_ray import execute_ray

        result = execute_ray(args)
    elif args.engine == "colocated":
        result = asyncio.run(_colocated(args))
    else:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from hal.distributed import pick_port

        os.environ[hal.ENV_VAR] = kind
        root = args.file_root or tempfile.mkdtemp(prefix="hal-sync-")
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1 + args.rollouts,
                              run_id=f"hal-sync-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                              start_method="spawn")
        ckpt_port, ctl_port = pick_port(), pick_port()
        if ckpt_port == ctl_port:
            raise RuntimeError(f"could not find two free ports (got {ckpt_port} twice)")
        try:
            per_rank = elastic_launch(config, _rank_main)(dataclasses.asdict(args), ckpt_port, ctl_port, root)
        except ChildFailedError as exc:
            raise RuntimeError(f"a sync process failed: {exc.format_msg()}") from None
        result = per_rank[0]
    errors = [f"step {row['global_steps']}, rollout rank {r['rank']}: {r['error']}"
              for row in result["rows"] for r in row["rollouts"] if r["error"]]
    verified = not errors and len(result["rows"]) == args.steps
    return {"device": kind, "engine": args.engine, "model": args.model, "offload": args.offload,
            "launcher": args.launcher, **{k: v for k, v in result.items() if k != "rows"},
            "rows": result["rows"], "verified": verified, "errors": errors}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["rows"]
    tensors = rows[0]["tensors"] if rows else 0
    model = pathlib.Path(result["model"]).name
    table = Table(title=f"hal sync: {model} ({tensors} tensors) on {result['device']}, "
                        f"engine {result['engine']}, offload {result['offload']}")
    # publish = send until every rollout holds the step; peak = device max_allocated / host max RSS
    for col in ("step", "loss", "MB", "publish s", "GB/s", "offload s", "onload s", "dev MB", "host MB",
                "served", "ok"):
        table.add_column(col, justify="right")
    for row in rows:
        served = sorted({r["served_step"] for r in row["rollouts"]}, key=lambda s: (s is None, s))
        ok = all(r["error"] is None for r in row["rollouts"])
        table.add_row(str(row["global_steps"]), f"{row['loss']:.4g}", f"{row['bytes'] / 1e6:.0f}",
                      f"{row['publish_s']:.2f}", f"{row['bytes'] / row['publish_s'] / 1e9:.2f}",
                      f"{row['offload_s']:.2f}", f"{row['onload_s']:.2f}", f"{row['peak_device_bytes'] / 1e6:.0f}",
                      f"{row['peak_host_bytes'] / 1e6:.0f}", ",".join(map(str, served)),
                      "[green]yes[/green]" if ok else "[red]NO[/red]")
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
    for error in result["errors"]:
        console.print(f"[red]mismatch:[/red] {error}")
    console.print("[green]every step verified[/green]" if result["verified"] else "[red]verification failed[/red]")


def run(args: Sync) -> int:
    result = execute(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if not result["verified"]:
        print(f"hal sync: {len(result['errors'])} mismatch(es); first: {result['errors'][:1]}", file=sys.stderr)
        return 1
    return 0
