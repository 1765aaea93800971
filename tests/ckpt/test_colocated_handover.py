"""The colocated hand-over is acknowledged only when the rollout is done with the trainer's tensors.

The scenario of the report: the trainer awaits ``TrainerWorker.update_weights(1)``, takes another optimizer
step, then the rollout receives step 1. Before the fix the rollout served step 1 with the step-2 values.
"""

import asyncio

import pytest
import torch

import ckpt
from engines import TorchEngine


def _trainer(device):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=0.5), device=device)
    x = torch.randn(16, 8)

    def step():
        engine.train_step(lambda m: (m(x.to(engine.torch_device)) - 3.0).square().mean())
        return {n: t.detach().cpu().clone() for n, t in engine.get_per_tensor_param()[0]}

    return engine, step


def test_a_send_awaited_alone_never_lets_the_rollout_serve_later_values(hal_device):
    engine, step = _trainer(hal_device)
    channel = ckpt.get_checkpoint_engine("colocated", timeout=0.3)
    adapter = ckpt.InMemoryRolloutAdapter()
    trainer, rollout = ckpt.TrainerWorker(engine, channel), ckpt.CheckpointEngineWorker(channel, adapter)
    step()

    async def scenario():
        with pytest.raises(ckpt.TransferTimeoutError, match="no receiver took the offer"):
            await trainer.update_weights(1)  # awaited alone: it may not return as if delivered
        step()  # the trainer's next optimizer step changes its parameters in place
        with pytest.raises(ckpt.TransferTimeoutError, match="no weights were offered"):
            await rollout.update_weights(1)

    asyncio.run(scenario())
    assert adapter.served_step is None and adapter.state_dict() == {}  # nothing stale is served


def test_a_concurrent_hand_over_serves_the_sent_values_after_the_next_step(hal_device):
    engine, step = _trainer(hal_device)
    channel = ckpt.get_checkpoint_engine("colocated", timeout=10)
    adapter = ckpt.InMemoryRolloutAdapter()
    trainer, rollout = ckpt.TrainerWorker(engine, channel), ckpt.CheckpointEngineWorker(channel, adapter)

    async def update(global_steps):
        await asyncio.gather(trainer.update_weights(global_steps), rollout.update_weights(global_steps))

    values = {1: step()}
    asyncio.run(update(1))
    values[2] = step()  # after the acknowledged hand-over, as the report's trainer does
    assert not torch.equal(values[1]["weight"], values[2]["weight"])
    assert adapter.served_step == 1
    served = {n: t.cpu() for n, t in adapter.state_dict().items()}
    assert all(torch.equal(served[n], values[1][n]) for n in values[1])  # step 1 serves step-1 bytes
    asyncio.run(update(2))
    assert adapter.served_step == 2
    assert all(torch.equal(adapter.state_dict()[n].cpu(), values[2][n]) for n in values[2])


def test_the_colocated_engine_holds_nothing_to_send_and_accepts_a_placement():
    engine = ckpt.get_checkpoint_engine("colocated", timeout=5)
    assert type(engine).send_buffer_bytes(1 << 20, 12345) == {} and type(engine).send_buffer_words == ""
    weights = [("w", torch.arange(6.0))]

    class Placement:
        def target(self, name, dtype, shape):
            raise AssertionError("the colocated engine copies nothing: it never asks for a target")

    from ckpt.testing import collect, compare

    async def go():
        got, _ = await asyncio.gather(
            collect(engine.receive_weights(3, placement=Placement())), engine.send_weights(iter(weights), 3))
        return got

    compare(weights, asyncio.run(go()), "colocated with a placement")
