"""Helpers for tests of multi-process code: free ports and spawned process groups that cannot hang.

``torch.multiprocessing.start_processes`` does the spawning; what it lacks is an overall deadline and a way
to hand back each rank's return value, which :func:`run_multiprocess` adds.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as tmp

from hal.distributed import pick_port


_calls = 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Under pytest-xdist each worker draws from its own range (by ``PYTEST_XDIST_WORKER``), so two workers
    never pick the same port; within the range the OS is asked whether the port is free.
    """
    global _calls
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 21000 + 500 * (index % 60)
    start = (os.getpid() * 7 + 13 * _calls) % 500  # successive calls (and processes) start elsewhere
    _calls += 1
    for port in [base + (start + i) % 500 for i in range(500)]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return pick_port("127.0.0.1")  # range exhausted: let the OS choose


def _entry(rank: int, fn: Callable, world_size: int, port: int, env: dict, results, args: tuple,
           timeout: float) -> None:
    import faulthandler

    import torch

    # torch is already imported here, so OMP_NUM_THREADS below comes too late for this process: several
    # ranks with two threads each on two cores make gloo's busy waits crawl (a test once passed 100 s).
    torch.set_num_threads(1)
    # Should the group pass its deadline, the parent asks each rank for its Python stacks (every thread)
    # before it kills it: a timer here would run from this rank's start, late when spawning was slow.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "OMP_NUM_THREADS": "1"})
    os.environ.update(env)
    try:
        results.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


STACKS_SIGNAL = signal.SIGUSR1
"""The signal on which a rank started by :func:`run_multiprocess` writes every thread's Python stack to
its stderr (``faulthandler.register``)."""


def _dump_stacks(processes: list, wait_s: float = 2.0) -> None:
    """Ask each live process for its stacks (:data:`STACKS_SIGNAL`) and give them ``wait_s`` seconds to
    write them, so a hang's report shows where each rank was when the deadline passed."""
    for p in processes:
        try:
            os.kill(p.pid, STACKS_SIGNAL)
        except OSError:  # exited meanwhile
            pass
    time.sleep(wait_s)


class MultiprocessError(RuntimeError):
    """A spawned rank raised, died, or the group passed its deadline."""


def run_multiprocess(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                     env: dict[str, str] | None = None, expect_failure: bool = False) -> dict[int, Any]:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes; return ``{rank: result}``.

    ``fn`` must be importable (a module-level function). Each process gets ``MASTER_ADDR``/``MASTER_PORT``/
    ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set as ``torch.distributed.run`` would, plus ``env``.

    Args:
        timeout: seconds for the whole group; past it every process is killed.
        expect_failure: return ``{rank: error text}`` for ranks that raised instead of raising.

    Raises:
        MultiprocessError: a rank raised (unless ``expect_failure``), exited without a result, or the
            deadline passed. The message carries each failing rank's traceback.
    """
    port = free_port()
    ctx = tmp.get_context("spawn")
    results = ctx.SimpleQueue()
    context = tmp.start_processes(_entry, args=(fn, world_size, port, dict(env or {}), results, args, timeout),
                                  nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                done = []
                while not results.empty():
                    done.append(results.get()[0])
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                _dump_stacks([context.processes[r] for r in alive])
                raise MultiprocessError(f"{world_size} processes did not finish within {timeout} s (ranks done: "
                                        f"{sorted(done)}, still running: {alive}; their stacks are on stderr)")
    except tmp.ProcessRaisedException as exc:
        raise MultiprocessError(str(exc)) from exc
    except tmp.ProcessExitedException as exc:
        if not expect_failure:
            raise MultiprocessError(str(exc)) from exc
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    while not results.empty():
        rank, ok, value = results.get()
        (out if ok else failures)[rank] = value
    if failures and not expect_failure:
        raise MultiprocessError("\n".join(f"rank {r} failed: {t}" for r, t in sorted(failures.items())))
    if expect_failure:
        out.update(failures)
    return out
