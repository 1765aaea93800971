"""Start a benchmark's ranks with torch.distributed's elastic launcher (what ``torchrun`` runs), on this node.

A benchmark that measures between processes writes one function ``fn(rank, world_size, *args)``, run in
``world_size`` fresh (spawned) processes; each returns its figures, and :func:`run_ranks` hands back
``{rank: figures}``. The ranks find each other through the launcher's own store (:func:`launcher_store`), and
a checkpoint engine's group forms by verl's lifecycle over it (:func:`join_engine`): the engine's master says
in ``prepare()`` where its rendezvous is, already hosted on a port the kernel picked, so the benchmark chooses
no port.

Every rank also has a deadline: past ``timeout`` seconds it writes every thread's stack to stderr and
exits, so a rank waiting on a dead peer fails the run within it (the launcher then stops the others and
raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` naming the first rank that
failed and how).
"""

from __future__ import annotations

import faulthandler
import json
import os
import uuid
from typing import Any, Callable

STORE_PREFIX = "hal-bench"
"""The benchmark's keys in the launcher's store, apart from the launcher's own (``torchelastic/...``)."""


def launcher_store(timeout: float = 120.0) -> Any:
    """The launcher's store, as the job's ranks reach it (:func:`hal.apps.weightsync.launchers.torchrun.job_store`:
    the elastic agent's, or rank 0's where the agent does not share it), under :data:`STORE_PREFIX`.

    Raises:
        KeyError: not a rank :func:`run_ranks` (or ``torchrun``) started.
        hal.DistributedTimeoutError: the store did not answer within ``timeout`` seconds.
    """
    from hal.apps.weightsync.launchers.torchrun import job_store

    return job_store(timeout, STORE_PREFIX)


def join_engine(engine: Any, rank: int, world_size: int, store: Any, key: str) -> None:
    """Form ``engine``'s group as verl's ``CheckpointEngineManager`` does: ``prepare()`` on every rank, the
    metadata gathered through ``store`` (under ``key``), ``build_topology(1, world_size - 1, metadata)``, then
    ``init_process_group`` with this rank's keywords (:func:`ckpt.manager.rank_kwargs`). Rank 0 is the trainer
    (its engine made with ``is_master=True``, so its ``prepare()`` reports where its rendezvous is), the others
    rollouts. Raises what the engine's lifecycle raises (``ckpt.CheckpointError``)."""
    from ckpt.manager import rank_kwargs

    store.set(f"{key}/meta/{rank}", json.dumps(engine.prepare()))
    metadata = [json.loads(store.get(f"{key}/meta/{r}")) for r in range(world_size)]
    engine.init_process_group(**rank_kwargs(type(engine), 1, world_size - 1, metadata)[rank])


def rank_main(fn: Callable[..., Any], timeout: float, args: tuple) -> Any:
    """What each launched process runs: ``fn(RANK, WORLD_SIZE, *args)`` under a deadline of ``timeout`` s;
    SIGINT and SIGTERM end it quietly (:func:`hal.apps.shutdown.quiet_rank_exit`)."""
    from hal.apps.shutdown import quiet_rank_exit

    quiet_rank_exit()
    faulthandler.dump_traceback_later(timeout, exit=True)  # stacks on stderr, then exit: never a hang
    try:
        return fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float, name: str) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; returns ``{rank: its return}``.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function). The processes are spawned, never
    forked, so each one's memory figures (``VmHWM``, ``ru_maxrss``) count only what the benchmark did.

    The launcher's logs go to a directory removed when the call returns or raises; on Ctrl-C the ranks are
    stopped and the ``KeyboardInterrupt`` propagates (:mod:`hal.apps.shutdown`).

    Args:
        timeout: seconds each rank may run; past it the rank dumps its stacks and exits, failing the run.
        name: the run's name in the launcher's logs (``hal-bench-<name>-<random>``).

    Raises:
        ValueError: ``world_size`` below 1 or ``timeout`` not positive.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank raised, was killed or
            passed its deadline; ``get_first_failure()`` says which and how.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hal.apps.shutdown import (LAUNCH_SHUTDOWN_TIMEOUT_S, OWN_LAUNCH_SIGNALS, elastic_logs, own_elastic_launch,
                                   scratch_dir)

    if world_size < 1 or not timeout > 0:
        raise ValueError(f"world_size must be >= 1 and timeout > 0, got world_size={world_size}, timeout={timeout}")
    with scratch_dir("hal-elastic-") as logs, own_elastic_launch(logs):
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                              run_id=f"hal-bench-{name}-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", rdzv_configs={"join_timeout": int(timeout)},
                              max_restarts=0, monitor_interval=0.1, start_method="spawn",
                              logs_specs=elastic_logs(logs), shutdown_timeout=LAUNCH_SHUTDOWN_TIMEOUT_S,
                              signals_to_handle=OWN_LAUNCH_SIGNALS)
        return elastic_launch(config, rank_main)(fn, timeout, args)
