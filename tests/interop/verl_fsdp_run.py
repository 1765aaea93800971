"""Run in a fresh process with HAL_DEVICE=npu-sim: verl 0.9.1's own FSDPEngine (FSDP2) on the simulated npu.

``python -m tests.interop.verl_fsdp_run PORT`` prints one ``RESULT <json>`` line. The engine is built as verl
builds it (``HFModelConfig`` of a tiny Qwen2 checkpoint written with ``save_pretrained``,
``FSDPEngineConfig(strategy="fsdp2")``, ``FSDPOptimizerConfig``, ``initialize()``), on a 1-rank ``hccl``
process group. Each of the 8 ``(model, optimizer, grad)`` combinations of ``FSDPEngine.to`` gets a fresh
engine: 2 training steps, ``to("cpu", ...)``, placement and device memory checked, ``to("npu", ...)``,
2 more steps; the final weights and optimizer states are compared byte for byte with an engine that
trained 4 steps without moving.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _digest(engine) -> str:
    """sha256 over every parameter's and optimizer state's bytes (full tensors, on the host)."""
    h = hashlib.sha256()
    for name, p in sorted(engine.module.named_parameters()):
        h.update(name.encode())
        h.update(p.full_tensor().detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for p in engine.module.parameters():
        for key, value in sorted(engine.optimizer.state[p].items()):
            t = value.full_tensor() if hasattr(value, "full_tensor") else value
            h.update(key.encode())
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _step(engine, ids: torch.Tensor) -> None:
    engine.optimizer_zero_grad()
    logits = engine.module(input_ids=ids.to("npu")).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().to("npu"))
    loss.backward()
    engine.optimizer_step()


def _placement(engine) -> dict:
    params = {p.device.type for p in engine.module.parameters()}
    grads = {p.grad.device.type for p in engine.module.parameters() if p.grad is not None}
    states = {v.device.type for p in engine.module.parameters() for k, v in engine.optimizer.state[p].items()
              if torch.is_tensor(v) and k != "step"}
    return {"params": sorted(params), "grads": sorted(grads), "states": sorted(states)}


def _storages(engine) -> dict:
    """Per group (model: parameters, gradients, buffers; optimizer: states): tensor bytes on the device and
    the number of distinct storages holding them (``*_count``)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    groups = {
        "model": [local(p) for p in engine.module.parameters()]
        + [local(p.grad) for p in engine.module.parameters() if p.grad is not None]
        + list(engine.module.buffers()),
        "optimizer": [local(v) for p in engine.module.parameters() for k, v in engine.optimizer.state[p].items()
                      if torch.is_tensor(v) and k != "step"],
    }
    out = {}
    for name, tensors in groups.items():
        on_device = [t for t in tensors if t.device.type == "npu"]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in on_device}
        out[name] = sum(t.nbytes for t in on_device)
        out[f"{name}_count"] = len(storages)
    return out


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="hal-verl-fsdp-") as folder:  # the model verl loads, removed after
        return run(folder)


def run(folder: str) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    from tests.ports import pick_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pick_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("hccl", rank=0, world_size=1)

    from verl.trainer.config import CheckpointConfig
    from verl.utils.device import get_device_name, get_nccl_backend, is_npu_available
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    def build():
        engine = FSDPEngine(HFModelConfig(path=folder, load_tokenizer=False),
                            FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype="fp32"),
                            FSDPOptimizerConfig(lr=1e-2), CheckpointConfig())
        engine.initialize()
        return engine

    batches = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    out = {"device": get_device_name(), "backend": get_nccl_backend(), "npu": is_npu_available,
           "pg_backend": dist.get_backend(), "combos": {}}
    reference = build()
    out["module"] = type(reference.module).__name__
    out["param_type"] = type(next(reference.module.parameters())).__name__
    out["initial"] = _digest(reference)
    for ids in batches:
        _step(reference, ids)
    out["reference"] = _digest(reference)
    del reference
    for model, optimizer, grad in itertools.product((True, False), repeat=3):
        key = f"model={model},optimizer={optimizer},grad={grad}"
        engine = build()
        for ids in batches[:2]:
            _step(engine, ids)
        storages = _storages(engine)
        before = torch.npu.memory_allocated()
        try:
            engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
        except AssertionError as exc:
            out["combos"][key] = {"error": f"AssertionError: {exc}", "placement": _placement(engine)}
            del engine
            continue
        offloaded = _placement(engine)
        freed = before - torch.npu.memory_allocated()
        engine.to("npu", model=model, optimizer=optimizer, grad=grad)
        onloaded = _placement(engine)
        for ids in batches[2:]:
            _step(engine, ids)
        out["combos"][key] = {"offloaded": offloaded, "onloaded": onloaded, "freed": freed,
                              "storages": storages, "digest": _digest(engine)}
        del engine
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    print("RESULT " + json.dumps(main()), flush=True)
