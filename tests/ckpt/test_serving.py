"""ModelRolloutAdapter: updates land in the served module's own parameters, all-or-nothing, in banks that
keep their addresses; the collective engine receives straight into them."""

import asyncio
import functools

import pytest
import torch

import ckpt
from ckpt.testing import same_bytes
from hal.apps.weightsync import models

pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def _trainer_weights(step: int) -> dict[str, torch.Tensor]:
    """The tiny preset's bf16 weights after ``step`` deterministic changes (what a trainer publishes)."""
    module = models.causal_lm("qwen2.5-tiny", torch.float32, seed=0)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.add_(0.01 * step * (i + 1))
    return {n: t.detach().to(torch.bfloat16) for n, t in ckpt.serving.named_weights(module)}


async def _stream(weights, fail_after: int | None = None):
    for i, (name, tensor) in enumerate(weights.items()):
        if fail_after is not None and i == fail_after:
            raise ckpt.TransferError("the sender died mid-update")
        yield name, tensor


def _decode(module):
    return models.greedy_decode(module, models.prompt_ids("qwen2.5-tiny"), 4)


def _reference(weights):
    module = models.causal_lm("qwen2.5-tiny", torch.bfloat16, seed=None)
    with torch.no_grad():
        for name, t in ckpt.serving.named_weights(module):
            t.copy_(weights[name])
    return _decode(module)


def test_updates_load_into_the_served_parameters_and_decode_as_the_trainer():
    module = models.serving_model("qwen2.5-tiny")
    params_before = {n: p for n, p in module.named_parameters()}
    adapter = ckpt.ModelRolloutAdapter(module)
    for step in (1, 2):
        weights = _trainer_weights(step)
        asyncio.run(adapter.update_weights(_stream(weights), step))
        assert adapter.served_step == step
        assert {n: p for n, p in module.named_parameters()} == params_before  # same Parameter objects
        assert module.lm_head.weight is module.model.embed_tokens.weight
        for name, tensor in ckpt.serving.named_weights(module):
            assert same_bytes(tensor, weights[name]), name
        tokens, logits = _decode(module)
        ref_tokens, ref_logits = _reference(weights)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("fail_after", [0, 5, 25])
def test_a_rollout_failing_mid_apply_serves_and_decodes_the_previous_step(fail_after):
    module = models.serving_model("qwen2.5-tiny")
    adapter = ckpt.ModelRolloutAdapter(module)
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(1)), 1))
    tokens_1, logits_1 = _decode(module)
    with pytest.raises(ckpt.TransferError, match="died mid-update"):
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(2), fail_after=fail_after), 2))
    assert adapter.served_step == 1
    for name, tensor in ckpt.serving.named_weights(module):
        assert same_bytes(tensor, _trainer_weights(1)[name]), name
    tokens, logits = _decode(module)
    assert tokens == tokens_1 and torch.equal(logits, logits_1)
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(3)), 3))  # the next whole update is served
    assert adapter.served_step == 3 and _decode(module)[0] == _reference(_trainer_weights(3))[0]


def test_an_update_lacking_a_tensor_or_carrying_a_stranger_applies_nothing():
    adapter = ckpt.ModelRolloutAdapter(models.serving_model("qwen2.5-tiny"))
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(1)), 1))
    short = dict(list(_trainer_weights(2).items())[:-1])
    with pytest.raises(ckpt.WeightMismatchError, match="lacks tensor 'model.norm.weight'"):
        asyncio.run(adapter.update_weights(_stream(short), 2))
    stranger = {**_trainer_weights(2), "consolidated.weight": torch.zeros(3)}
    with pytest.raises(ckpt.WeightMismatchError, match="'consolidated.weight' is not among"):
        asyncio.run(adapter.update_weights(_stream(stranger), 2))
    assert adapter.served_step == 1
    assert same_bytes(adapter.state_dict()["model.norm.weight"], _trainer_weights(1)["model.norm.weight"])


def test_in_place_mode_holds_one_bank_and_serves_no_step_after_a_partial_update():
    adapter = ckpt.ModelRolloutAdapter(models.serving_model("qwen2.5-tiny"), atomic=False)
    assert len(adapter.banks) == 1
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(1)), 1))
    with pytest.raises(ckpt.TransferError):
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(2), fail_after=5), 2))
    assert adapter.served_step is None and "mixed" in adapter.degraded
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(2)), 2))
    assert adapter.served_step == 2 and adapter.degraded is None


def test_staging_banks_keep_their_addresses_across_updates():
    module = models.serving_model("qwen2.5-tiny")
    adapter = ckpt.ModelRolloutAdapter(module)
    addresses = {b.data_ptr() for b in adapter.banks}
    staged = []
    for step in range(1, 6):
        staged.append(adapter.staging.data_ptr())
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(step)), step))
        assert {b.data_ptr() for b in adapter.banks} == addresses
        served = adapter.banks[0]
        for _, p in ckpt.serving.named_weights(module):  # every served tensor is a view of the served bank
            assert served.data_ptr() <= p.data_ptr() < served.data_ptr() + served.numel()
    assert staged[0] == staged[2] == staged[4] and staged[1] == staged[3] and staged[0] != staged[1]


