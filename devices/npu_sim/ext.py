"""Build (once) and load the npu-sim C++ extension, ``devices/npu_sim/csrc/npu_sim.cpp``.

Cached under ``$HAL_CACHE_DIR`` (default ``~/.cache/hal``) by a hash of source, torch and Python versions;
a fresh build takes about 25-60 s, and concurrent first uses wait on ``cpp_extension``'s file lock.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
import types

SOURCE = pathlib.Path(__file__).with_name("csrc") / "npu_sim.cpp"

_MODULE: types.ModuleType | None = None


def cache_root() -> pathlib.Path:
    """Return the folder holding built extensions: ``$HAL_CACHE_DIR`` or ``~/.cache/hal``."""
    return pathlib.Path(os.environ.get("HAL_CACHE_DIR") or pathlib.Path.home() / ".cache" / "hal")


def build_key() -> str:
    """Return a hash of the source bytes, the torch version and the Python ABI (a change means a rebuild)."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


# Age in seconds past which a build lock is taken as left by a killed build (a build takes 25-300 s).
STALE_LOCK_S = 900.0


def clear_stale_lock(build_dir: pathlib.Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Remove ``build_dir/lock`` if older than ``max_age_s`` seconds (a killed build leaves it behind)."""
    import time

    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
    except FileNotFoundError:
        pass


def load() -> types.ModuleType:
    """Return the extension module, building it first if this source/torch pair was never built here."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    key = build_key()
    name = f"hal_npu_sim_{key}"
    build_dir = cache_root() / "npu_sim" / key
    built = build_dir / f"{name}.so"
    done = build_dir / "BUILT"  # written after a successful build: a half-linked .so is never imported
    if done.exists() and built.exists():
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        # cpp_extension.load takes a file lock in build_dir: one process builds, the others wait for it.
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                                    extra_cflags=["-O2"], verbose=bool(os.environ.get("HAL_SIM_VERBOSE_BUILD")))
        tmp = build_dir / f"BUILT.{os.getpid()}"
        tmp.write_text(f"{SOURCE.name} torch {__import__('torch').__version__}\n")
        os.replace(tmp, done)
    _MODULE = module
    return module
