"""The one process harness of tests and benchmarks: process groups that cannot hang.

:func:`run_multiprocess` adds an overall deadline and per-rank return values (pickled to files) to
``torch.multiprocessing.start_processes``. The caller hosts the group's store on a kernel-picked port, as
torchrun's elastic agent does, so ``hal.launcher_store()`` and ``env://`` work unchanged. Ranks start from a
``forkserver`` with torch preloaded where possible, with the caller's environment, cwd, ``sys.path`` and
stdout/stderr.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

import torch.multiprocessing as tmp

from hal.distributed import connect_store


class _ParentFd:
    """One of the caller's file descriptors, handed to a forkserver rank (as ``reduction.DupFd`` does a socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _restore_fd, (reduction.DupFd(self.fd),)


def _restore_fd(dup) -> int:
    return dup.detach()


def _entry(rank: int, fn: Callable | tuple[str, str], world_size: int, port: int, env: dict, args: tuple,
           group_dir: str, parent: dict | None = None, fail_fast: bool = True) -> None:
    import faulthandler

    import torch

    # registered first: until then the parent's stacks signal would kill
    global _stacks_file
    _stacks_file = open(_stacks_path(group_dir, rank), "w")  # kept open: faulthandler writes to its fd
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)
    if parent is not None:  # started from the forkserver: take the caller's state, as spawn would have
        for target, fd in ((1, parent["stdout"]), (2, parent["stderr"])):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        os.chdir(parent["cwd"])
        sys.path[:] = parent["sys_path"]
        os.environ.clear()
        os.environ.update(parent["environ"])
    if isinstance(fn, tuple):  # (module, qualname): imported with the caller's sys.path in place
        module, qualname = fn
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        fn = target
    # torch is already imported, so OMP_NUM_THREADS below comes too late here; more threads make gloo crawl
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"})
    os.environ.update(env)
    try:
        outcome = (True, fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result is this rank's failure
        data = pickle.dumps((False, f"rank {rank}'s result could not be sent: {type(exc).__name__}: {exc}"))
    path = _result_path(group_dir, rank)
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)  # whole or absent: a rank killed while writing leaves no result
    if fail_fast and not outcome[0]:
        sys.exit(1)  # a non-zero exit: the caller stops the other ranks now, not at their own timeouts


# On this signal a rank writes every thread's Python stack to its stacks file, for the MultiprocessError.
STACKS_SIGNAL = signal.SIGUSR1

_stacks_file = None  # in a rank: the file its stacks go to (open for as long as the rank runs)
# At most this many characters of each rank's stacks (the end) go into the error message.
STACKS_CHARS = 6000


def _stacks_path(group_dir: str, rank: int) -> str:
    return os.path.join(group_dir, f"rank{rank}.stacks")


def _result_path(group_dir: str, rank: int) -> str:
    """Return where rank ``rank`` leaves its pickled ``(ok, value)`` (a file: no rank blocks on a reader)."""
    return os.path.join(group_dir, f"rank{rank}.result")


def _read_result(group_dir: str, rank: int) -> tuple[bool, Any] | None:
    """Return rank ``rank``'s ``(ok, value)``, ``None`` if it left none."""
    try:
        with open(_result_path(group_dir, rank), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - reported as that rank's failure
        return False, f"rank {rank}'s result could not be read in the calling process: {type(exc).__name__}: {exc}"


def _dump_stacks(ranks: dict[int, Any], group_dir: str, wait_s: float = 2.0) -> str:
    """Return the Python stacks of each live rank, given ``wait_s`` seconds to write them."""
    for p in ranks.values():
        try:
            os.kill(p.pid, STACKS_SIGNAL)
        except OSError:  # exited meanwhile
            pass
    time.sleep(wait_s)
    parts = []
    for rank in ranks:
        try:
            with open(_stacks_path(group_dir, rank), errors="replace") as f:
                text = f.read()[-STACKS_CHARS:]
        except OSError as exc:
            text = f"(no stacks: {exc})"
        parts.append(f"--- rank {rank} (pid {ranks[rank].pid}) ---\n{text.rstrip() or '(it wrote none)'}")
    return "\n".join(parts)


# Variables read while torch imports: a forkserver started under other values imported a different torch.
_IMPORT_ENV_PREFIXES = ("HAL_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "ASCEND_", "CUDA_",
                        "PYTHON", "LD_")
# Not about torch's import: this module's switch, and variables torch sets itself in the caller's process.
_NOT_IMPORT_ENV = ("HAL_TEST_START_METHOD", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHINDUCTOR_CACHE_DIR")
_forkserver_lock = threading.Lock()
_forkserver_env: dict[str, str] | None = None


def _import_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_IMPORT_ENV_PREFIXES) and k not in _NOT_IMPORT_ENV}


def _start_method() -> str:
    """Return ``forkserver`` when available and the import environment matches its own, else ``spawn``."""
    global _forkserver_env
    if os.environ.get("HAL_TEST_START_METHOD", "forkserver") != "forkserver" or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    with _forkserver_lock:
        if _forkserver_env is None:
            from multiprocessing import forkserver

            # torch.distributed.tensor too: 0.8 s of CPU to import, in every rank that touches FSDP2 or engines
            multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
            forkserver.ensure_running()
            _forkserver_env = _import_env()
        return "forkserver" if _import_env() == _forkserver_env else "spawn"


