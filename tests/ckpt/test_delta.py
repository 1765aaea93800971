"""Delta weight sync (ckpt.delta, issue 21): verl's delta_flush format over hal's engines, bit-exact.

In process: the sender's diff (NaN / signed zero, dense fallback, bytes bound, seeds), the receiver's
refusals (atomic keeps the previous step, in place is degraded), and 20 AdamW steps over the file engine.
Across processes: the same 20 steps over the collective engine on every device lane (gloo; hccl on npu-sim).
"""

import asyncio

import pytest
import torch

import ckpt
from ckpt.delta import (DeltaBaseError, DeltaChecksumError, DeltaReceiver, DeltaSender, apply_delta_flush,
                        delta_send, receive_delta, tensor_checksum)
from ckpt.delta.wire import decode_spec
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import delta_workers as w


def bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def one_update(sender, weights, step):
    flushes = list(sender.flushes(weights.items(), step))
    return flushes, sender.commit()


def test_nan_and_signed_zero_round_trip_and_a_nan_goes_dense():
    base = {"w": torch.zeros(4096, dtype=torch.bfloat16), "b": torch.ones(16, dtype=torch.bfloat16)}
    sender, served = DeltaSender(device="cpu"), {n: torch.full_like(t, 5.0) for n, t in base.items()}
    receiver = DeltaReceiver(served)
    for named, last in one_update(sender, base, 1)[0]:
        receiver.apply_flush(named, last)
    new = {n: t.clone() for n, t in base.items()}
    new["w"][7] = -0.0          # only the sign bit changes
    new["b"][3] = float("nan")  # NaN cannot travel sparse in verl's format (NaN means "unchanged" there)
    flushes, stats = one_update(sender, new, 2)
    specs = [decode_spec(dict(named)["__delta_spec__"]) for named, _ in flushes]
    encodings = {p["name"]: s["encoding"] for s in specs for p in s["params"]}
    assert encodings == {"w": "indices", "b": "dense"}
    assert stats.changed == 2 and not stats.seed
    for named, last in flushes:
        receiver.apply_flush(named, last)
    assert bits_equal(served, new) and torch.signbit(served["w"][7]) and torch.isnan(served["b"][3])
    assert receiver.served_step == 2


@pytest.mark.parametrize("fraction", [0.001, 0.1, 0.3, 0.5, 1.0])
def test_bytes_sent_never_exceed_the_dense_bytes_by_more_than_5_percent(fraction):
    torch.manual_seed(0)
    weights = {f"t{i}": torch.randn(256, 256).to(torch.bfloat16) for i in range(4)}
    sender = DeltaSender(device="cpu")
    one_update(sender, weights, 1)
    for t in weights.values():
        flat = t.view(-1).view(torch.int16)
        idx = torch.randperm(flat.numel())[: int(fraction * flat.numel())]
        flat[idx] ^= 1
    _, stats = one_update(sender, weights, 2)
    assert stats.changed_fraction == pytest.approx(fraction, abs=1e-4)
    assert stats.sent_bytes <= 1.05 * stats.dense_bytes
    if fraction <= 0.1:  # 6 bytes per changed bf16 value: 3x the fraction of the dense bytes
        assert stats.sent_bytes < (3 * fraction + 0.01) * stats.dense_bytes
    assert (stats.dense_tensors == 4) == (fraction * 6 >= 2)


def test_seeds_first_after_reseed_and_after_an_undelivered_update():
    weights = {"w": torch.randn(1000).to(torch.bfloat16)}
    sender = DeltaSender(device="cpu")
    assert one_update(sender, weights, 1)[1].seed
    assert not one_update(sender, weights, 2)[1].seed
    sender.reseed("topology changed")
    stats = one_update(sender, weights, 3)[1]
    assert stats.seed and stats.reason == "topology changed"
    list(sender.flushes(weights.items(), 4))
    sender.abandon("broadcast failed")
    assert one_update(sender, weights, 5)[1].seed
    assert sender.snapshot_bytes == 2000


