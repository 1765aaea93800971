"""``hal sync --rollout vllm``'s option checks and its comparison with hal's adapter (no vLLM needed)."""

from __future__ import annotations

import pytest

from hal.apps.cli.sync import Sync, validate
from hal.apps.errors import UsageError
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.vllm_role import update_time_comparison


@pytest.mark.parametrize("changes, flag", [({"launcher": "ray"}, "--launcher ray"),
                                           ({"engine": "file"}, "--engine file"),
                                           ({"engine": "colocated"}, "--engine colocated")])
def test_rollout_vllm_refuses_what_it_does_not_run(changes, flag):
    with pytest.raises(UsageError, match=flag):
        validate(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", **changes))


def test_rollout_vllm_refuses_a_checkpoint_path(tmp_path):
    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(UsageError, match="--model"):
        validate(Sync(device="cpu", model=str(tmp_path / "m.safetensors"), rollout="vllm"))


def test_published_dtype_is_float32_with_vllm_unless_asked():
    assert JobOptions(device="cpu", model="m").published_dtype == "bfloat16"
    assert JobOptions(device="cpu", model="m", rollout="vllm").published_dtype == "float32"
    assert JobOptions(device="cpu", model="m", rollout="vllm", publish_dtype="bfloat16").published_dtype == "bfloat16"


def test_update_time_comparison_is_vllm_receive_plus_load_over_hal_receive():
    vllm_rows = [{"global_steps": 1, "bytes": 10, "rollouts": [
        {"vllm": {"receive_s": 0.3, "load_s": 0.1}}, {"vllm": {"receive_s": 0.5, "load_s": 0.1}}]}]
    hal_rows = [{"global_steps": 1, "rollouts": [{"receive_s": 0.2}, {"receive_s": 0.3}]}]
    out = update_time_comparison(vllm_rows, hal_rows)
    [step] = out["steps"]
    assert step["vllm_update_s"] == pytest.approx(0.5) and step["hal_update_s"] == pytest.approx(0.25)
    assert step["vllm_receive_s"] == pytest.approx(0.4) and step["vllm_load_s"] == pytest.approx(0.1)
    assert step["ratio"] == pytest.approx(2.0) and out["ratio_mean"] == pytest.approx(2.0)
