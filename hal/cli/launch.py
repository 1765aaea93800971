"""``hal launch``: start a script on N processes of one device kind through ``torch.distributed.run``.

    hal launch --device npu --nproc-per-node 8 -- train.py --lr 1e-5

The kind is resolved (and refused with a clear message when unavailable) before anything starts; each
process then gets ``HAL_DEVICE`` and the kind's visible-devices variable, plus the ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``/``MASTER_*`` variables that ``torch.distributed.run`` sets, so the same script runs unchanged
per device kind and across nodes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

import tyro

import hal


@dataclasses.dataclass
class Launch:
    """Start SCRIPT on --nproc-per-node processes of --device through torch.distributed.run (after '--')."""

    device: str | None = None
    """Device kind (npu, cuda, cpu, npu-sim, a plugin kind); default $HAL_DEVICE, else the first available."""
    nproc_per_node: int = 1
    """Processes on this node."""
    nnodes: str = "1"
    """Number of nodes, or MIN:MAX for elastic jobs (passed to torch.distributed.run)."""
    node_rank: int = 0
    """This node's rank (static rendezvous)."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous; empty means a local standalone rendezvous."""
    rdzv_backend: str = "c10d"
    """torch.distributed.run rendezvous backend."""
    rdzv_id: str = "hal"
    """Job id shared by all nodes."""
    visible_devices: str | None = None
    """Value for the kind's visible-devices variable; default: keep it if set, else 0..nproc_per_node-1."""
    max_restarts: int = 0
    """Restarts of failed workers before the job fails."""
    script: tyro.conf.Suppress[tuple[str, ...]] = ()
    """The script and its arguments, given after '--' (filled by hal.cli.main, not a flag)."""


def torchrun_argv(args: Launch) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``args`` (pure; tested directly).

    Raises:
        ValueError: no script, or ``nproc_per_node < 1``.
    """
    if not args.script:
        raise ValueError("hal launch needs a script after '--', e.g. hal launch --nproc-per-node 2 -- train.py")
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}",
            f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint:
        argv += [f"--rdzv-backend={args.rdzv_backend}", f"--rdzv-endpoint={args.rdzv_endpoint}",
                 f"--rdzv-id={args.rdzv_id}", f"--node-rank={args.node_rank}"]
    else:
        argv += ["--standalone"]
    return argv + list(args.script)


def launch_env(args: Launch) -> dict[str, str]:
    """The variables every launched process gets: ``HAL_DEVICE`` and the kind's visible-devices variable.

    Raises:
        UnknownDeviceError, DeviceUnavailableError: the kind cannot be used here.
    """
    spec = hal.resolve_device(args.device)
    env = {hal.ENV_VAR: spec.kind}
    key = spec.visible_devices_env
    if key:
        value = args.visible_devices or os.environ.get(key) or ",".join(str(i) for i in range(args.nproc_per_node))
        env[key] = value
    return env


def run(args: Launch) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    argv = torchrun_argv(args)
    if args.script[0].endswith(".py") and not pathlib.Path(args.script[0]).is_file():
        raise FileNotFoundError(f"hal launch: script {args.script[0]!r} does not exist")
    os.environ.update(launch_env(args))  # torch.distributed.run passes its environment to every worker
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"hal launch: {exc.name} failed on rank {rank} with exit code {failure.exitcode}"
              f"{f' ({failure.message})' if failure.message else ''}", file=sys.stderr)
        return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    return 0
