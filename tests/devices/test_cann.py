"""The simulated npu answers what a CANN install answers (npu-smi, the toolkit's version file), so that
verl's Ascend version checks run under it, and it writes nothing outside the folder it was given."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import hal
from devices.npu_sim import cann, ext

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_DEVICE", "ASCEND_HOME_PATH", "ASCEND_RT_VISIBLE_DEVICES", "HAL_SIM_NPU_COUNT")}
    env.update(extra)
    return env


def test_npu_smi_lists_the_simulated_devices_and_refuses_another_card(tmp_path):
    found = cann.prepare(tmp_path / "cann", ["4", "5"], 2 << 30)
    smi = pathlib.Path(found["PATH_PREPEND"]) / "npu-smi"
    listing = subprocess.run([str(smi), "info"], capture_output=True, text=True, timeout=30)
    rows = [line.split()[1] for line in listing.stdout.splitlines() if "Ascend-sim" in line]
    assert listing.returncode == 0 and rows == ["4", "5"] and "/ 2048" in listing.stdout
    board = subprocess.run([str(smi), "info", "-t", "board", "-i", "5"], capture_output=True, text=True, timeout=30)
    assert f"Software Version               : {cann.DRIVER_VERSION}" in board.stdout
    other = subprocess.run([str(smi), "info", "-t", "board", "-i", "1"], capture_output=True, text=True, timeout=30)
    assert other.returncode == 1 and "card id 1 is invalid" in other.stderr
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == [f"cann/ascend-toolkit/latest/{os.uname().machine}-linux/ascend_toolkit_install.info",
                       "cann/bin/npu-smi"]


@pytest.mark.interop
@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs the verl extra")
def test_verls_ascend_version_check_runs_under_the_sim(tmp_path):
    # verl.utils.device.get_npu_versions runs npu-smi and reads the toolkit's info file; is_support_ipc()
    # must say False: the sim shares no device memory between processes
    found = cann.prepare(tmp_path, ["0", "1"], 1 << 30)
    env = _env(HAL_DEVICE="npu-sim", ASCEND_HOME_PATH=found["ASCEND_HOME_PATH"],
               PATH=found["PATH_PREPEND"] + os.pathsep + os.environ["PATH"])
    code = ("from verl.utils.device import get_npu_versions, is_support_ipc\n"
            "print(*get_npu_versions()[1:], is_support_ipc())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == [cann.DRIVER_VERSION, cann.CANN_VERSION.lower(), "False"]


def test_the_autoload_puts_npu_smi_on_path_only_when_the_sim_is_asked_for():
    code = "import shutil, os, torch; print(shutil.which('npu-smi'), os.environ.get('ASCEND_HOME_PATH'))"
    asked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=_env(HAL_DEVICE="npu-sim", HAL_SIM_NPU_COUNT="2"), cwd=REPO)
    smi, home = asked.stdout.split()
    root = str(ext.cache_root() / "npu_sim" / "cann")
    assert smi.startswith(root) and home.startswith(root), asked.stdout
    if not any(pathlib.Path(d, "npu-smi").exists() for d in os.environ["PATH"].split(os.pathsep) if d):
        unasked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                 env=_env(), cwd=REPO)
        assert unasked.stdout.split() == ["None", "None"]
