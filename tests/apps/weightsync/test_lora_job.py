"""``hal sync --lora-rank R`` (issue 48): the base goes to a rollout once, then each update carries only the
adapter with its ``peft_config``, every step verified by decode and the adapter's checksums; a rollout that is
replaced or lost its base gets the base again before the next adapter; ``--lora-publish merged`` publishes whole
weights; one torchrun run as a user runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt import LoraRolloutAdapter
from ckpt.errors import TransferError
from ckpt.lora import is_adapter_tensor
from hal.apps.weightsync.launchers.colocated import local_group
from hal.apps.weightsync.loop import Job, run
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.rollout import Rollout

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = pathlib.Path(__file__).resolve().parents[3]
MERGED_BYTES = 1_788_160  # the tiny preset in bf16, 26 tensors
ADAPTER_BYTES = 74_752  # rank 8 on its 14 linear layers (2 x 7), bf16, 28 tensors
BROKEN = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"  # the tensor DropsOneAdapterByte flips
OPTIONS = JobOptions(device="cpu", model="qwen2.5-tiny", rollouts=2, steps=3, engine="colocated", timeout=60.0,
                     bucket_bytes=1 << 20, lr=3e-2, lora_rank=8)


def check_adapter_row(row: dict, step: int, rollouts: int = 2, base: bool = False) -> None:
    """A verified LoRA step: the adapter alone (or the base and the adapter), every rollout serving the step with
    the trainer's tokens and logits, bit for bit."""
    lora = row["lora"]
    assert lora["publish"] == "adapter" and lora["base_sync_done"] is (not base)
    assert lora["merged_bytes"] == MERGED_BYTES and lora["adapter_bytes"] == ADAPTER_BYTES
    assert (row["bytes"], row["tensors"]) == ((MERGED_BYTES + ADAPTER_BYTES, 54) if base else (ADAPTER_BYTES, 28))
    assert [(r["rank"], r["served_step"], r["error"], r["needs_base"]) for r in row["rollouts"]] == \
        [(rank, step, None, False) for rank in range(1, rollouts + 1)]
    assert all(r["tokens"] == row["tokens"] and r["logits_max_diff"] == 0.0 for r in row["rollouts"])
    assert lora["adapter_logits_shift"] > 0.1  # the adapter moves the model: serving without it would fail


def test_the_base_once_then_the_adapter_alone_every_step_verified():
    job = Job(OPTIONS, local_group(OPTIONS))

    async def scenario():
        await job.start()
        warmup = await job.warmup()
        rows = []
        for step in (1, 2, 3):
            rows.append(await job.step(step))
            assert all(map(is_adapter_tensor, job.checksums[step]))
            rows[-1]["sums"] = job.checksums[step]
        await job.close()
        return warmup, rows

    warmup, rows = asyncio.run(scenario())
    assert warmup["errors"] == [] and warmup["lora"]["base_sync_done"] is False
    assert warmup["sent_bytes"] == MERGED_BYTES + ADAPTER_BYTES
    for step, row in enumerate(rows, start=1):
        check_adapter_row(row, step)
        assert len(row["sums"]) == 28  # the adapter's tensors, checksummed on both sides
    assert rows[0]["sums"] != rows[2]["sums"] and rows[2]["loss"] < rows[0]["loss"]  # it trained
    assert rows[2]["tokens"] != rows[0]["tokens"]  # and the adapter changes what the model says
    # the trainer's bound states what LoRA adds: the publish buffer and its own published base
    terms = rows[0]["memory"]["terms"]
    assert terms["lora_decode_base_bytes"] == MERGED_BYTES
    assert terms["lora_publish_bytes"] == MERGED_BYTES + ADAPTER_BYTES


def test_merged_publishing_sends_whole_weights_every_step():
    options = JobOptions(**{**OPTIONS.__dict__, "lora_publish": "merged", "steps": 2})
    result = asyncio.run(run(options, local_group(options)))
    assert result.report(2)["verified"] is True
    for step, row in enumerate(result.rows, start=1):
        assert row["lora"]["publish"] == "merged" and row["lora"]["base_sync_done"] is None
        assert (row["bytes"], row["tensors"]) == (MERGED_BYTES, 26)
        assert [(r["served_step"], r["error"]) for r in row["rollouts"]] == [(step, None)] * 2
        assert all(r["tokens"] == row["tokens"] and r["logits_max_diff"] == 0.0 for r in row["rollouts"])


