"""Workers carry global_steps end to end; the in-memory rollout adapter applies updates all-or-nothing."""

import asyncio

import pytest
import torch

import ckpt
from ckpt.testing import same_bytes


class Trainer:
    def __init__(self, weights):
        self.weights = weights

    def get_per_tensor_param(self):
        return ((n, t) for n, t in self.weights.items())


def _weights(step):
    return {"a": torch.full((4, 4), float(step)), "b": torch.arange(6, dtype=torch.int64) + step,
            "c": torch.full((3,), float(step)).to(torch.bfloat16)}


def _round(trainer_worker, rollout_worker, step, asked=None):
    async def go():
        _, served = await asyncio.gather(trainer_worker.update_weights(step), rollout_worker.update_weights(asked))
        return served
    return asyncio.run(go())


def test_global_steps_travel_from_trainer_to_the_served_weights():
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    trainer = Trainer(_weights(1))
    adapter = ckpt.InMemoryRolloutAdapter(_weights(0))
    assert adapter.served_step is None
    tw, rw = ckpt.TrainerWorker(trainer, channel), ckpt.CheckpointEngineWorker(channel, adapter)
    for step in (1, 2, 3):
        trainer.weights = _weights(step)
        assert _round(tw, rw, step, asked=step if step != 2 else None) == step
        assert adapter.served_step == step
        assert all(same_bytes(adapter.state_dict()[n], t) for n, t in _weights(step).items())


def test_verl_style_tuple_from_get_per_tensor_param_is_accepted():
    class VerlTrainer(Trainer):
        def get_per_tensor_param(self):
            return iter(self.weights.items()), None  # (per_tensor_param, peft_config)

    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    adapter = ckpt.InMemoryRolloutAdapter()
    assert _round(ckpt.TrainerWorker(VerlTrainer(_weights(4)), channel),
                  ckpt.CheckpointEngineWorker(channel, adapter), 4) == 4
    assert sorted(adapter.state_dict()) == ["a", "b", "c"]


def test_version_mismatch_keeps_the_previous_weights_and_step():
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    adapter = ckpt.InMemoryRolloutAdapter(_weights(1))
    tw, rw = ckpt.TrainerWorker(Trainer(_weights(1)), channel), ckpt.CheckpointEngineWorker(channel, adapter)
    _round(tw, rw, 1, 1)
    tw.engine.weights = _weights(3)
    with pytest.raises(ckpt.VersionMismatchError, match="asked for global_steps=2.*global_steps=3"):
        _round(tw, rw, 3, 2)
    assert adapter.served_step == 1
    assert same_bytes(adapter.state_dict()["a"], _weights(1)["a"])


@pytest.mark.parametrize("bad, message", [
    ({"a": torch.zeros(4, 5)}, r"tensor 'a': received torch.float32 \(4, 5\), the rollout expects torch.float32 \(4, 4\)"),
    ({"b": torch.zeros(6, dtype=torch.int32)}, r"tensor 'b': received torch.int32"),
    ({"zzz": torch.zeros(1)}, r"the update lacks 1 of the 3 tensors the rollout expects \('b'\) and carries 1 "
                              r"tensor\(s\) the rollout does not expect \('zzz'\); nothing applied"),
    ({}, r"the update lacks 1 of the 3 tensors the rollout expects \('b'\); nothing applied$"),
])
def test_weight_mismatch_names_the_tensor_and_applies_nothing(bad, message):
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    adapter = ckpt.InMemoryRolloutAdapter({n: (tuple(t.shape), t.dtype) for n, t in _weights(0).items()})
    tw, rw = ckpt.TrainerWorker(Trainer(_weights(1)), channel), ckpt.CheckpointEngineWorker(channel, adapter)
    _round(tw, rw, 1)
    tw.engine.weights = {"a": _weights(2)["a"], **bad, "c": _weights(2)["c"]}  # 'a' is fine and comes first
    with pytest.raises(ckpt.WeightMismatchError, match=message):
        _round(tw, rw, 2)
    assert adapter.served_step == 1
    assert all(same_bytes(adapter.state_dict()[n], t) for n, t in _weights(1).items())  # 'a' staged, not applied


def test_a_stream_failing_mid_update_leaves_the_previous_step_in_service():
    adapter = ckpt.InMemoryRolloutAdapter()

    async def stream(step, fail):
        yield "a", torch.full((2,), float(step))
        if fail:
            raise ckpt.TransferError("peer died")
        yield "b", torch.full((2,), float(step))

    asyncio.run(adapter.update_weights(stream(1, False), global_steps=1))
    with pytest.raises(ckpt.TransferError, match="peer died"):
        asyncio.run(adapter.update_weights(stream(2, True), global_steps=2))
    assert adapter.served_step == 1
    assert adapter.state_dict()["a"].tolist() == [1.0, 1.0]


