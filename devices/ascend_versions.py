"""The Ascend driver and CANN toolkit versions, read as verl 0.9.1 reads them, and the IPC gate they decide.

NPU IPC needs driver ``Software Version`` >= 25.3.rc1 (``npu-smi info -t board -i <id>``) and toolkit
``version=`` >= 8.3.RC1 (``ascend_toolkit_install.info``); older stacks take shared memory (verl PR 5089).
The simulated npu writes both answers (:mod:`devices.npu_sim.cann`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess

# Oldest driver Software Version with NPU IPC (verl check_ipc_version_support).
IPC_MIN_DRIVER = "25.3.rc1"
# Oldest CANN toolkit version with NPU IPC (same source).
IPC_MIN_CANN = "8.3.rc1"

_VERSION = re.compile(r"(\d+\.\d+(?=\.t))|(\d+\.\d+(?:\.(?:rc\d+|\d+))?)", re.IGNORECASE)


def base_version(text: str) -> str:
    """Return the comparable part of an Ascend version: ``25.3.rc1.2`` -> ``25.3.rc1``, ``8.3.RC1`` -> ``8.3.rc1``."""
    match = _VERSION.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"not an Ascend version: {text!r} (expected e.g. '25.3.rc1' or '8.3.RC1')")
    return (match.group(1) or match.group(2)).lower()


def at_least(text: str, minimum: str) -> bool:
    """Return whether Ascend version ``text`` is ``>= minimum`` (both read by :func:`base_version`)."""
    from packaging.version import Version

    return Version(base_version(text)) >= Version(base_version(minimum))


def driver_version(card: str | None = None, timeout: float = 10.0) -> str:
    """Return the driver's ``Software Version`` from ``npu-smi`` for ``card`` (default: the first visible, or 0).

    ``timeout`` is in seconds. OSError without ``npu-smi``; RuntimeError when it fails or prints no version.
    """
    if card is None:
        card = (os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",")[0].strip() or "0")
    done = subprocess.run(["npu-smi", "info", "-t", "board", "-i", card], capture_output=True, text=True,
                          timeout=timeout)
    for line in done.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Software Version":
            return value.strip()
    raise RuntimeError(f"npu-smi info -t board -i {card} exited {done.returncode} without a Software Version: "
                       f"{(done.stderr or done.stdout).strip()[:300]!r}")


def cann_version() -> str:
    """Return ``version=`` of ``$ASCEND_HOME_PATH/<arch>-linux/ascend_toolkit_install.info``."""
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        raise FileNotFoundError("ASCEND_HOME_PATH is not set (source the CANN toolkit's set_env.sh)")
    path = os.path.join(home, f"{platform.machine()}-linux", "ascend_toolkit_install.info")
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, sep, value = line.partition("=")
            if sep and key.strip() == "version":
                return value.strip()
    raise RuntimeError(f"{path} has no 'version=' line")


def ipc_supported() -> tuple[bool, str]:
    """Return ``(ok, why)``: whether this host allows NPU IPC and the versions (or read errors) that decided it."""
    try:
        driver, cann = driver_version(), cann_version()
        ok = at_least(driver, IPC_MIN_DRIVER) and at_least(cann, IPC_MIN_CANN)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        return False, f"versions unreadable ({type(exc).__name__}: {exc})"
    return ok, (f"driver {driver}, CANN {cann}; IPC needs driver >= {IPC_MIN_DRIVER} and CANN >= "
                f"{IPC_MIN_CANN.replace('rc', 'RC')}")


__all__ = ["IPC_MIN_CANN", "IPC_MIN_DRIVER", "at_least", "base_version", "cann_version", "driver_version",
           "ipc_supported"]
