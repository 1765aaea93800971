"""ModelRolloutAdapter: updates land in the served module's own parameters, all-or-nothing, in banks that
keep their addresses; the collective engine receives straight into them."""

import asyncio
import functools

import pytest
import torch

import ckpt
from ckpt.testing import same_bytes
from ckpt.testing import standalone_pair
from tests.ckpt import tiny_lm

pytest.importorskip("transformers")


def collective_pair(bucket_size):
    """Two ranks of one in-process collective group on cpu: ``(sender, receiver)``."""
    return standalone_pair("collective", bucket_size=bucket_size, device="cpu", timeout=20)


@functools.cache
def _trainer_weights(step: int) -> dict[str, torch.Tensor]:
    """The tiny preset's bf16 weights after ``step`` deterministic changes (what a trainer publishes)."""
    module = tiny_lm.causal_lm(torch.float32, seed=0)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.add_(0.01 * step * (i + 1))
    return {n: t.detach().to(torch.bfloat16) for n, t in ckpt.layout.named_weights(module)}


async def _stream(weights, fail_after: int | None = None):
    for i, (name, tensor) in enumerate(weights.items()):
        if fail_after is not None and i == fail_after:
            raise ckpt.TransferError("the sender died mid-update")
        yield name, tensor


def _decode(module):
    return tiny_lm.greedy_decode(module)


def _reference(weights):
    module = tiny_lm.causal_lm(torch.bfloat16, seed=None)
    with torch.no_grad():
        for name, t in ckpt.layout.named_weights(module):
            t.copy_(weights[name])
    return _decode(module)


def test_updates_load_into_the_served_parameters_and_decode_as_the_trainer():
    module = tiny_lm.causal_lm(torch.bfloat16, seed=None)
    params_before = {n: p for n, p in module.named_parameters()}
    adapter = ckpt.ModelRolloutAdapter(module)
    for step in (1, 2):
        weights = _trainer_weights(step)
        asyncio.run(adapter.update_weights(_stream(weights), step))
        assert adapter.served_step == step
        assert {n: p for n, p in module.named_parameters()} == params_before  # same Parameter objects
        assert module.lm_head.weight is module.model.embed_tokens.weight
        for name, tensor in ckpt.layout.named_weights(module):
            assert same_bytes(tensor, weights[name]), name
        tokens, logits = _decode(module)
        ref_tokens, ref_logits = _reference(weights)
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("fail_after", [0, 5, 25])
def test_a_rollout_failing_mid_apply_serves_and_decodes_the_previous_step(fail_after):
    module = tiny_lm.causal_lm(torch.bfloat16, seed=None)
    adapter = ckpt.ModelRolloutAdapter(module)
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(1)), 1))
    tokens_1, logits_1 = _decode(module)
    with pytest.raises(ckpt.TransferError, match="died mid-update"):
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(2), fail_after=fail_after), 2))
    assert adapter.served_step == 1
    for name, tensor in ckpt.layout.named_weights(module):
        assert same_bytes(tensor, _trainer_weights(1)[name]), name
    tokens, logits = _decode(module)
    assert tokens == tokens_1 and torch.equal(logits, logits_1)
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(3)), 3))  # the next whole update is served
    assert adapter.served_step == 3 and _decode(module)[0] == _reference(_trainer_weights(3))[0]


def test_an_update_lacking_a_tensor_or_carrying_a_stranger_applies_nothing():
    adapter = ckpt.ModelRolloutAdapter(tiny_lm.causal_lm(torch.bfloat16, seed=None))
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
    adapter = ckpt.ModelRolloutAdapter(tiny_lm.causal_lm(torch.bfloat16, seed=None), atomic=False)
    assert len(adapter.banks) == 1
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(1)), 1))
    with pytest.raises(ckpt.TransferError):
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(2), fail_after=5), 2))
    assert adapter.served_step is None and "mixed" in adapter.degraded
    asyncio.run(adapter.update_weights(_stream(_trainer_weights(2)), 2))
    assert adapter.served_step == 2 and adapter.degraded is None


