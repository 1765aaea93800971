"""FSDPEngine in a 2-process group: offload of local shards, exactness for every flag combination.

One engine cycles through the valid flag combinations, one per step (offload then onload between steps),
while a reference engine trains without offload; any inexact round trip would show in the final weights.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hal
from hal.apps.multiprocess import run_multiprocess
from tests.engines.models import host_copy, loss_for, make_model

pytestmark = pytest.mark.multiprocess

FLAGS = list(itertools.product([True, False], repeat=3))
VALID = [f for f in FLAGS if not (f[2] and not f[0])]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def meta_built_copy(engine, kind):
    """A forward-only engine built from the meta device: only this rank's shards allocated, refilled from
    ``engine``'s after free_shards/alloc_shards; returns what the test checks (bf16 compute through FSDP2's
    mixed precision: ``hal sync --trainer-ranks``' test)."""
    from engines import FSDPEngine

    with torch.device("meta"):
        module = make_model(0)
    copy = FSDPEngine(module, None, device=kind)
    device_type = hal.get_device(kind).type
    on_device = all(p.to_local().device.type == device_type for p in copy.module.parameters())
    params = dict(copy.module.named_parameters())
    local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in params.values())
    masters = dict(engine.module.named_parameters())
    freed = copy.free_shards()
    empty = all(p.to_local().is_meta for p in params.values())
    copy.alloc_shards()
    with torch.no_grad():
        for name, p in params.items():
            p.to_local().copy_(masters[name].to_local())
        copy.module.scale.copy_(engine.module.scale)  # a buffer: to_empty leaves it uninitialised
    tokens = torch.arange(8, device=hal.get_device(kind)).reshape(1, 8) % 32
    with torch.no_grad():
        got, want = copy.module(tokens), engine.module(tokens)
    copy.reshard()
    return {"on_device": on_device, "freed": freed, "empty_after_free": empty,
            "local_bytes": local_bytes,
            "equal": torch.equal(got, want)}


def _fsdp_worker(rank, world_size, kind):
    import torch.distributed as dist

    from engines import FSDPEngine, OffloadError

    hal.init_process_group(kind, timeout=30)
    try:
        memory = hal.get_torch_device(kind)
        reference = FSDPEngine(make_model(0), _adamw, device=kind)
        engine = FSDPEngine(make_model(0), _adamw, device=kind)
        out = {"raised": [], "steps": [], "reports_memory": memory.memory_allocated() > 0}
        for model, optimizer, grad in FLAGS:
            if grad and not model:
                try:
                    engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
                except OffloadError:
                    out["raised"].append((model, optimizer, grad))
        for step, flags in enumerate(VALID):
            reference.train_step(loss_for(step, reference.torch_device))
            engine.train_step(loss_for(step, engine.torch_device))
            before = memory.memory_allocated()
            engine.to("cpu", *flags)
            out["steps"].append((flags, engine.tensor_home(), engine.last_moved_bytes,
                                 before - memory.memory_allocated()))
            engine.to(kind, *flags)
        identity = all(a is b for a, b in zip(engine.module.parameters(), engine.optimizer.param_groups[0]["params"]))
        expected, got = host_copy(reference.get_per_tensor_param()[0]), host_copy(engine.get_per_tensor_param()[0])
        out["identity"] = identity
        out["equal"] = list(got) == list(expected) and all(torch.equal(got[n], expected[n]) for n in got)
        # tensors would travel through shared memory that dies with this process: send numpy arrays
        out["full"] = {n: t.numpy() for n, t in got.items()}
        out["meta"] = meta_built_copy(engine, kind)
        return out
    finally:
        dist.destroy_process_group()


def test_fsdp_offload_between_steps_is_exact_for_every_flag_combination(hal_device):
    results = run_multiprocess(_fsdp_worker, 2, hal_device, timeout=110)
    spec = hal.resolve_device(hal_device)
    # the unsharded reference: same data on both ranks, so FSDP's averaged gradient equals the local one
    from engines import TorchEngine

    model = make_model(0)
    single = TorchEngine(model, _adamw(model.parameters()), "cpu")
    for step in range(len(VALID)):
        single.train_step(loss_for(step, single.torch_device))
    unsharded = host_copy(single.get_per_tensor_param()[0])
    for rank in (0, 1):
        r = results[rank]
        assert r["raised"] == [f for f in FLAGS if f[2] and not f[0]]
        assert r["equal"] and r["identity"]
        full = {n: torch.from_numpy(a) for n, a in r["full"].items()}
        assert list(full) == list(unsharded)
        meta = r["meta"]  # built from the meta device: shards only, released and given back in place
        assert meta["on_device"] and meta["empty_after_free"]
        assert meta["freed"] >= meta["local_bytes"] > 0  # padded shards: at least the unpadded bytes
        assert meta["equal"]  # the same weights, refilled into the given-back storages, compute the same
        for name in full:
            # close, not bit-equal: sharded reduction order differs; the offload guarantee is r["equal"] above
            torch.testing.assert_close(full[name], unsharded[name], rtol=1e-5, atol=1e-6, msg=name)
        assert [flags for flags, *_ in r["steps"]] == VALID
        for (model_f, optimizer_f, grad_f), where, moved, freed in r["steps"]:
            combo = (model_f, optimizer_f, grad_f)
            if spec.host_memory:
                assert moved == 0 and where.model == where.optimizer == where.grad == "cpu", combo
                continue
            assert where.model == ("cpu" if model_f else spec.name), combo
            assert where.grad == ("cpu" if grad_f else spec.name), combo
            assert where.optimizer == ("cpu" if optimizer_f else spec.name), combo
            assert (moved > 0) == (model_f or optimizer_f), combo
            if r["reports_memory"]:
                assert freed >= moved, combo
