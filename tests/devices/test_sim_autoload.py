"""The npu-sim is active from ``import torch`` on when asked (torch's ``torch.backends`` autoload), costs
nothing when not asked, and never breaks ``import torch``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import hal
from devices.npu_sim import autoload as sim_autoload

REPO = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
    import json, sys
    import torch
    state = {"npu": hasattr(torch, "npu"), "pu1": torch._C._get_privateuse1_backend_name(),
             "loaded": sorted(m for m in ("devices.npu_sim.ext", "hal", "torch_npu") if m in sys.modules)}
    if state["npu"]:
        import torch.distributed as dist
        import torch_npu
        state.update(hccl=dist.Backend.default_device_backend_map.get("npu"), compat=torch_npu.__hal_sim__,
                     tensor=str(torch.ones(1).to("npu").device))
    print("STATE", json.dumps(state))
"""


def _probe(env_extra: dict, code: str = PROBE, pythonpath: str | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_DEVICE", sim_autoload.OPT_IN_ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH")}
    env.update(env_extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("STATE "))
    return json.loads(line[len("STATE "):]), out.stderr


def test_entry_point_is_declared_in_torchs_backend_group():
    declared = {ep.name: ep.value for ep in entry_points(group="torch.backends")}
    assert declared.get("hal_npu_sim") == "devices.npu_sim.autoload:autoload"


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False), ({"HAL_DEVICE": "cpu"}, False), ({"HAL_DEVICE": "npu"}, False),
    ({"HAL_DEVICE": "npu-sim"}, True), ({"HAL_DEVICE": " NPU-SIM:1 "}, True),
    ({"HAL_DEVICE": "cpu", "HAL_NPU_SIM_AUTOLOAD": "1"}, True),
    ({"HAL_DEVICE": "npu-sim", "HAL_NPU_SIM_AUTOLOAD": "0"}, False),
])
def test_wanted_only_when_asked(environ, expected):
    assert sim_autoload.wanted(environ) is expected


def test_not_asked_import_torch_loads_nothing_of_the_sim():
    state, _ = _probe({})
    assert state == {"npu": False, "pu1": "privateuseone", "loaded": []}


def test_not_asked_the_entry_point_imports_only_its_own_modules():
    code = """
        import sys, torch
        before = set(sys.modules)
        from devices.npu_sim import autoload as sim_autoload
        sim_autoload.autoload()
        import json
        print("STATE", json.dumps(sorted(set(sys.modules) - before - {"json"})))
    """
    new, _ = _probe({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, code)
    # the package's top (the spec, on devices.base) comes with its autoload submodule; nothing of torch's
    # device registration, the extension or the compatibility module does
    assert set(new) <= {"devices", "devices.base", "devices.npu_sim", "devices.npu_sim.autoload"}, new


@pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")
@pytest.mark.parametrize("env", [{"HAL_DEVICE": "npu-sim"}, {"HAL_DEVICE": "cpu", "HAL_NPU_SIM_AUTOLOAD": "1"}])
def test_asked_the_sim_is_active_from_import_torch(env):
    state, _ = _probe(env)
    assert state == {"npu": True, "pu1": "npu", "loaded": ["devices.npu_sim.ext"], "hccl": "hccl", "compat": True,
                     "tensor": "npu:0"}  # hal itself is not imported, torch_npu only when asked for


@pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")
def test_opt_out_and_torchs_own_switch_keep_the_sim_off():
    for env in ({"HAL_DEVICE": "npu-sim", "HAL_NPU_SIM_AUTOLOAD": "0"},
                {"HAL_DEVICE": "npu-sim", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}):
        state, _ = _probe(env)
        assert state["npu"] is False and state["loaded"] == [], env


def test_a_failure_is_a_warning_and_import_torch_still_works(tmp_path):
    pkg = tmp_path / "torch_npu"  # shaped like the real wheel: the sim refuses to register next to it
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (pkg / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    state, stderr = _probe({"HAL_DEVICE": "npu-sim"}, """
        import json, torch
        print("STATE", json.dumps({"npu": hasattr(torch, "npu"), "sum": float(torch.ones(3).sum())}))
    """, pythonpath=f"{tmp_path}{os.pathsep}{REPO}")
    assert state == {"npu": False, "sum": 3.0}
    assert "RuntimeWarning: hal npu-sim autoload failed, torch continues without the simulated npu: " \
           "RuntimeError: a real torch_npu is importable here" in stderr


@pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")
def test_import_hal_under_the_sim_imports_no_vendor_package():
    state, _ = _probe({"HAL_DEVICE": "npu-sim"}, """
        import json, sys
        import hal
        print("STATE", json.dumps({"torch_npu": "torch_npu" in sys.modules, "kind": hal.resolve_device().kind,
                                   "device": str(hal.get_device())}))
    """)
    assert state == {"torch_npu": False, "kind": "npu-sim", "device": "npu:0"}