def test_staging_banks_keep_their_addresses_across_updates():
    module = tiny_lm.causal_lm(torch.bfloat16, seed=None)
    adapter = ckpt.ModelRolloutAdapter(module)
    addresses = {b.data_ptr() for b in adapter.banks}
    staged = []
    for step in range(1, 6):
        staged.append(adapter.staging.data_ptr())
        asyncio.run(adapter.update_weights(_stream(_trainer_weights(step)), step))
        assert {b.data_ptr() for b in adapter.banks} == addresses
        served = adapter.banks[0]
        for _, p in ckpt.layout.named_weights(module):  # every served tensor is a view of the served bank
            assert served.data_ptr() <= p.data_ptr() < served.data_ptr() + served.numel()
    assert staged[0] == staged[2] == staged[4] and staged[1] == staged[3] and staged[0] != staged[1]


def test_the_collective_engine_receives_straight_into_the_staging_bank():
    sender, receiver = collective_pair(64 << 10)
    module = tiny_lm.causal_lm(torch.bfloat16, seed=None)
    adapter = ckpt.ModelRolloutAdapter(module)
    trainer_layout = ckpt.WeightLayout.from_entries(adapter.layout.entries.values())  # the rollout's own layout
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
            for name, tensor in ckpt.layout.named_weights(module):
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

    sender, receiver = collective_pair(4 << 10)
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 4 x 1088 bytes
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    worker = ckpt.CheckpointEngineWorker(receiver, adapter)
    layout = ckpt.WeightLayout(module)
    first = module[0].weight

    class Died(BaseException):
        """The trainer process dying: no abort message is sent."""

    def weights(value, die_at=None):
        bank = layout.allocate("cpu")
        layout.fill(bank, [(n, torch.full_like(t, value)) for n, t in ckpt.layout.named_weights(module)])
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
        return all(same_bytes(t, torch.full_like(t, value)) for _, t in ckpt.layout.named_weights(module))

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
        # no update running: no writes
        assert adapter.receive_placement.target("0.weight", torch.float32, (16, 16)) is None

    try:
        asyncio.run(run())
    finally:
        sender.close()
        receiver.close()


def test_a_bad_global_steps_or_atomic_is_refused_naming_the_value():
    module = torch.nn.Linear(4, 2)
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    update = {n: torch.full_like(t, 2.0) for n, t in ckpt.layout.named_weights(module)}
    asyncio.run(adapter.update_weights(_stream({n: torch.ones_like(t) for n, t in update.items()}), 1))
    for bad in ("7", -3, True, 1.0):
        with pytest.raises(ckpt.CheckpointConfigError, match=f"global_steps must be None or an int >= 0, got {bad!r}"):
            asyncio.run(adapter.update_weights(_stream(update), bad))
        assert adapter.served_step == 1 and adapter.degraded is None
        assert same_bytes(module.weight, torch.ones_like(module.weight))  # nothing was read from the stream
    for bad in ("no", 0, None):
        with pytest.raises(ckpt.CheckpointConfigError, match=f"atomic must be True .* or False .*, got {bad!r}"):
            ckpt.ModelRolloutAdapter(torch.nn.Linear(4, 2), atomic=bad)


# --- the rollout's own layout and memory facts ---------------------------------------------------------