def test_the_collective_engine_receives_straight_into_the_staging_bank():
    from tests.ckpt.test_collective import _pair

    sender, receiver = _pair(64 << 10)
    module = models.serving_model("qwen2.5-tiny")
    adapter = ckpt.ModelRolloutAdapter(module)
    trainer_layout = ckpt.WeightLayout(module)
    worker = ckpt.CheckpointEngineWorker(receiver, adapter)

    async def go(step, bank):
        await asyncio.gather(sender.send_weights(trainer_layout.views(bank), step), worker.update_weights(step))

    async def run():
        for step in (1, 2):
            weights = _trainer_weights(step)
            bank = trainer_layout.allocate("cpu")
            trainer_layout.fill(bank, weights.items())
            await go(step, bank)
            assert adapter.served_step == step
            # everything but the tensors too large for a bucket's direct runs landed in place: no copy
            assert adapter.last_copied_bytes == 0
            for name, tensor in ckpt.serving.named_weights(module):
                assert same_bytes(tensor, weights[name]), name

    try:
        asyncio.run(run())
    finally:
        sender.close()
        receiver.close()


def test_in_place_a_sender_dying_after_its_first_message_leaves_the_rollout_degraded_not_stale():
    """The collective engine writes message 0 into the served bank, then waits for message 1's metadata
    before yielding message 0's tensors: a sender that dies there fails the update with nothing received,
    yet the weights are mixed. A step mismatch found on the first metadata writes nothing: not degraded."""
    import datetime
    import threading
    import time

    from tests.ckpt.test_collective import _pair

    sender, receiver = _pair(4 << 10)
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 4 x 1088 bytes
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    worker = ckpt.CheckpointEngineWorker(receiver, adapter)
    layout = ckpt.WeightLayout(module)
    first = module[0].weight

    class Died(BaseException):
        """The trainer process dying: no abort message is sent."""

    def weights(value, die_at=None):
        bank = layout.allocate("cpu")
        layout.fill(bank, [(n, torch.full_like(t, value)) for n, t in ckpt.serving.named_weights(module)])
        for i, item in enumerate(layout.views(bank)):
            if i == die_at:  # before the last tensor: die once message 0 landed in the rollout's weights
                deadline = time.monotonic() + 20
                while not bool((first == value).all()) and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise Died
            yield item

    def send(value, step, die_at=None):
        try:
            asyncio.run(sender.send_weights(weights(value, die_at), step))
        except Died:
            pass

    async def update(value, sent_step, asked_step, die_at=None):
        thread = threading.Thread(target=send, args=(value, sent_step, die_at))
        thread.start()
        try:
            return await worker.update_weights(asked_step)
        finally:
            await asyncio.to_thread(thread.join)

    def serves(value):
        return all(same_bytes(t, torch.full_like(t, value)) for _, t in ckpt.serving.named_weights(module))

    async def run():
        assert await update(1.0, 1, 1) == 1 and adapter.served_step == 1 and serves(1.0)
        with pytest.raises(ckpt.VersionMismatchError):
            await update(2.0, 2, 3)
        assert adapter.served_step == 1 and adapter.degraded is None and serves(1.0)
        receiver._group.timeout = datetime.timedelta(seconds=1)  # the dead sender is noticed within 1 s
        with pytest.raises(ckpt.TransferTimeoutError):
            await update(3.0, 3, 3, die_at=7)
        assert bool((first == 3.0).all()) and not serves(3.0)  # message 0 landed, the rest did not
        assert adapter.served_step is None and "written into them" in adapter.degraded
        assert adapter.placement("0.weight", torch.float32, (16, 16)) is None  # no update running: no writes

    try:
        asyncio.run(run())
    finally:
        sender.close()
        receiver.close()


def test_a_bad_global_steps_or_atomic_is_refused_naming_the_value():
    module = torch.nn.Linear(4, 2)
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    update = {n: torch.full_like(t, 2.0) for n, t in ckpt.serving.named_weights(module)}
    asyncio.run(adapter.update_weights(_stream({n: torch.ones_like(t) for n, t in update.items()}), 1))
    for bad in ("7", -3, True, 1.0):
        with pytest.raises(ckpt.CheckpointConfigError, match=f"global_steps must be None or an int >= 0, got {bad!r}"):
            asyncio.run(adapter.update_weights(_stream(update), bad))
        assert adapter.served_step == 1 and adapter.degraded is None
        assert same_bytes(module.weight, torch.ones_like(module.weight))  # nothing was read from the stream
    for bad in ("no", 0, None):
        with pytest.raises(ckpt.CheckpointConfigError, match=f"atomic must be True .* or False .*, got {bad!r}"):
            ckpt.ModelRolloutAdapter(torch.nn.Linear(4, 2), atomic=bad)