class MultiprocessError(RuntimeError):
    """A spawned rank raised, died, or the group passed its deadline; ``failures`` is ``{rank: why}``."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


def run_multiprocess(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                     env: dict[str, str] | None = None, expect_failure: bool = False,
                     start_method: str | None = None) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return ``{rank: result}``.

    ``fn`` must be a module-level function; each rank gets torchrun's variables plus ``env``. ``timeout`` (seconds,
    imports included) covers the whole group; past it each rank's stacks are taken and all are killed.
    ``start_method="spawn"`` (or ``fn.start_method``) always spawns, for memory measurements. ``expect_failure``
    returns ``{rank: error text}`` for ranks that raised. Raises MultiprocessError with each failing rank's
    traceback (and the stacks past the deadline).
    """
    if start_method not in (None, "spawn"):
        raise ValueError(f"start_method must be None (forkserver where possible) or 'spawn', got {start_method!r}")
    if "<" in getattr(fn, "__qualname__", "<"):  # <lambda>, <locals>: the ranks could not import it
        raise ValueError(f"fn must be a module-level function (a test module's counts), got {fn!r}")
    # a function of the __main__ script is found again only by spawn, which re-runs that script
    spawn = fn.__module__ == "__main__" or "spawn" in (start_method, getattr(fn, "start_method", None))
    method = "spawn" if spawn else _start_method()
    target: Callable | tuple[str, str] = fn
    parent = None
    if method == "forkserver":
        target = (fn.__module__, fn.__qualname__)
        parent = {"stdout": _ParentFd(1), "stderr": _ParentFd(2), "cwd": os.getcwd(), "sys_path": list(sys.path),
                  "environ": dict(os.environ)}
    group_dir, context, exited, late = None, None, None, None
    died: dict[int, str] = {}  # a rank that exited non-zero or by a signal: why
    store = connect_store("127.0.0.1", 0, 0, world_size, timeout=timeout, is_master=True)  # the kernel's port
    try:
        group_dir = tempfile.mkdtemp(prefix="hal-ranks-")  # each rank's result and, past the deadline, stacks
        context = tmp.start_processes(_entry, args=(target, world_size, store.port, dict(env or {}), args, group_dir,
                                                    parent, not expect_failure),
                                      nprocs=world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        # a rank that exits non-zero: torch SIGTERMs the others, and SIGKILLs them 1 s later (not its 30 s)
        while not context.join(timeout=0.2, grace_period=1.0):
            if time.monotonic() > deadline:
                done = [r for r in range(world_size) if os.path.exists(_result_path(group_dir, r))]
                alive = {r: p for r, p in enumerate(context.processes) if p.is_alive()}
                stacks = _dump_stacks(alive, group_dir)
                late = (f"{world_size} processes did not finish within {timeout} s (ranks done with a result: {done}, "
                        f"still running: {[r for r in alive if r not in done]}, alive after their result: "
                        f"{[r for r in alive if r in done]}); their stacks:\n{stacks}",
                        {r: f"still running at the deadline of {timeout} s" for r in alive if r not in done})
                break
    except tmp.ProcessRaisedException as exc:
        raise MultiprocessError(str(exc), {exc.error_index: str(exc).strip()}) from exc
    except tmp.ProcessExitedException as exc:
        exited = str(exc)  # what the other ranks had sent still counts (and names the cause, if one raised)
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        died[exc.error_index] = f"{how} without a result"
    finally:
        for p in context.processes if context is not None else []:
            if p.is_alive():
                p.kill()
                p.join(5)
        received = {}
        if group_dir is not None:
            received = {r: outcome for r in range(world_size) if (outcome := _read_result(group_dir, r)) is not None}
            shutil.rmtree(group_dir, ignore_errors=True)
        store = None  # the port is closed now, even while a raised error (and this frame) is kept
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    for rank, (ok, value) in sorted(received.items()):
        (out if ok else failures)[rank] = value
    if late is not None:  # the ranks that failed first (their peers then waited) come first in the message
        raise MultiprocessError("\n".join([f"rank {r} failed: {t}" for r, t in sorted(failures.items())] + [late[0]]),
                                {**late[1], **failures})
    if (failures or exited) and not expect_failure:
        raise MultiprocessError("\n".join(([exited] if exited else [])
                                          + [f"rank {r} failed: {t}" for r, t in sorted(failures.items())]),
                                {**{r: why for r, why in died.items() if r not in received}, **failures})
    missing = [rank for rank in range(world_size) if rank not in received]
    if missing and not expect_failure:
        codes = [context.processes[r].exitcode for r in missing]
        raise MultiprocessError(f"ranks {missing} exited (exit codes {codes}) without a result",
                                {r: f"exited with code {c} without a result" for r, c in zip(missing, codes)})
    if expect_failure:
        out.update(failures)
    return out