def test_the_rollout_lays_out_its_banks_and_a_sender_publishes_in_that_layout():
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5)).to(torch.bfloat16)
    adapter = ckpt.ModelRolloutAdapter(module)
    entries = list(adapter.layout.entries.values())
    assert [(e.name, e.dtype, e.shape, e.offset, e.nbytes) for e in entries] == [
        ("0.weight", torch.bfloat16, (5, 3), 0, 30), ("0.bias", torch.bfloat16, (5,), 64, 10),
        ("1.weight", torch.bfloat16, (5,), 128, 10), ("1.bias", torch.bfloat16, (5,), 192, 10)]
    import pickle

    sender_layout = ckpt.WeightLayout.from_entries(pickle.loads(pickle.dumps(entries)))  # a typed message
    assert sender_layout.nbytes == adapter.layout.nbytes == 256
    assert adapter.memory() == ckpt.serving.AdapterMemory(model_bytes=60, banks=2, bank_bytes=256,
                                                          staging_bytes=256, last_copied_bytes=0)
    in_place = ckpt.ModelRolloutAdapter(torch.nn.Linear(3, 5), atomic=False).memory()
    assert (in_place.banks, in_place.bank_bytes, in_place.staging_bytes, in_place.model_bytes) == (1, 128, 0, 80)
    trainer = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5))  # fp32 master weights
    bank = sender_layout.allocate("cpu")
    sender_layout.fill(bank, ckpt.layout.named_weights(trainer))  # cast to the rollout's bf16 on the way
    asyncio.run(adapter.update_weights(_stream(dict(sender_layout.views(bank))), 1))
    assert torch.equal(module[0].weight, trainer[0].weight.detach().to(torch.bfloat16))
    assert adapter.memory().last_copied_bytes == 60
    entry = ckpt.layout.LayoutEntry
    bad = [entry("a", torch.float32, (3,), 0, 12), entry("b", torch.float32, (2,), 8, 8)]
    with pytest.raises(ckpt.CheckpointConfigError, match="'b' .* multiple of 64 bytes at or after byte 12"):
        ckpt.WeightLayout.from_entries(bad)
    with pytest.raises(ckpt.WeightMismatchError, match=r"'0.weight' has shape \(1, 3\), the layout holds \(5, 3\)"):
        sender_layout.fill(bank, [("0.weight", torch.zeros(1, 3))])  # copy_ would broadcast it silently


# --- weights moved between updates (sleep / wake_up) ------------------------------------------------------

def _small_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)).to(device)


def _filled(module, value):
    return [(n, torch.full_like(t, value, device="cpu")) for n, t in ckpt.layout.named_weights(module)]


def _computes_with(module, value):
    """The module's own tensors (what its forward reads) all hold ``value``."""
    return all(bool((t == value).all()) for _, t in ckpt.layout.named_weights(module))


def _sleep_and_wake(module, device):
    """What an inference server's sleep / wake_up does to the weights: same values, new memory. On an
    accelerator lane, ``module.to("cpu"); module.to(device)``; on cpu (where that is a no-op) a dtype round
    trip, which re-allocates every tensor as well."""
    if device.type == "cpu":
        module.double()
        module.float()
    else:
        module.to("cpu")
        module.to(device)


@pytest.mark.parametrize("atomic", [False, True])
def test_weights_moved_between_updates_are_repointed_and_the_file_engine_update_reaches_them(
        tmp_path, hal_device, atomic):
    import hal

    device = hal.get_device(hal_device)
    module = _small_model(device)
    adapter = ckpt.ModelRolloutAdapter(module, atomic=atomic)
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    worker = ckpt.CheckpointEngineWorker(ckpt.get_checkpoint_engine("file", root=tmp_path, device=hal_device,
                                                                    timeout=10), adapter)

    async def update(value, step):
        await writer.send_weights(iter(_filled(module, value)), step)
        return await worker.update_weights(step)

    assert asyncio.run(update(1.0, 1)) == 1 and _computes_with(module, 1.0)
    _sleep_and_wake(module, device)
    assert module[0].weight.data_ptr() != adapter.state_dict()["0.weight"].data_ptr()  # the move happened
    assert asyncio.run(update(2.0, 2)) == 2
    assert adapter.served_step == 2 and _computes_with(module, 2.0)  # never a step the module does not serve
    assert sorted(adapter.repointed) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    served = adapter.banks[0]
    for _, t in ckpt.layout.named_weights(module):
        assert served.data_ptr() <= t.data_ptr() < served.data_ptr() + served.numel()


