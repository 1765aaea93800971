"""Start a benchmark's ranks with torch.distributed's elastic launcher (what ``torchrun`` runs), on this node.

A benchmark that measures between processes writes one function ``fn(rank, world_size, *args)``, run in
``world_size`` fresh (spawned) processes; each returns its figures, and :func:`run_ranks` hands back
``{rank: figures}``. The ranks find each other on ports the caller picked with :func:`free_ports` (rank 0
hosts a store there: :func:`hal.connect_store`), not on the launcher's own rendezvous, so a benchmark's
groups are the same standalone groups the checkpoint engines build.

Every rank also has a deadline: past ``timeout`` seconds it writes every thread's stack to stderr and
exits, so a rank waiting on a dead peer fails the run within it (the launcher then stops the others and
raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` naming the first rank that
failed and how).
"""

from __future__ import annotations

import faulthandler
import os
import uuid
from typing import Any, Callable

from hal.distributed import pick_port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that the operating system reported free a moment ago.

    Raises:
        RuntimeError: the operating system handed out fewer than ``n`` distinct ports in ``4 * n`` tries.
    """
    ports: list[int] = []
    for _ in range(4 * n):
        port = pick_port(host)
        if port not in ports:
            ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"could not find {n} distinct free ports on {host} (got {ports})")


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
