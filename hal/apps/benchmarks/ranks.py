"""Start a benchmark's ranks on this node with the harness the tests use (:func:`hal.multiprocess.run_multiprocess`).

A benchmark that measures between processes writes one function ``fn(rank, world_size, *args)``, run in
``world_size`` fresh (spawned) processes; each returns its figures, and :func:`run_ranks` hands back
``{rank: figures}``. The ranks find each other through the store the caller hosts, as torchrun's ranks find
the elastic agent's (:func:`launcher_store`), and a checkpoint engine's group forms by verl's lifecycle over it
(:func:`ckpt.manager.join_engine`): the engine's master says in ``prepare()`` where its rendezvous is, already
hosted on a port the kernel picked, so the benchmark chooses no port. The run has a deadline: past it every
rank's stacks are taken and the ranks are killed, so a rank waiting on a dead peer fails the run within it.
"""

from __future__ import annotations

from typing import Any, Callable

STORE_PREFIX = "hal-bench"
"""The benchmark's keys in the launcher's store, apart from the launcher's own (``torchelastic/...``)."""


def launcher_store(timeout: float = 120.0) -> Any:
    """The launcher's store (:func:`hal.launcher_store`) under :data:`STORE_PREFIX`.

    Raises:
        KeyError: not a rank :func:`run_ranks` (or ``torchrun``) started.
        hal.DistributedTimeoutError: the store did not answer within ``timeout`` seconds.
    """
    import hal

    return hal.launcher_store(timeout, STORE_PREFIX)


def rank_main(rank: int, world_size: int, fn: Callable[..., Any], args: tuple) -> Any:
    """What each started process runs: ``fn(rank, world_size, *args)``; SIGINT and SIGTERM end it quietly
    (:func:`hal.apps.shutdown.quiet_rank_exit`), so a Ctrl-C prints no traceback per rank."""
    from hal.apps.shutdown import quiet_rank_exit

    quiet_rank_exit()
    return fn(rank, world_size, *args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes (:func:`hal.multiprocess.run_multiprocess`,
    the harness the tests use); returns ``{rank: its return}``.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function). The processes are spawned, never
    forked, so each one's memory figures (``VmHWM``, ``ru_maxrss``) count only what the benchmark did. They
    meet on the store this process hosts (:func:`launcher_store`).

    Args:
        timeout: seconds the ranks may run together; past it their stacks are taken and they are killed.

    Raises:
        ValueError: ``world_size`` below 1 or ``timeout`` not positive.
        hal.multiprocess.MultiprocessError: a rank raised, died or passed the deadline; ``failures`` names which.
    """
    from hal.multiprocess import run_multiprocess

    if world_size < 1 or not timeout > 0:
        raise ValueError(f"world_size must be >= 1 and timeout > 0, got world_size={world_size}, timeout={timeout}")
    return run_multiprocess(rank_main, world_size, fn, args, timeout=timeout, start_method="spawn")
