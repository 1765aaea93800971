"""verl 0.9.1's own receiving code takes hal's LoRA adapter update (issue 48): hal's ipc sender publishes the
adapter alone, as ``hal sync --lora-rank`` stages it, with ``peft_config`` and ``base_sync_done=True`` beside
it; verl's ``BucketedWeightReceiver``, through a callback written as ``update_weights_from_ipc`` writes its LoRA
branch, gets the same tensors under the same names as peft's ``get_peft_model_state_dict``, which a peft model
of the same config then loads with nothing missing or unexpected."""

import importlib.util

import pytest

import hal
from hal.apps.multiprocess import run_multiprocess
from tests.interop import verl_lora_workers

pytestmark = [
    pytest.mark.interop, pytest.mark.multiprocess,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (the verl extra)"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (the verl extra)"),
    pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable"),
]


@pytest.mark.parametrize("bucket_size", [16 << 10, 4 << 20])
def test_verls_receiver_takes_hals_adapter_update_under_peft_names(bucket_size):
    results = run_multiprocess(verl_lora_workers.adapter_update_into_verls_receiver, 2, bucket_size, timeout=110)
    trainer, rollout = results[0], results[1]
    assert trainer["kwargs"]["base_sync_done"] is True and trainer["kwargs"]["peft_config"]["r"] == 8
    assert len(trainer["peft_names"]) == 28
    for sent, got in zip(trainer["sent"], rollout):
        assert got["digest"] == sent  # the same tensors, bytes, dtypes and shapes, in the same order
        assert [name for name, *_ in got["digest"]] == trainer["peft_names"]  # peft's own names
        assert got["base_sync_done"] is True and got["r"] == 8
        assert got["unexpected"] == [] and got["missing_adapter"] == []  # peft loads them as they came
        assert got["devices"] == ["npu:1"]
        assert got["lasts"][-1] is True and not any(got["lasts"][:-1])
        if bucket_size == 16 << 10:  # 75 kB of adapter: several buckets, one tensor dict on is_last
            assert len(got["lasts"]) > 3
    assert rollout[0]["digest"] != rollout[1]["digest"]  # the second update carried the adapter's new values
