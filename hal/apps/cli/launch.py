"""``hal launch``: start a script on N processes of one device kind through ``torch.distributed.run``.

    hal launch --device npu --nproc-per-node 8 -- train.py --lr 1e-5

Each process gets ``HAL_DEVICE`` and the kind's visible-devices variable besides torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_*``, so the same script runs unchanged on every kind.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from typing import Annotated

import tyro

import hal
from hal.apps.errors import MissingFileError, UsageError, worker_failed
from hal.apps.cli.helptext import DEVICE_DEFAULT, flowing_help, optional


@flowing_help
@dataclasses.dataclass
class Launch:
    """Start SCRIPT, given after '--' with its own arguments, on --nproc-per-node processes of --device
    through torch.distributed.run."""

    device: Annotated[str | None, optional("KIND", DEVICE_DEFAULT)] = None
    """Device kind (npu, cuda, cpu, npu-sim, a plugin kind)."""
    nproc_per_node: int = 1
    """Processes on this node."""
    nnodes: str = "1"
    """Number of nodes N >= 1, or MIN:MAX for elastic jobs; more than one node needs --rdzv-endpoint."""
    node_rank: int = 0
    """This node's rank (static rendezvous)."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous every node joins; empty: a local standalone rendezvous (one node)."""
    rdzv_backend: str = "c10d"
    """torch.distributed.run rendezvous backend."""
    rdzv_id: str = "hal"
    """Job id shared by all nodes."""
    visible_devices: Annotated[str | None, optional("LIST", "keep it if set, else 0..nproc_per_node-1")] = None
    """Value for the kind's visible-devices variable (comma-separated device indices)."""
    max_restarts: int = 0
    """Restarts of failed workers before the job fails."""
    script: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(
        metavar="-- SCRIPT [ARGS...]", help_behavior_hint="(required)")] = ()
    """The script and its arguments, after '--': everything after it goes to the script, flags included."""


def torchrun_argv(args: Launch) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``args``; UsageError for a bad count or a missing endpoint."""
    if not args.script:
        raise UsageError("hal launch needs a script after '--', e.g. hal launch --nproc-per-node 2 -- train.py")
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if parse_nnodes(args.nnodes) != (1, 1) and not args.rdzv_endpoint:
        raise UsageError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the rendezvous every node joins (the same "
            "on each node, with its own --node-rank); without it no other node could join")
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}",
            f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint:
        argv += [f"--rdzv-backend={args.rdzv_backend}", f"--rdzv-endpoint={args.rdzv_endpoint}",
                 f"--rdzv-id={args.rdzv_id}", f"--node-rank={args.node_rank}"]
    else:
        argv += ["--standalone"]
    return argv + list(args.script)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``(min, max)`` nodes of an ``--nnodes`` value (``"N"`` or ``"MIN:MAX"``)."""
    low, sep, high = str(value).partition(":")
    try:
        pair = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise UsageError(f"--nnodes must be a node count N or MIN:MAX, got {value!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise UsageError(f"--nnodes {value!r}: the node count must be >= 1 (MIN:MAX: 1 <= MIN <= MAX)")
    return pair


def launch_env(args: Launch) -> dict[str, str]:
    """The variables every launched process gets: ``HAL_DEVICE`` and the kind's visible-devices variable.

    Each process uses the device of its ``LOCAL_RANK``, so a node needs one visible device per process
    (DeviceIndexError before anything starts).
    """
    spec = hal.resolve_device(args.device)
    if hal.split_device(args.device)[1] is not None:
        given = f"--device {args.device!r}" if args.device is not None else \
            f"{hal.ENV_VAR}={os.environ.get(hal.ENV_VAR)!r}"
        raise hal.DeviceIndexError(
            f"{given}: hal launch binds each process to the device of its LOCAL_RANK; give the "
            f"kind without an index ({spec.kind!r}) and choose devices with --visible-devices")
    env = {hal.ENV_VAR: spec.kind}
    visible = require_devices(spec, args.nproc_per_node, args.visible_devices)
    if spec.visible_devices_env:
        env[spec.visible_devices_env] = visible
    return env


def require_devices(spec, nproc: int, visible_devices: str | None = None, what: str | None = None) -> str:
    """Check that ``nproc`` processes of one node get a device each; return the visible-devices value to pass.
    Host-memory kinds serve any number; DeviceIndexError names the variable, its value and the count."""
    key = spec.visible_devices_env
    given = visible_devices if visible_devices is not None else os.environ.get(key) if key else None
    if given is not None:
        count = len([v for v in given.split(",") if v.strip()])
        where = f"{key}={given!r}" if key else f"--visible-devices={given!r}"
    else:
        count = hal.availability(spec.kind).device_count
        where = f"{key} unset, the {spec.kind} kind reports {count} device(s) here" if key else \
            f"the {spec.kind} kind reports {count} device(s) here"
    if nproc > count and not spec.host_memory:  # host memory serves any number of processes
        raise hal.DeviceIndexError(
            f"{what or f'--nproc-per-node {nproc}'} needs one device per process, but {count} device(s) are "
            f"visible ({where}); start at most {count} processes or make more devices visible")
    return given if given is not None else ",".join(str(i) for i in range(nproc))


def run(args: Launch) -> int:
    """``hal launch``: run the script through ``torch.distributed.run``; exit status 0, or a failed rank's (1 when
    killed by a signal). Ctrl-C or SIGTERM stops the ranks as torchrun does."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from hal.apps.shutdown import own_elastic_launch, scratch_dir

    argv = torchrun_argv(args)
    if args.script[0].endswith(".py") and not pathlib.Path(args.script[0]).is_file():
        raise MissingFileError(f"hal launch: script {args.script[0]!r} does not exist")
    os.environ.update(launch_env(args))  # torch.distributed.run passes its environment to every worker
    try:
        # the script's processes are the user's: the agent forwards Ctrl-C to them as torchrun does
        with scratch_dir("hal-elastic-") as logs, own_elastic_launch(logs):
            torchrun(get_args_parser().parse_args([f"--log-dir={logs}", *argv]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        group = exc.name
        print(worker_failed(exc, lambda r: f"rank {r} of {group}", "hal launch"), file=sys.stderr)
        return failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    return 0
