"""The stated memory bounds of the weight-sync job: exact sums per engine class, and a peak over a bound is
judged outside it."""

import pytest

import ckpt
from hal.apps.weightsync.memory import (RUNTIME_BYTES, memory_bound,
                                        rollout_memory_bounds, send_buffer, trainer_memory_bound)

MODEL, OPT, PUBLISHED, BUCKET = 4_000_000, 8_000_000, 1_000_000, 3 << 20


def bound(engine: str, peak: int = 0) -> dict:
    return trainer_memory_bound(peak, param_bytes=MODEL, grad_bytes=MODEL, optimizer_bytes=OPT,
                                engine_cls=ckpt.checkpoint_engine_factory(engine), bucket_bytes=BUCKET,
                                published_bytes=PUBLISHED)


def test_the_trainer_bound_counts_what_each_engine_class_holds_to_send():
    collective, file, colocated = bound("collective"), bound("file"), bound("colocated")
    base = {"model_bytes": 8_000_000, "optimizer_bytes": 8_000_000, "constant_bytes": 805_306_368}
    assert collective["terms"] == {**base, "buckets_bytes": 9_437_184}
    assert collective["bound_bytes"] == 830_743_552
    assert collective["form"] == ("model (parameters + gradients) + optimizer + three buckets (two send buffers "
                                  "and the one in flight) + constant")
    # the file engine writes shards of host copies: no bucket, at most the whole update
    assert file["terms"] == {**base, "host_copies_bytes": 1_000_000} and file["bound_bytes"] == 822_306_368
    assert file["form"] == ("model (parameters + gradients) + optimizer + the update's host copies (one shard, "
                            "at most the update) + constant")
    assert colocated["terms"] == base and colocated["form"] == "model (parameters + gradients) + optimizer + constant"
    assert bound("kimi")["terms"]["pinned_update_bytes"] == 1_000_000
    assert bound("nixl")["terms"] == bound("mooncake")["terms"] == collective["terms"]


def test_a_peak_over_the_bound_is_outside_it_and_at_the_bound_within():
    assert bound("file", peak=822_306_368)["within"] is True
    over = bound("file", peak=822_306_369)
    assert over["within"] is False and over["peak_bytes"] == 822_306_369
    assert memory_bound(11, "a + b", {"a": 4, "b": 6}) == {"form": "a + b", "terms": {"a": 4, "b": 6},
                                                           "bound_bytes": 10, "peak_bytes": 11, "within": False}


def test_the_bound_reads_the_engine_class_and_refuses_one_that_states_nothing():
    class Stated:
        send_buffer_words = "one staging copy"

        @classmethod
        def send_buffer_bytes(cls, bucket_size, published_bytes):
            return {"staging_bytes": 2 * published_bytes + bucket_size}

    assert send_buffer(Stated, 10, 100) == ("one staging copy", {"staging_bytes": 210})
    with pytest.raises(ValueError, match="'Unknown' states no send_buffer_bytes"):
        send_buffer(type("Unknown", (), {}), 10, 100)


def test_a_rollout_is_judged_by_its_apply_modes_bound():
    atomic = rollout_memory_bounds(2 * MODEL + 2 * BUCKET + RUNTIME_BYTES + 1, MODEL, 2, BUCKET)
    assert atomic["mode"] == "atomic" and atomic["judged_by"]["form"] == "2 x model + 2 buckets + constant"
    assert atomic["judged_by"]["bound_bytes"] == 819_597_824 and atomic["judged_by"]["within"] is False
    assert atomic["model_plus_2_buckets"]["bound_bytes"] == 815_597_824
    in_place = rollout_memory_bounds(815_597_824, MODEL, 1, BUCKET)
    assert in_place["mode"] == "in-place" and in_place["judged_by"] == in_place["model_plus_2_buckets"]
    assert in_place["judged_by"]["within"] is True


def test_a_model_adapter_reports_its_banks():
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(16, 4, bias=False)  # 64 fp32 values: 256 bytes
    held = ckpt.ModelRolloutAdapter(module, atomic=True).memory()
    assert (held.model_bytes, held.banks, held.bank_bytes) == (256, 2, 256)
    held = ckpt.ModelRolloutAdapter(torch.nn.Linear(16, 4, bias=False), atomic=False).memory()
    assert (held.model_bytes, held.banks, held.bank_bytes) == (256, 1, 256)


def test_a_host_backed_device_adds_its_cache_and_the_step_temporaries(monkeypatch):
    from hal.apps.weightsync.memory import host_device_terms

    assert host_device_terms("cpu", 123) == ("", {})  # cpu tensors are the host's: nothing more to count
    monkeypatch.setenv("HAL_SIM_CACHE_RESIDENT_MB", "64")
    words, terms = host_device_terms("npu-sim", 1000)
    assert terms == {"device_cache_bytes": 64 << 20, "optimizer_step_bytes": 1000}
    assert words == "the device allocator's resident cache + the optimizer step's temporaries"
    words, terms = host_device_terms("npu-sim", 0, 4000)  # --offload: the engine's host buffers, in the same memory
    assert terms == {"device_cache_bytes": 64 << 20, "offload_buffers_bytes": 4000}
    assert words == "the device allocator's resident cache + the offload's host buffers"
    assert host_device_terms("cpu", 0, 4000) == ("", {})
    bound = rollout_memory_bounds(0, MODEL, 2, BUCKET, *host_device_terms("npu-sim"))
    assert bound["judged_by"]["terms"]["device_cache_bytes"] == 64 << 20
    assert bound["judged_by"]["bound_bytes"] == 2 * MODEL + 2 * BUCKET + (64 << 20) + RUNTIME_BYTES
    assert "resident cache" in bound["model_plus_2_buckets"]["form"]


def test_a_host_backed_device_counts_the_steps_working_memory_on_the_host():
    """On the simulated npu the activations and the backward's transients (the device's peak beyond its
    states) are host memory: the trainer of the 0.5B preset was over its bound by about that much (1.2 GB)."""
    from hal.apps.weightsync.memory import host_device_terms

    words, terms = host_device_terms("npu-sim", working_bytes=1_159_000_000)
    assert terms["device_working_bytes"] == 1_159_000_000 and "the step's device working memory" in words
    assert "device_working_bytes" not in host_device_terms("npu-sim", working_bytes=-5)[1]  # nothing beyond
    assert host_device_terms("cpu", working_bytes=1_159_000_000) == ("", {})  # device memory is not the host's


@pytest.mark.hal_device("npu-sim")
def test_held_memory_leaves_out_the_file_pages_and_a_host_backed_devices_cache():
    """What ``hal soak`` judges as held memory: a freed block the simulated npu's allocator caches is its device
    memory (the cache a real device keeps reserved), and cpu caches nothing on the host's behalf."""
    import torch

    import hal
    from hal.apps.weightsync.memory import device_cache_in_host_bytes, held_resident_bytes, resident_bytes

    device = hal.resolve_local_device("npu-sim").bind()
    before = device_cache_in_host_bytes("npu-sim")
    block = torch.ones(4 << 20, dtype=torch.uint8, device=device)  # written: its pages are resident
    del block
    assert device_cache_in_host_bytes("npu-sim") - before == 4 << 20
    assert device_cache_in_host_bytes("cpu") == 0
    assert 0 < held_resident_bytes() < resident_bytes()  # the interpreter's own code is file-backed