def test_colocated_engine_is_zero_copy_and_refuses_a_second_offer_in_flight():
    engine = ckpt.ColocatedCheckpointEngine(timeout=0.2)
    t = torch.ones(3)

    async def go():
        first = asyncio.ensure_future(engine.send_weights([("t", t)], 1))
        await asyncio.sleep(0)  # the first offer is in flight
        with pytest.raises(ckpt.SendInProgressError, match="still sending global_steps=1"):
            await engine.send_weights([("t", t)], 2)
        got = [x async for _, x in engine.receive_weights(1)]
        await first
        with pytest.raises(ckpt.TransferTimeoutError, match="0.2 s"):
            async for _ in engine.receive_weights(None):
                pass
        return got

    (got,) = asyncio.run(go())
    assert got is t  # the trainer's own tensor, not a copy


def test_colocated_send_alone_times_out_withdraws_and_the_next_update_works():
    engine = ckpt.ColocatedCheckpointEngine(timeout=0.2)

    async def go():
        with pytest.raises(ckpt.TransferTimeoutError, match="no receiver took the offer .*concurrently"):
            await engine.send_weights([("t", torch.ones(2))], 1)
        with pytest.raises(ckpt.TransferTimeoutError, match="no weights were offered"):  # withdrawn
            async for _ in engine.receive_weights(1):
                pass
        _, got = await asyncio.gather(engine.send_weights([("t", torch.full((2,), 2.0))], 2),
                                      _collect(engine.receive_weights(2)))
        return got

    assert asyncio.run(go()) == [("t", [2.0, 2.0])]


async def _collect(stream):
    return [(n, t.tolist()) async for n, t in stream]


def test_colocated_send_waits_for_each_tensor_and_reraises_the_trainers_error():
    engine = ckpt.ColocatedCheckpointEngine(timeout=5)
    events = []

    def weights(fail):
        for i in range(3):
            events.append(f"produce {i}")
            if fail and i == 2:
                raise RuntimeError("gather failed on tensor 2")
            yield f"w{i}", torch.full((2,), float(i))

    async def send(fail):
        await engine.send_weights(weights(fail), 1)
        events.append("send returned")

    async def receive():
        async for name, _ in engine.receive_weights(1):
            await asyncio.sleep(0.01)  # a slow consumer: the sender must not return meanwhile
            events.append(f"consumed {name}")

    async def both(fail):
        return await asyncio.wait_for(asyncio.gather(send(fail), receive(), return_exceptions=True), 10)

    assert asyncio.run(both(False)) == [None, None]
    assert events == ["produce 0", "consumed w0", "produce 1", "consumed w1", "produce 2", "consumed w2",
                      "send returned"]
    events.clear()
    results = asyncio.run(both(True))
    assert isinstance(results[0], RuntimeError) and "tensor 2" in str(results[0])
    assert isinstance(results[1], ckpt.TransferAbortedError) and "tensor 2" in str(results[1])


def test_adapter_takes_verls_keywords_and_plain_generators():
    adapter = ckpt.InMemoryRolloutAdapter(_weights(0))
    asyncio.run(adapter.update_weights(iter(_weights(1).items()), global_steps=1, wire_format="named_tensors",
                                       base_sync_done=True))
    assert adapter.served_step == 1 and same_bytes(adapter.state_dict()["a"], _weights(1)["a"])
    with pytest.raises(ckpt.CheckpointConfigError, match="wire_format must be 'named_tensors', got 'delta_flush'"):
        asyncio.run(adapter.update_weights(iter(_weights(2).items()), global_steps=2, wire_format="delta_flush"))
    assert adapter.served_step == 1 and same_bytes(adapter.state_dict()["a"], _weights(1)["a"])


class _OldAdapter:
    """An adapter that does not take verl's keywords: calling it raises TypeError before it reads anything."""

    async def update_weights(self, weights, global_steps):
        raise AssertionError("not reached")


def test_a_failed_apply_leaves_the_colocated_engine_ready_for_the_next_update():
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    tw = ckpt.TrainerWorker(Trainer(_weights(1)), channel)
    with pytest.raises(TypeError, match="wire_format"):
        _round(tw, ckpt.CheckpointEngineWorker(channel, _OldAdapter()), 1, 1)
    adapter = ckpt.InMemoryRolloutAdapter()
    tw.engine.weights = _weights(2)
    assert _round(tw, ckpt.CheckpointEngineWorker(channel, adapter), 2, 2) == 2  # nothing stale was left
    assert adapter.served_step == 2 and same_bytes(adapter.state_dict()["b"], _weights(2)["b"])