def test_weights_moved_between_updates_are_repointed_and_the_collective_update_lands_in_them():
    sender, receiver = collective_pair(4 << 10)
    module = _small_model("cpu")
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    worker = ckpt.CheckpointEngineWorker(receiver, adapter)
    layout = ckpt.WeightLayout.from_entries(adapter.layout.entries.values())

    async def update(value, step):
        bank = layout.allocate("cpu")
        layout.fill(bank, _filled(module, value))
        await asyncio.gather(sender.send_weights(layout.views(bank), step), worker.update_weights(step))

    async def run():
        await update(1.0, 1)
        assert _computes_with(module, 1.0)
        _sleep_and_wake(module, torch.device("cpu"))
        await update(2.0, 2)
        assert adapter.served_step == 2 and _computes_with(module, 2.0)
        assert adapter.last_copied_bytes == 0  # received straight into the bank the module now views

    try:
        asyncio.run(run())
    finally:
        sender.close()
        receiver.close()


def test_weights_moved_where_the_bank_cannot_follow_are_refused_naming_the_tensor(tmp_path):
    module = _small_model("cpu")
    adapter = ckpt.ModelRolloutAdapter(module, atomic=False)
    asyncio.run(adapter.update_weights(_stream(dict(_filled(module, 1.0))), 1))
    module.double()  # re-allocated as float64: the bank holds float32
    with pytest.raises(ckpt.WeightMismatchError, match="tensor '0.weight' of the served module was moved out of "
                                                      "the adapter's bank.*torch.float64.*torch.float32"):
        asyncio.run(adapter.update_weights(_stream(dict(_filled(_small_model("cpu"), 2.0))), 2))
    assert adapter.served_step == 1 and adapter.degraded is None  # refused before anything was read
    module.float()
    asyncio.run(adapter.update_weights(_stream(dict(_filled(module, 2.0))), 2))
    assert adapter.served_step == 2 and _computes_with(module, 2.0)


# --- two updates at once ----------------------------------------------------------------------------------

async def _slow(weights, delay):
    for name, tensor in weights:
        await asyncio.sleep(delay)
        yield name, tensor


@pytest.mark.parametrize("atomic", [True, False])
def test_a_fast_update_started_during_a_slow_one_waits_for_it_and_is_served(atomic):
    module = _small_model("cpu")
    adapter = ckpt.ModelRolloutAdapter(module, atomic=atomic)

    async def run():
        slow = asyncio.ensure_future(adapter.update_weights(_slow(_filled(module, 6.0), 0.02), 6))
        await asyncio.sleep(0.03)  # the slow update is part way
        await adapter.update_weights(_slow(_filled(module, 7.0), 0), 7)
        await slow

    asyncio.run(run())
    assert adapter.served_step == 7 and _computes_with(module, 7.0)


@pytest.mark.parametrize("atomic", [True, False])
def test_an_update_below_the_served_step_is_refused_naming_both(atomic):
    module = _small_model("cpu")
    adapter = ckpt.ModelRolloutAdapter(module, atomic=atomic)

    async def run():
        fast = asyncio.ensure_future(adapter.update_weights(_slow(_filled(module, 7.0), 0.01), 7))
        await asyncio.sleep(0)  # 7 started first; 6 arrives while it runs
        return await asyncio.gather(fast, adapter.update_weights(_slow(_filled(module, 6.0), 0), 6),
                                    return_exceptions=True)

    done, refused = asyncio.run(run())
    assert done is None and isinstance(refused, ckpt.CheckpointConfigError)
    assert "global_steps=6 is below the step in service, global_steps=7" in str(refused)
    assert adapter.served_step == 7 and _computes_with(module, 7.0) and adapter.degraded is None
