"""Rank functions for a LoRA adapter update from hal's ipc sender into verl's own ``BucketedWeightReceiver`` (issue
48): rank 0 is hal's LoRA trainer (the job's publisher, staging the adapter in the ipc engine's publish buffer),
rank 1 receives with verl's receiver and a callback written as verl 0.9.1's ``update_weights_from_ipc`` writes it
for ``peft_config`` and ``base_sync_done=True`` (clone every bucket's tensors, build the adapter's tensor dict
on ``is_last``), then loads that dict into a peft model of its own, as vLLM's ``add_lora`` gets it."""

from __future__ import annotations

import asyncio
import json

import torch

from ckpt.ipc import rollout_endpoint
from tests.ckpt import ipc_workers
from tests.ckpt.ipc_workers import digest, engine, meet, trainer_done
from tests.interop.verl_ipc_workers import verl_transfer

PRESET = "qwen2.5-tiny"
STEPS = (1, 2)


def trainer(rank: int, world_size: int, bucket_size: int) -> dict:
    from hal.apps.weightsync import models
    from hal.apps.weightsync.lora import LoraPublisher
    from hal.apps.weightsync.options import JobOptions

    endpoint, pids = meet(rank, world_size)
    store = ipc_workers._STORES[-1]  # the one meet() connected (rank 0 hosts it)
    module, _ = models.build(PRESET)
    publisher = LoraPublisher(module, JobOptions(device="npu-sim", model=PRESET, lora_rank=8), torch.bfloat16)
    publisher.base_due = None  # the base went before: this is an adapter update
    eng = engine(0, 2, endpoint, pids, "npu-sim", bucket_size)
    sent, names = [], None
    for step in STEPS:
        with torch.no_grad():  # a training step's worth of change in every adapter weight
            for name, p in publisher.model.named_parameters():
                if ".lora_" in name:
                    p.add_(torch.full_like(p, 0.01 * step))
        bank, layout = publisher.stage(eng, torch.device("npu", 0))
        kwargs = publisher.update_kwargs()
        store.set(f"peft/{step}", json.dumps(kwargs))  # the job's control plane: beside the update, not in it
        update = layout.views(bank)
        asyncio.run(eng.send_weights(update, step))
        sent.append(digest(update))
        from peft import get_peft_model_state_dict

        names = list(get_peft_model_state_dict(publisher.model))
    eng.close()
    trainer_done(rank)
    return {"sent": sent, "peft_names": names, "kwargs": kwargs}


def verl_rollout(rank: int, world_size: int, bucket_size: int) -> list[dict]:
    import peft

    from ckpt.lora import lora_config
    from hal.apps.weightsync import models

    endpoint, _ = meet(rank, world_size)
    store = ipc_workers._STORES[-1]
    receiver_cls = verl_transfer().BucketedWeightReceiver
    out = []
    for step in STEPS:
        kwargs = json.loads(store.get(f"peft/{step}"))
        peft_config, base_sync_done = kwargs["peft_config"], kwargs["base_sync_done"]
        applied: list[dict] = []
        lasts: list[bool] = []
        # verl 0.9.1 vLLMColocateWorkerExtension.update_weights_from_ipc, its LoRA branch
        lora_weights: dict[str, torch.Tensor] | None = {} if (peft_config and base_sync_done) else None

        def on_bucket_received(weights, is_last, lora_weights=lora_weights, applied=applied, lasts=lasts,
                               peft_config=peft_config):
            lasts.append(is_last)
            if lora_weights is not None:
                lora_weights.update((name, tensor.clone()) for name, tensor in weights)
                if not is_last:
                    return
                applied.append({"peft_config": peft_config, "lora_tensors": dict(lora_weights)})  # add_lora's
                lora_weights.clear()
                return
            raise AssertionError("a base update reached the adapter test")

        receiver_cls(rollout_endpoint(endpoint, 1), torch.device("npu", 1), use_shm=True).receive_weights(
            on_bucket_received)
        [request] = applied
        tensors = request["lora_tensors"]
        served = peft.get_peft_model(models.causal_lm(PRESET, torch.bfloat16, seed=None),
                                     lora_config(request["peft_config"]), autocast_adapter_dtype=False)
        loaded = peft.set_peft_model_state_dict(served, {n: t.cpu() for n, t in tensors.items()})
        out.append({"digest": digest(list(tensors.items())), "lasts": lasts, "base_sync_done": base_sync_done,
                    "r": request["peft_config"]["r"], "unexpected": list(loaded.unexpected_keys),
                    "missing_adapter": [k for k in loaded.missing_keys if ".lora_" in k],
                    "devices": sorted({str(t.device) for t in tensors.values()})})
    trainer_done(rank)
    return out


def adapter_update_into_verls_receiver(rank: int, world_size: int, bucket_size: int):
    return (trainer if rank == 0 else verl_rollout)(rank, world_size, bucket_size)
