"""``hal sync --rollout-tp T`` and ``hal plan``: hal's rollout as tensor-parallel ranks, each receiving only its
slices (issue 47)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from hal.apps.errors import UsageError
from hal.apps.multiprocess import run_multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_the_qwen2_plan_splits_attention_mlp_and_the_vocabulary():
    from transformers import Qwen2ForCausalLM

    from hal.apps.weightsync import models, tp

    config = models.qwen2_config("qwen2.5-0.5b")
    plan = tp.tp_plan(config, Qwen2ForCausalLM)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "embedding_rowwise" and plan["lm_head"] == "colwise_gather_output"
    assert tp.style_of("model.layers.3.self_attn.o_proj.weight", plan) == ("rowwise", "weight")
    assert tp.style_of("model.norm.weight", plan) == (None, "weight")
    shapes = {"model.embed_tokens.weight": (151936, 896), "model.layers.0.self_attn.o_proj.weight": (896, 896),
              "model.layers.0.self_attn.k_proj.bias": (128,), "model.norm.weight": (896,)}
    dtypes = dict.fromkeys(shapes, torch.float32)
    layout = tp.tp_layout(shapes, dtypes, plan, 1, 2)
    regions = {s.name: (s.region.offsets, s.region.sizes, s.target_shape) for s in layout.slices}
    assert regions == {"model.embed_tokens.weight": ((75968, 0), (75968, 896), (75968, 896)),
                       "model.layers.0.self_attn.o_proj.weight": ((0, 448), (896, 448), (896, 448)),
                       "model.layers.0.self_attn.k_proj.bias": ((64,), (64,), (64,)),
                       "model.norm.weight": ((0,), (896,), (896,))}


@pytest.mark.parametrize("flags, message", [
    (dict(rollout_tp=4, rollouts=4), "--rollout-tp 4 does not divide the model's 4 attention heads and 2 key-value "
                                     "heads; it can be 1, 2"),
    (dict(rollout_tp=2, rollouts=3), "--rollout-tp 2 groups the --rollouts ranks into servers of 2: --rollouts must "
                                     "be a multiple of it, got --rollouts 3"),
    (dict(rollout_tp=2, engine="file"), "--rollout-tp 2 sends each rank only its slices, over point-to-point "
                                        "transfers, which --engine collective or ipc has; got --engine file"),
    (dict(rollout_tp=2, wire_format="delta"), "--rollout-tp 2 runs with --wire-format full, got --wire-format delta"),
    (dict(rollout_tp=2, engine="ipc", hybrid=True, device="npu-sim", trainer_ranks=1),
     "--hybrid --rollout-tp 2 puts trainer rank r and rollout rank r on device r: --trainer-ranks and --rollouts must be "
     "2, got 1 and 2"),
])
def test_a_tensor_parallel_rollout_refuses_what_cannot_work_naming_the_flag(flags, message):
    from hal.apps.cli.sync import Sync, validate

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(Sync(**{"device": "cpu", "model": "qwen2.5-tiny", **flags}))


def test_hal_plan_shows_each_ranks_share_and_refuses_a_tp_that_splits_a_head(capsys):
    from hal.apps.cli.main import main

    assert main(["plan", "--json", "--tensors", "model.layers.0.self_attn.*"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_bytes"] == 1_976_131_072 and [r["rank"] for r in out["rollouts"]] == [0, 1]
    assert all(0.5 <= r["fraction"] <= 0.501 for r in out["rollouts"])
    assert sum(p["bytes"] for p in out["rollouts"][0]["from"]) == out["rollouts"][0]["bytes"]
    q = out["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["trainer"] == ["[0:448, 0:896]", "[448:896, 0:896]"]
    assert q["rollout"][1] == "[448:896, 0:896] -> model.layers.0.self_attn.q_proj.weight[0:448, 0:896]"
    assert len(out["tensors"]) == 7  # the glob: q, k, v (weights and biases), o (no bias)
    assert main(["plan", "--rollout-tp", "4"]) == 2
    assert "--rollout-tp 4 does not divide the model's 14 attention heads" in capsys.readouterr().err


def _tp_rank(rank, world_size, device, corrupt):
    """A tensor-parallel rank of the tiny preset: its model from the plan, the full model's slices loaded through
    a ModelRolloutAdapter, the decode, and the slice checks (``corrupt``: flip one byte of rank 1's o_proj)."""
    import asyncio

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckpt
    import hal
    from ckpt.layout import named_weights
    from hal.apps.weightsync import models, tp
    from hal.apps.weightsync.verify import slice_checksums, verify_slices

    store = hal.launcher_store(timeout=60)
    hal.init_process_group(device, store=dist.PrefixStore("tp", store), rank=rank, world_size=world_size, timeout=60)
    dev = hal.get_device(device)
    module, layout = tp.tp_causal_lm("qwen2.5-tiny", torch.float32, dev,
                                     init_device_mesh(hal.resolve_device(device).name, (world_size,)))
    adapter = ckpt.ModelRolloutAdapter(module, atomic=True, agree=tp.agreement(dev))
    full = models.causal_lm("qwen2.5-tiny", torch.float32, "cpu", seed=5)
    weights = dict(named_weights(full))

    async def stream():
        for s in layout.slices:
            yield s.target, weights[s.name][s.region.index()].contiguous().to(dev)

    asyncio.run(adapter.update_weights(stream(), global_steps=7))
    if corrupt and rank == 1:
        adapter.state_dict()["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8)[5] ^= 1
    sums = slice_checksums(list(weights.items()), [layout.to_dict() if r == rank else None for r in range(2)])
    error = verify_slices(adapter, 7, sums, layout)
    prompt = models.prompt_ids("qwen2.5-tiny")
    tokens, logits = models.greedy_decode(module, prompt, 3)
    ref_tokens, ref_logits = models.greedy_decode(full, prompt, 3)
    local = {n: tuple(t.to_local().shape if hasattr(t, "to_local") else t.shape) for n, t in named_weights(module)}
    return {"error": error, "served": adapter.served_step, "tokens": (tokens, ref_tokens),
            "diff": float((logits - ref_logits).abs().max()), "local": local,
            "layout": {s.target: s.target_shape for s in layout.slices}}


@pytest.mark.multiprocess
def test_tp_ranks_built_from_the_plan_decode_as_the_whole_model_and_check_their_slices(hal_device):
    results = run_multiprocess(_tp_rank, 2, hal_device, False, timeout=180)
    for r in results.values():
        assert r["error"] is None and r["served"] == 7
        assert r["tokens"][0] == r["tokens"][1] and r["diff"] < 1e-4, r
        assert r["local"] == r["layout"]  # what the plan says each rank keeps is what its shards hold
    assert results[0]["local"]["model.embed_tokens.weight"] == (2048, 128)  # the vocabulary, split
    assert results[1]["local"]["model.layers.0.self_attn.o_proj.weight"] == (128, 64)


@pytest.mark.multiprocess
def test_a_corrupted_slice_is_named_by_the_rank_that_holds_it():
    results = run_multiprocess(_tp_rank, 2, "cpu", True, timeout=180)
    assert results[0]["error"] is None
    assert results[1]["error"].startswith("slice model.layers.0.self_attn.o_proj.weight[0:128, 64:128] in "
                                          "model.layers.0.self_attn.o_proj.weight[0:128, 0:64]: checksum"), results[1]


def test_hybrid_tensor_parallel_ranks_share_device_r_with_trainer_rank_r():
    from hal.apps.cli.sync import Sync, job_options

    options = job_options(Sync(device="npu-sim", model="qwen2.5-tiny", engine="ipc", hybrid=True, trainer_ranks=2,
                               rollout_tp=2))
    assert [options.device_of(i) for i in range(4)] == ["npu-sim:0", "npu-sim:1", "npu-sim:0", "npu-sim:1"]
    assert job_options(Sync(device="npu-sim", model="qwen2.5-tiny", trainer_ranks=2, rollout_tp=2)).device_of(3) == \
        "npu-sim"  # not hybrid: each rank its LOCAL_RANK's device


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device, flags", [("cpu", ()), ("npu-sim", ()), ("cpu", ("--engine", "ipc")),
                                           ("npu-sim", ("--engine", "ipc", "--hybrid"))])
