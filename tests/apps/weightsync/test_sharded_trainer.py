"""``hal sync --trainer-ranks N``: hal's FSDP2 trainer over N ranks, every rank publishing its own shards.

End to end on the tiny preset (npu-sim, everything offloaded): every step verified by decode and by
checksums of each rank's rows, every rank's peak within its bound, and no rank publishing (or holding as its
published copy) more than its rows of the model.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hal.apps.errors import UsageError
from hal.apps.weightsync.messages import Reference, Sent, merge_references, merge_sent

ROOT = pathlib.Path(__file__).resolve().parents[3]
TINY_BF16_BYTES = 1_788_160
"""The tiny preset's published bytes in bf16 (26 tensors; the tied embedding once)."""


def test_the_ranks_sends_merge_into_the_update_from_the_last_start_to_the_slowest_end():
    merged = merge_sent([Sent(t0=10.0, send_s=1.0), Sent(t0=10.5, send_s=0.25), Sent(t0=9.0, send_s=3.0)])
    assert (merged.t0, merged.send_s) == (10.5, 3.0)
    one = Sent(t0=1.0, send_s=2.0)
    assert merge_sent([one]) is one


def test_the_ranks_references_merge_their_row_checksums_and_keep_rank_0s_decode():
    import torch

    merged = merge_references([Reference({"w[0:2]": "aa"}, [1, 2], torch.zeros(2, 3)),
                               Reference({"w[2:4]": "bb"}, [9, 9], torch.ones(2, 3))])
    assert merged.sums == {"w[0:2]": "aa", "w[2:4]": "bb"}
    assert merged.tokens == [1, 2] and float(merged.logits.sum()) == 0.0


@pytest.mark.parametrize("flags, message", [
    (dict(engine="nixl"), "--trainer-ranks 2 needs an engine whose every trainer rank sends (collective; ipc with --rollout-tp), got --engine nixl"),
    (dict(engine="file"), "got --engine file"),
    (dict(launcher="ray"), "--trainer-ranks 2 runs with --launcher torchrun, got --launcher ray"),
    (dict(wire_format="delta"), "--trainer-ranks 2 runs with --wire-format full, got --wire-format delta"),
    (dict(compare_full=True), "--compare-full has no effect without --wire-format delta (got --wire-format full)"),
])
def test_a_sharded_trainer_refuses_what_it_cannot_run_naming_the_flag(flags, message):
    from hal.apps.cli.sync import Sync, validate

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(Sync(device="cpu", model="qwen2.5-tiny", trainer_ranks=2, **flags))


def test_a_sharded_trainer_takes_the_vllm_rollout_only_as_tensor_parallel_servers(monkeypatch):
    from hal.apps.cli import sync

    # vLLM's own checks come first and need vLLM installed (its lane has it): pass them here
    monkeypatch.setattr(sync, "validate_vllm", lambda args: None)
    with pytest.raises(UsageError, match=r"--trainer-ranks 2 runs with --rollout hal, or --rollout vllm as "
                                         r"tensor-parallel servers \(--rollout-tp > 1\); got --rollout vllm"):
        sync.validate(sync.Sync(device="cpu", model="qwen2.5-tiny", trainer_ranks=2, rollout="vllm"))
    assert sync.validate(sync.Sync(device="cpu", model="qwen2.5-tiny", trainer_ranks=2, rollout="vllm",
                                   rollout_tp=2)) is None


def test_trainer_ranks_must_be_positive_and_a_checkpoint_path_is_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hal.apps.cli.sync import Sync, validate

    with pytest.raises(UsageError, match="--trainer-ranks must be positive, got 0"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", trainer_ranks=0))
    save_file({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(UsageError, match="--trainer-ranks 2 trains a preset"):
        validate(Sync(device="cpu", model=str(tmp_path / "m.safetensors"), trainer_ranks=2))


def test_workers_are_named_trainer_ranks_first():
    from hal.apps.weightsync.launchers.torchrun import role
    from hal.apps.weightsync.worker import describe_worker

    assert [role(r, trainers=2) for r in range(3)] == ["trainer 0 (rank 0)", "trainer 1 (rank 1)",
                                                        "rollout 2 (rank 2)"]
    assert role(0) == "trainer (rank 0)" and describe_worker(0, None) == "trainer"
    assert [describe_worker(i, None, 2) for i in range(3)] == ["trainer rank 0", "trainer rank 1", "rollout rank 2"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device, offload", [("npu-sim", "all")])  # cpu (gloo) senders: tests/ckpt/test_multi_sender.py
def test_every_trainer_rank_publishes_its_rows_and_every_step_is_verified(device, offload):
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--device", device, "--model",
                          "qwen2.5-tiny", "--trainer-ranks", "2", "--rollouts", "1", "--steps", "2", "--offload", offload,
                          "--bucket-mb", "1", "--timeout", "120", "--json"],
                         capture_output=True, text=True, timeout=290, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "returned a view tensor" not in out.stderr  # FSDP2's warning for a loss that only reads the logits
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["errors"] == [] and result["memory_within"] is True
    assert result["trainer_ranks"] == 2 and result["ratio_vs_raw_min"] is None  # no raw reference
    losses = [row["loss"] for row in result["rows"]]
    assert losses[1] < losses[0]  # the sharded AdamW steps train
    for row in result["rows"]:
        assert (row["bytes"], row["tensors"]) == (TINY_BF16_BYTES, 26)  # every rank's rows add up to the model
        assert [(r["rank"], r["served_step"], r["error"], r["tokens"]) for r in row["rollouts"]] == \
            [(2, row["global_steps"], None, row["tokens"])]  # 2 senders x 2 rollouts: tests/ckpt/test_multi_sender.py
        ranks = row["trainer_ranks"]
        assert [t["rank"] for t in ranks] == [0, 1]
        published = [t["memory"]["terms"]["published_shard_bytes"] for t in ranks]
        assert sum(published) == TINY_BF16_BYTES and max(published) < 0.55 * TINY_BF16_BYTES
        for t in ranks:
            assert t["memory"]["within"] is True and 0 < t["peak_host_bytes"] <= t["memory"]["bound_bytes"]
            terms = t["memory"]["terms"]
            assert terms["buckets_bytes"] == 3 << 20  # the engine's send buffers: 3 buckets of 1 MiB
            # its shards only: half the fp32 parameters (the tiny preset is 3_576_320 bytes in bf16 x 2)
            assert terms["model_bytes"] == 2 * terms["published_shard_bytes"] * 2
        if offload == "all":  # the sim's shards were on the host when the rank staged them
            assert row["tensor_home"] == {"model": "cpu", "optimizer": "cpu", "grad": "cpu"}
            for t in ranks:  # the sim's device memory is the host's: the offload's host buffers count beside it
                terms = t["memory"]["terms"]
                assert terms["offload_buffers_bytes"] == terms["model_bytes"] + terms["optimizer_bytes"] > 0
