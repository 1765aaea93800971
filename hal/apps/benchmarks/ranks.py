"""Start a benchmark's ranks on this node with the tests' harness (:func:`hal.apps.multiprocess.run_multiprocess`).

A benchmark writes ``fn(rank, world_size, *args)``; :func:`run_ranks` runs it in fresh spawned processes and
returns ``{rank: figures}``. Ranks meet on the store the caller hosts (:func:`launcher_store`); past the
deadline every rank's stacks are taken and the ranks killed.
"""

from __future__ import annotations

from typing import Any, Callable

STORE_PREFIX = "hal-bench"  # apart from the launcher's own keys


def launcher_store(timeout: float = 120.0) -> Any:
    """The launcher's store under :data:`STORE_PREFIX` (DistributedTimeoutError after ``timeout`` seconds)."""
    import hal

    return hal.launcher_store(timeout, STORE_PREFIX)


def rank_main(rank: int, world_size: int, fn: Callable[..., Any], args: tuple) -> Any:
    """What each started process runs: ``fn(rank, world_size, *args)``, ending quietly on SIGINT and SIGTERM."""
    from hal.apps.shutdown import quiet_rank_exit

    quiet_rank_exit()
    return fn(rank, world_size, *args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; returns ``{rank: its return}``.

    ``fn`` and ``args`` must pickle. ``timeout``: seconds the ranks may run together. MultiprocessError names
    a rank that raised, died or passed the deadline.
    """
    from hal.apps.multiprocess import run_multiprocess

    if world_size < 1 or not timeout > 0:
        raise ValueError(f"world_size must be >= 1 and timeout > 0, got world_size={world_size}, timeout={timeout}")
    return run_multiprocess(rank_main, world_size, fn, args, timeout=timeout, start_method="spawn")