def test_two_trainer_ranks_to_a_tp2_rollout_every_step_verified_each_rank_half_the_model(device, flags):
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--device", device, "--model",
                          "qwen2.5-tiny", "--trainer-ranks", "2", "--rollout-tp", "2", "--steps", "2",
                          "--bucket-mb", "1", "--timeout", "120", "--json", *flags],
                         capture_output=True, text=True, timeout=290, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["errors"] == [] and result["memory_within"] is True
    assert result["rollout_tp"] == 2 and result["publish_dtype"] == "float32"
    for row in result["rows"]:
        assert [(r["rank"], r["served_step"], r["error"]) for r in row["rollouts"]] == \
            [(2, row["global_steps"], None), (3, row["global_steps"], None)]
        for r in row["rollouts"]:
            assert r["tokens"] == row["tokens"] and r["logits_max_diff"] < 1e-4
            assert 0.5 <= r["received_fraction"] < 0.51, r  # half of every split tensor; norms whole
        if "--hybrid" in flags:  # rollout rank r on device r, beside trainer rank r; the trainer offloaded all
            assert [r["device"] for r in row["rollouts"]] == ["npu:0", "npu:1"]
            assert row["tensor_home"] == {"model": "cpu", "optimizer": "cpu", "grad": "cpu"}