def test_a_replaced_rollout_gets_the_base_again_before_the_next_adapter():
    job = Job(OPTIONS, local_group(OPTIONS))

    async def scenario():
        await job.start()
        await job.warmup()
        rows = [await job.step(1)]
        await job.replace_rollout(2)  # a new rollout: zeros, no base
        assert job.group.workers[2].adapter.needs_base
        rows += [await job.step(2), await job.step(3)]
        await job.close()
        return rows

    first, second, third = asyncio.run(scenario())
    check_adapter_row(first, 1)
    check_adapter_row(second, 2, base=True)  # the base, then the adapter, to everyone: verified
    check_adapter_row(third, 3)


class FailsInTransit:
    """The rollout's view of the shared engine, failing the update to ``step`` after its first tensor."""

    def __init__(self, engine, step: int) -> None:
        self.engine, self.step = engine, step

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def receive_weights(self, global_steps=None, **kwargs):
        count = 0
        async for name, tensor in self.engine.receive_weights(global_steps, **kwargs):
            if global_steps == self.step and count == 1:
                raise TransferError(f"cut in transit at tensor {name!r}")
            count += 1
            yield name, tensor


def test_a_rollout_that_lost_its_base_says_so_and_gets_it_before_any_adapter():
    options = JobOptions(**{**OPTIONS.__dict__, "rollout_apply": "in-place"})
    group = local_group(options)
    group.workers[2] = Rollout(options, FailsInTransit(group.workers[0].engine, 0), 2)  # its base is cut off
    job = Job(options, group)

    async def scenario():
        await job.start()
        warmup = await job.warmup()
        rows = [await job.step(1), await job.step(2)]
        await job.close()
        return warmup, rows

    warmup, (first, second) = asyncio.run(scenario())
    assert warmup["errors"] == ["rollout rank 2: TransferError: cut in transit at tensor 'model.layers.0.self_attn."
                                "q_proj.weight'"]
    check_adapter_row(first, 1, base=True)  # rollout 2 said needs_base: the next publish carried the base
    check_adapter_row(second, 2)


class DropsOneAdapterByte(LoraRolloutAdapter):
    """Serves every update but with one byte of layer 0's ``q_proj.lora_B`` flipped after applying it."""

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        await super().update_weights(weights, global_steps, wire_format, **kwargs)
        with torch.no_grad():
            self.module.model.layers[0].self_attn.q_proj.lora_B["default"].weight.view(torch.uint8)[0] ^= 1


def test_the_weight_check_compares_the_adapter_the_rollouts_serve():
    """--check-every 1 with --lora-rank: every adapter update is weight-checked against the rollouts' live adapter."""
    options = dataclasses.replace(OPTIONS, check_every=1, steps=2)
    group = local_group(options)
    group.workers[2] = Rollout(options, group.workers[0].engine, 2, adapter_cls=DropsOneAdapterByte)
    result = asyncio.run(run(options, group))
    for row in result.rows:
        assert row["lora"]["base_sync_done"] is True and row["check"]["checked"] == 2
        [(who, found)] = row["check"]["mismatches"].items()
        assert found[0].startswith(f"'{BROKEN}' differs"), found
    assert result.report(2)["verified"] is False
    assert any(e.startswith(f"step 1, rollout rank 2: tensor '{BROKEN}': checksum ") for e in result.errors), \
        result.errors


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device, engine", [("cpu", "collective"), ("cpu", "ipc"), ("cpu", "file"),
                                            ("npu-sim", "collective"), ("npu-sim", "ipc"), ("npu-sim", "file"),
                                            ("cpu", "nixl"), ("cpu", "mooncake"), ("npu-sim", "kimi")])
def test_torchrun_runs_the_lora_job_verified(device, engine):
    available, why = ckpt.checkpoint_engine_availability(engine, device)
    if not available:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--device", device, "--model",
                          "qwen2.5-tiny", "--steps", "2", "--rollouts", "1", "--timeout", "120", "--json", "--engine",
                          engine, "--bucket-mb", "1", "--lora-rank", "8", "--lr", "3e-2"],
                         capture_output=True, text=True, timeout=290, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["verified"] is True and result["errors"] == [] and result["memory_within"] is True
    assert (result["device"], result["engine"]) == (device, engine)
    assert result["lora"] == {"rank": 8, "alpha": 16, "targets": [], "publish": "adapter"}
    assert result["warmup"]["lora"]["base_sync_done"] is False
    for step, row in enumerate(result["rows"], start=1):
        check_adapter_row(row, step, rollouts=1)
        assert row["rollouts"][0]["device"] == ("npu:1" if device == "npu-sim" else "cpu")