def test_nothing_changed_is_one_empty_last_flush_carrying_the_step():
    weights = {"w": torch.randn(100).to(torch.bfloat16)}
    sender, served = DeltaSender(device="cpu"), {"w": torch.zeros(100, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(served)
    for step in (1, 2):
        flushes, stats = one_update(sender, weights, step)
        for named, last in flushes:
            receiver.apply_flush(named, last)
    assert len(flushes) == 1 and flushes[0][1] and stats.changed == 0
    assert receiver.served_step == 2 and bits_equal(served, weights)


@pytest.mark.parametrize("key", ["__values__", "__positions__", "__delta_spec__"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
def test_a_flipped_byte_is_refused_and_a_delta_onto_the_wrong_step_too(key, atomic):
    torch.manual_seed(1)
    weights = {"a": torch.randn(512).to(torch.bfloat16), "b": torch.randn(512).to(torch.bfloat16)}
    sender, served = DeltaSender(device="cpu"), {n: torch.zeros_like(t) for n, t in weights.items()}
    receiver = DeltaReceiver(served, atomic=atomic)
    for named, last in one_update(sender, weights, 1)[0]:
        receiver.apply_flush(named, last)
    before = {n: t.clone() for n, t in served.items()}
    weights["a"][:20] += 1
    weights["b"][:20] += 1
    (named, last), = one_update(sender, weights, 2)[0]
    corrupted = dict(w.flip_one_byte([(f"__delta_flush__/0/{k}", t) for k, t in named], key))
    with pytest.raises(DeltaChecksumError):
        receiver.apply_flush([(n.rsplit("/", 1)[1], t) for n, t in corrupted.items()], last)
    assert receiver.needs_seed and receiver.served_step == 1
    assert bits_equal(served, before)  # the flush checksum refuses before anything is written
    # the uncorrupted flush is now refused too: it is a delta onto step 1, and only a seed is taken
    with pytest.raises(DeltaBaseError, match="full seed"):
        receiver.apply_flush(named, last)
    sender.reseed("rollout refused step 2")
    for named, last in one_update(sender, weights, 3)[0]:
        receiver.apply_flush(named, last)
    assert receiver.served_step == 3 and bits_equal(served, weights)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
@pytest.mark.parametrize("drift_at,full_verify", [(0, False), (40, True)], ids=["changed-position", "full-verify"])
def test_a_tensor_whose_result_disagrees_is_refused_by_name(atomic, drift_at, full_verify):
    """The rollout's copy of "b" drifted from what the sender diffed against: the flush is intact, the
    result is not. Atomic: nothing written, previous step served; in place: "a" written, degraded.

    The running checksum reads the old values where a flush writes, so a drift there is caught; a drift
    elsewhere only by ``full_verify`` (which reads every tensor it writes)."""
    weights = {"a": torch.arange(64, dtype=torch.bfloat16), "b": torch.arange(64, dtype=torch.bfloat16)}
    sender, served = DeltaSender(device="cpu"), {n: torch.zeros_like(t) for n, t in weights.items()}
    receiver = DeltaReceiver(served, atomic=atomic, full_verify=full_verify)
    for named, last in one_update(sender, weights, 1)[0]:
        receiver.apply_flush(named, last)
    served["b"][drift_at] = 1000  # drift
    weights["a"][0] = 7
    weights["b"][0] = 7
    drifted = {n: t.clone() for n, t in served.items()}
    (named, last), = one_update(sender, weights, 2)[0]
    with pytest.raises(DeltaChecksumError, match="tensor 'b'") as info:
        receiver.apply_flush(named, last)
    assert info.value.tensor == "b" and info.value.step == 2
    assert receiver.degraded == (not atomic)
    assert bits_equal(served, drifted) == atomic


def test_apply_delta_flush_applies_one_flush_onto_a_models_parameters():
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    weights = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    sender = DeltaSender(device="cpu")
    (named, _), = one_update(sender, weights, 5)[0]
    params = dict(model.named_parameters())
    ids = {n: id(p) for n, p in params.items()}
    assert apply_delta_flush(named, params) == 5
    assert bits_equal({n: p.detach() for n, p in model.named_parameters()}, weights)
    assert {n: id(p) for n, p in model.named_parameters()} == ids  # the model's own parameters, in place


def test_tensor_checksum_sees_bits_and_positions():
    x = torch.randn(1000).to(torch.bfloat16)
    y = x.clone()
    y[[3, 500]] = x[[500, 3]]
    z = torch.zeros(3, dtype=torch.bfloat16)
    assert tensor_checksum(x) == tensor_checksum(x.clone())
    assert tensor_checksum(x) != tensor_checksum(y)  # a plain XOR hash would miss the swap
    assert tensor_checksum(z) != tensor_checksum(-z)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
def test_twenty_adamw_steps_over_the_file_engine_bit_exact(tmp_path, atomic):
    """A seed then deltas on disk; one byte of step 8's shard flipped on disk: refused; reseeded at 9; the
    rollout restarted at 14: reseeded, then back on deltas."""
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=2)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=10)
    dev = torch.device("cpu")

    class CorruptOnDisk:
        """The file engine, flipping a byte in the middle of the data of step CORRUPT_STEP's shard."""

        async def send_weights(self, weights, global_steps=None):
            await writer.send_weights(weights, global_steps)
            if global_steps == w.CORRUPT_STEP:
                shard = next((tmp_path / f"step-{global_steps:08d}").glob("*.safetensors"))
                data = bytearray(shard.read_bytes())
                header = 8 + int.from_bytes(data[:8], "little")
                data[(header + len(data)) // 2] ^= 0xFF
                shard.write_bytes(bytes(data))

    async def main():
        model, opt = w.make_trainer(0, dev)
        sender = DeltaSender(flush_bytes=32 << 10, device="cpu")
        params = w.fresh_rollout(dev)
        receiver = DeltaReceiver(params, atomic=atomic)
        trainer, rollout = [], []
        engine = CorruptOnDisk()
        for step in range(1, w.STEPS + 1):
            if step > 1:
                w.train_step(model, opt, step)
            weights = w.published(model, step)
            if step == w.RESTART_STEP:
                params = w.fresh_rollout(dev, seed=7)
                receiver = DeltaReceiver(params, atomic=atomic)
                sender.reseed("rollout restarted")
            stats = await delta_send(engine, weights.items(), step, sender)
            trainer.append((step, stats.seed, stats.changed_fraction, stats.sent_bytes, stats.dense_bytes,
                            w.digest(weights)))
            refusal = None
            try:
                await receive_delta(reader, receiver, step)
            except DeltaChecksumError as exc:
                refusal = f"{type(exc).__name__}: {exc}"
                sender.reseed(f"rollout refused step {step}")
            rollout.append((step, receiver.served_step, refusal, receiver.degraded, w.digest(params)))
        return (trainer, sender.snapshot_bytes), rollout

    trainer, rollout = asyncio.run(main())
    fractions = w.check_run(trainer, rollout, atomic)
    assert 0.02 < sum(fractions) / len(fractions) < 0.2  # lr 1e-5: a few percent of the values change
    print(f"file engine, {'atomic' if atomic else 'in-place'}: changed fraction per delta step "
          f"{[round(f, 4) for f in fractions]}")


@pytest.mark.multiprocess
@pytest.mark.hal_device("npu-sim")
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
def test_twenty_adamw_steps_over_the_collective_engine_bit_exact(hal_device, atomic):
    """Trainer and rollout in two processes over hccl, receiving into device memory: a byte flipped in transit
    at step 8 is refused, step 9 reseeds; a rollout restarted at 14 is reseeded, then back on deltas.

    On the simulated npu only: the same run on cpu (gloo, host memory) added nothing that
    test_twenty_adamw_steps_over_the_file_engine_bit_exact (the same delta code, both apply modes, host
    memory) and the collective engine's own multi-process tests (gloo) do not already prove."""
    results = run_multiprocess(w.collective_run, 2, hal_device, atomic, timeout=120)
    fractions = w.check_run(results[0], results[1], atomic)
    assert 0.02 < sum(fractions) / len(fractions) < 0.2
    print(f"collective on {hal_device}: changed fraction per delta step {[round(f, 4) for f in fractions]}")


def test_a_rollout_restarted_without_a_reseed_refuses_the_delta():
    weights = {"w": torch.randn(256).to(torch.bfloat16)}
    sender = DeltaSender(device="cpu")
    one_update(sender, weights, 1)
    weights["w"][:3] += 1
    restarted = DeltaReceiver({"w": torch.zeros(256, dtype=torch.bfloat16)})
    with pytest.raises(DeltaBaseError, match="refused step 2"):
        for named, last in one_update(sender, weights, 2)[0]:
            restarted.apply_flush(named, last)
    assert restarted.served_step is None and restarted.needs_seed


def test_snapshot_is_host_memory_pinned_where_the_kind_supports_it(hal_device):
    import hal

    dev = hal.get_device(hal_device)
    sender = DeltaSender(device=hal_device)
    weights = {"w": torch.randn(300, device=dev).to(torch.bfloat16)}
    one_update(sender, weights, 1)
    snap = sender.snapshot["w"]
    assert snap.device.type == "cpu" and sender.snapshot_bytes == 600
    assert sender.pin == (dev.type != "cpu") and snap.is_pinned() == sender.pin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_odd_sizes_and_views_at_odd_offsets_round_trip_over_many_steps(dtype):
    """Tensors whose bytes are no multiple of 8, and views starting mid-word in one flat buffer (as FSDP1 /
    Megatron flat parameters): the word-wise diff's tail and element fallbacks, and the sender's running
    checksums, checked by the receiver's full recomputation every step."""
    gen = torch.Generator().manual_seed(3)
    flat = (torch.randn(10_007, generator=gen) * 50).to(dtype)
    sizes, offset, views = [1, 3, 1001, 4096, 4903], 1, {}
    for i, n in enumerate(sizes):
        views[f"v{i}"] = flat[offset:offset + n]
        offset += n
    own = {f"own{n}": (torch.randn(n, generator=gen) * 50).to(dtype) for n in (1001, 4903)}  # aligned, a tail
    views.update(own)
    sender = DeltaSender(device="cpu")
    served = {n: torch.zeros_like(t) for n, t in views.items()}
    receiver = DeltaReceiver(served, atomic=False)
    encodings = set()
    for step in range(1, 8):
        if step > 1:
            idx = torch.randint(0, flat.numel(), (int(flat.numel() * 0.03),), generator=gen)
            flat.view(torch.uint8).view(-1)[idx * flat.element_size()] ^= 1
            for t in own.values():  # the last word's head and tail both change
                t.view(torch.uint8).view(-1)[[0, -1, -1 - 3 * t.element_size()]] ^= 1
        flushes, stats = one_update(sender, views, step)
        for named, last in flushes:
            encodings.add(decode_spec(dict(named)["__delta_spec__"])["encoding"])
            receiver.apply_flush(named, last)
        assert receiver.served_step == step
        assert all(torch.equal(bits_view(served[n]), bits_view(t)) for n, t in views.items()), step
    assert encodings == {"dense", "indices"}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.multiprocess
def test_bench_delta_reports_delta_and_full_side_by_side():
    from hal.apps.benchmarks.bench_delta import run

    rows = run(size_mb=4, device="cpu", rounds=1, bucket_mb=1, fractions=[0.02, 0.5])
    assert [r["fraction"] for r in rows] == [0.02, 0.5]
    small, half = rows
    assert small["changed"] == pytest.approx(0.02, rel=0.05) and half["changed"] == pytest.approx(0.5, rel=0.05)
    assert 0.05 < small["wire_fraction"] < 0.07  # 6 bytes per changed bf16 value, plus the specs
    assert 0.99 < half["wire_fraction"] <= 1.05  # dense: never more than 1.05x the dense bytes
    # the snapshot: the published bytes plus the 64-byte alignment padding between the views
    assert all(r["full_s"] > 0 and r["delta_s"] > 0 and r["read_s"] > 0 for r in rows)
    # the sender's pass alone against one memcpy of the same bytes, and the ratios the table prints
    assert all(r["diff_s"] > 0 and r["memcpy_s"] > 0 and r["link_gbit"] is None for r in rows)
    assert all(r["delta_vs_full"] > 0 and r["diff_vs_memcpy"] > 0 and r["diff_vs_memcpy_cpu"] > 0 for r in rows)
    assert all(r["diff_vs_memcpy_best"] > 0 for r in rows)  # the fastest pass over the fastest memcpy
    assert all(r["dense_bytes"] <= r["snapshot_bytes"] < r["dense_bytes"] + 64 * r["n_tensors"] for r in rows)


def test_delta_engine_over_the_file_engine_speaks_verls_delta_flush(tmp_path):
    from ckpt.delta import DeltaCheckpointEngine, delta_engine_class

    file_cls = ckpt.get_checkpoint_engine("file", root=tmp_path).__class__
    delta_file = delta_engine_class(file_cls)
    ckpt.check_async_contract(delta_file)  # send_weights awaitable, receive_weights an async iterator
    writer, reader = delta_file(root=tmp_path), delta_file(root=tmp_path, timeout=10)
    assert writer.wire_format == reader.wire_format == "delta_flush"
    assert delta_file.build_topology(1, 2, [{}, {}, {}]) == ({}, {})
    weights = {"w": torch.randn(2048).to(torch.bfloat16)}
    served = {"w": torch.zeros(2048, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(served)

    async def step(n):
        await writer.send_weights(iter(weights.items()), n)
        async for named, is_last in reader.receive_weights(n):  # verl's adapters consume exactly this
            receiver.apply_flush(named, is_last)
        return writer.last_stats

    assert asyncio.run(step(1)).seed
    weights["w"][:10] += 1
    stats = asyncio.run(step(2))
    assert not stats.seed and stats.changed == 10 and reader.received_global_steps == 2
    assert bits_equal(served, weights) and writer.snapshot_bytes == 4096

    class MovingTopology(file_cls):
        topology = {"world_size": 3}

    inner = MovingTopology(root=tmp_path / "t")
    engine = DeltaCheckpointEngine(inner)
    asyncio.run(engine.send_weights(iter(weights.items()), 1))
    asyncio.run(engine.send_weights(iter(weights.items()), 2))
    assert not engine.last_stats.seed
    inner.topology = {"world_size": 4}  # a rollout joined: the next update is a seed
    asyncio.run(engine.send_weights(iter(weights.items()), 3))
    assert engine.last_stats.seed and "topology changed" in engine.last_stats.reason


def test_views_of_one_flat_buffer_are_diffed_as_one_region_and_its_padding_is_no_ones():
    """64-byte aligned views of odd lengths in one buffer (as hal sync publishes): one region, one snapshot;
    bytes of the alignment padding changing (in a view's last word, and whole padding words) change no
    tensor's values, positions or checksum."""
    from ckpt.delta.diff import segments

    sizes, offsets, end = [3, 1000, 37, 4096], [], 0
    for n in sizes:
        offsets.append(end)
        end = (end + 2 * n + 63) // 64 * 64
    flat = torch.zeros(end, dtype=torch.uint8)
    views = {f"v{i}": flat[o:o + 2 * n].view(torch.bfloat16) for i, (o, n) in enumerate(zip(offsets, sizes))}
    gen = torch.Generator().manual_seed(5)
    for t in views.values():
        t.copy_(torch.randn(t.numel(), generator=gen))
    assert [len(s.names) for s in segments(list(views.items()))] == [4]
    import ckpt.delta.diff as diff_module

    old_cap, diff_module.SEGMENT_BYTES = diff_module.SEGMENT_BYTES, 2048  # a segment closes past 2 KiB
    try:
        assert [len(s.names) for s in segments(list(views.items()))] == [2, 2]
    finally:
        diff_module.SEGMENT_BYTES = old_cap
    sender = DeltaSender(device="cpu")
    served = {n: torch.zeros_like(t) for n, t in views.items()}
    receiver = DeltaReceiver(served, atomic=False)
    padding = torch.ones(end, dtype=torch.bool)
    for o, n in zip(offsets, sizes):
        padding[o:o + 2 * n] = False
    for step in range(1, 5):
        if step > 1:
            flat[padding] ^= 0x5A  # the padding changes every step, including the bytes after v0, v2's ends
            for t in views.values():
                t.view(torch.int16)[torch.randint(0, t.numel(), (2,), generator=gen)] ^= 1
        flushes, stats = one_update(sender, views, step)
        for named, last in flushes:
            receiver.apply_flush(named, last)
        assert receiver.served_step == step and bits_equal(served, views)
        assert stats.changed <= 8 or step == 1
    assert sender.snapshot_bytes == end


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in-place"])
def test_a_flipped_byte_in_a_dense_flush_is_refused_by_the_tensors_checksum(atomic):
    """A dense flush's values are checked by each tensor's checksum (computed while written or staged), not by
    verl's flush hash: a flipped byte is still refused, naming the tensor; atomic writes nothing."""
    weights = {"a": torch.randn(512).to(torch.bfloat16), "b": torch.randn(512).to(torch.bfloat16)}
    sender, served = DeltaSender(device="cpu"), {n: torch.zeros_like(t) for n, t in weights.items()}
    receiver = DeltaReceiver(served, atomic=atomic)
    (named, last), = one_update(sender, weights, 1)[0]
    assert decode_spec(dict(named)["__delta_spec__"])["encoding"] == "dense"
    corrupted = [(k, t.clone()) for k, t in named]
    corrupted[-1][1].view(torch.uint8)[1500] ^= 0x10  # a byte of "b"'s values
    with pytest.raises(DeltaChecksumError, match="tensor 'b'"):
        receiver.apply_flush(corrupted, last)
    assert receiver.needs_seed and receiver.degraded == (not atomic)
    assert bits_equal(served, {n: torch.zeros_like(t) for n, t in weights.items()}) == atomic


def test_the_delta_engine_refuses_a_second_send_while_one_runs_and_the_first_goes_on():
    """Issue 50: concurrent sends on one engine broke each other. The guard every engine's send_weights gets from
    CheckpointEngine covers the delta engine too; the refused call leaves the running update and its seed whole."""
    from ckpt.delta import DeltaCheckpointEngine

    engine = DeltaCheckpointEngine(ckpt.ColocatedCheckpointEngine(timeout=10))
    weights = {"w": torch.randn(2048).to(torch.bfloat16)}
    served = {"w": torch.zeros(2048, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(served)

    async def go():
        first = asyncio.ensure_future(engine.send_weights(iter(weights.items()), 1))
        await asyncio.sleep(0)  # the first send runs: it waits for the rollout
        with pytest.raises(ckpt.SendInProgressError, match="still sending global_steps=1"):
            await engine.send_weights(iter(weights.items()), 2)
        async for named, is_last in engine.receive_weights(1):
            receiver.apply_flush(named, is_last)
        await first

    asyncio.run(go())
    assert engine.last_stats.seed and bits_equal(served, weights) and engine.received_global_steps == 1