def test_a_named_colocated_channel_serves_two_rollouts_through_verls_lifecycle():
    from ckpt.colocated import ColocatedCheckpointEngine

    trainer_engine = ColocatedCheckpointEngine(bucket_size=1 << 20, is_master=True, channel="test-fanout", timeout=5)
    rollout_engines = [ColocatedCheckpointEngine(bucket_size=1 << 20, channel="test-fanout", timeout=5) for _ in range(2)]
    assert all(e is trainer_engine for e in rollout_engines)  # one hand-over per process and channel
    trainer = Trainer(_weights(0))
    adapters = [ckpt.InMemoryRolloutAdapter(_weights(0)) for _ in rollout_engines]
    tw = ckpt.TrainerWorker(trainer, trainer_engine)
    rws = [ckpt.CheckpointEngineWorker(e, a) for e, a in zip(rollout_engines, adapters)]

    async def update(step, asked):
        metadata = [e.prepare() for e in [trainer_engine, *rollout_engines]]
        tkw, rkw = ColocatedCheckpointEngine.build_topology(1, 2, metadata)
        trainer_engine.init_process_group(**{k: v[0] for k, v in tkw.items()})
        for i, e in enumerate(rollout_engines):
            e.init_process_group(**{k: v[i] for k, v in rkw.items()})
        results = await asyncio.gather(tw.update_weights(step), *(rw.update_weights(a) for rw, a in zip(rws, asked)),
                                       return_exceptions=True)
        trainer_engine.finalize()
        return results[1:]

    for step in (1, 2, 3):
        trainer.weights = _weights(step)
        assert asyncio.run(update(step, [step, step])) == [step, step]
        for adapter in adapters:
            assert adapter.served_step == step
            assert all(same_bytes(adapter.state_dict()[n], t) for n, t in _weights(step).items())
    trainer.weights = _weights(4)
    got = asyncio.run(update(4, [4, 5]))
    assert got[0] == 4 and isinstance(got[1], ckpt.VersionMismatchError) and adapters[1].served_step == 3
    trainer.weights = _weights(5)
    assert asyncio.run(update(5, [5, 5])) == [5, 5]


def test_torch_engine_get_per_tensor_param_has_verls_shape():
    from engines.torch_engine import TorchEngine

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    engine = TorchEngine(model, None, device="cpu")
    per_tensor_param, peft_config = engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    assert peft_config is None
    got = dict(per_tensor_param)
    assert list(got) == list(model.state_dict()) and len(got) == 6
    assert all(same_bytes(got[n], t) for n, t in model.state_dict().items())
    # hal's trainer worker publishes it as verl's ActorRolloutRefWorker does (unpacking the pair)
    channel = ckpt.get_checkpoint_engine("colocated", timeout=5)
    adapter = ckpt.InMemoryRolloutAdapter()
    assert _round(ckpt.TrainerWorker(engine, channel), ckpt.CheckpointEngineWorker(channel, adapter), 7, 7) == 7
    assert sorted(adapter.state_dict()) == sorted(model.state_dict())


class RecordingEngine(ckpt.CheckpointEngine):
    """Yields one fixed tensor as step 1 and records the keywords ``receive_weights`` was called with."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def send_weights(self, weights, global_steps=None):
        raise NotImplementedError

    async def receive_weights(self, global_steps=None, **kwargs):
        self.calls.append(kwargs)
        self.received_global_steps = 1
        yield "a", torch.full((4, 4), 1.0)


class PlacedAdapter(ckpt.InMemoryRolloutAdapter):
    """An in-memory adapter offering a receive placement (a ``ReceivePlacement``: ``target``)."""

    class Placement:
        def target(self, name, dtype, shape):
            return None

    receive_placement = Placement()


def test_the_adapters_placement_is_passed_by_keyword_and_no_placement_means_the_plain_call():
    engine = RecordingEngine()
    adapter = PlacedAdapter()
    assert asyncio.run(ckpt.CheckpointEngineWorker(engine, adapter).update_weights(1)) == 1
    assert engine.calls == [{"placement": adapter.receive_placement}]
    assert isinstance(adapter.receive_placement, ckpt.serving.ReceivePlacement)
    engine.calls.clear()
    assert asyncio.run(ckpt.CheckpointEngineWorker(engine, ckpt.InMemoryRolloutAdapter()).update_weights(1)) == 1
    assert engine.calls == [{}]  # verl's engines take no placement


def test_a_failed_apply_restores_the_engines_received_step():
    engine = RecordingEngine()
    engine.received_global_steps = 0

    class Refuses(ckpt.InMemoryRolloutAdapter):
        async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
            async for _ in weights:
                raise RuntimeError("out of memory while loading")

    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(ckpt.CheckpointEngineWorker(engine, Refuses()).update_weights(1))
    assert engine.received_global_steps == 0
