"""verl 0.9.1, unchanged, on the simulated npu: its device detection and its FSDP2 engine's offload.

Each check runs in a fresh process whose only hal-specific input is ``HAL_DEVICE=npu-sim`` in the
environment (the sim then registers inside ``import torch``, through torch's backend autoload). Skipped
where verl is not installed (the ``verl`` extra; ``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import hal

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (the verl extra)"),
    pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable"),
]

ASCEND = {"device": "npu", "backend": "hccl", "visible": "ASCEND_RT_VISIBLE_DEVICES", "npu": True,
          "resource": "NPU", "torch_device": True, "hal": "npu-sim", "hal_backend": "hccl"}


def _run(module: str, *args: str, sim: bool = True, timeout: float = 300) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_DEVICE", "HAL_NPU_SIM_AUTOLOAD", "PYTHONPATH", "PYTEST_XDIST_WORKER")}
    if sim:
        env["HAL_DEVICE"] = "npu-sim"
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=REPO)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.timeout(600)
def test_verl_sees_ascend_importing_verl_first_and_hal_first_in_a_spawned_child():
    # one fresh process imports verl first; the spawn child it starts (as Ray or verl's workers are started)
    # imports hal first: both orders see Ascend, the child through the inherited variable only
    result = _run("tests.interop.verl_device_probe", "verl-first", "hal-first")
    child = result.pop("child")
    assert result == ASCEND
    assert child == ASCEND


@pytest.mark.timeout(600)
def test_without_the_variable_verl_sees_no_npu():
    result = _run("tests.interop.verl_device_probe", "verl-first", sim=False)
    assert result["npu"] is False and result["hal"] == "cpu" and result["device"] != "npu"


@pytest.mark.timeout(900)
def test_verl_fsdp2_engine_offload_all_flag_combinations_train_bit_identical():
    result = _run("tests.interop.verl_fsdp_run", timeout=840)
    assert (result["device"], result["backend"], result["npu"], result["pg_backend"]) == ("npu", "hccl", True, "hccl")
    assert result["module"] == "FSDPQwen2ForCausalLM" and result["param_type"] == "DTensor"  # FSDP2
    assert result["reference"] != result["initial"]  # training changed the weights
    combos = result["combos"]
    assert len(combos) == 8
    for key, combo in combos.items():
        flags = dict(item.split("=") for item in key.split(","))
        model, optimizer, grad = (flags[k] == "True" for k in ("model", "optimizer", "grad"))
        if grad and not model:  # verl's BaseEngine.to: gradients move only with the model
            assert combo["error"] == "AssertionError: Gradient buffers must be moved to device along with model " \
                                     "parameters", key
            assert combo["placement"] == {"params": ["npu"], "grads": ["npu"], "states": ["npu"]}, key
            continue
        assert "error" not in combo, (key, combo)
        # model.to moves gradients with the parameters (verl moves grads with the model whatever `grad` says)
        expected = {"params": ["cpu" if model else "npu"], "grads": ["cpu" if model else "npu"],
                    "states": ["cpu" if optimizer else "npu"]}
        assert combo["offloaded"] == expected, key
        assert combo["onloaded"] == {"params": ["npu"], "grads": ["npu"], "states": ["npu"]}, key
        param_bytes = 22_816 * 4  # the tiny Qwen2's fp32 parameters
        buffer_bytes = 2 * 4 * 4  # its rotary inv_freq and original_inv_freq buffers (head_dim 8 -> 4 floats each)
        model_bytes = 2 * param_bytes + buffer_bytes  # parameters, their gradients, buffers
        storages = combo["storages"]
        assert storages["model"] == model_bytes and storages["optimizer"] == 2 * param_bytes, key
        # device memory freed, as the caching allocator counts it: at least the bytes moved, and at most one
        # 512-byte granule of rounding more per storage moved (torch's caching-allocator rounding)
        moved = [g for g, on in (("model", model), ("optimizer", optimizer)) if on]
        low = sum(storages[g] for g in moved)
        high = low + 512 * sum(storages[f"{g}_count"] for g in moved)
        assert low <= combo["freed"] <= high, (key, combo["freed"], low, high)
        assert combo["digest"] == result["reference"], f"{key}: training after the round trip differs"
