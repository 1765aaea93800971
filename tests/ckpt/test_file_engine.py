"""FileCheckpointEngine: one directory per step, atomic publication, pruning, step selection."""

import asyncio
import json
import os
import shutil
import threading

import pytest
import torch

import ckpt
from ckpt.testing import collect, compare, sample_weights


def _send(engine, weights, step):
    asyncio.run(engine.send_weights(iter(weights), step))


def _receive(engine, step):
    return asyncio.run(collect(engine.receive_weights(step)))


def test_steps_are_directories_and_only_keep_last_survive(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _send(writer, sample_weights(step), step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    assert writer.published_steps() == [3, 4]
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path)
    compare(sample_weights(3), _receive(reader, 3), "step 3")
    assert reader.received_global_steps == 3
    with pytest.raises(ckpt.VersionMismatchError, match="asked for global_steps=1.*global_steps=4"):
        _receive(reader, 1)  # pruned: a newer step exists, so it will never come back


def test_receive_none_takes_the_newest_step_newer_than_the_last_received(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=3)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=0.3)
    _send(writer, sample_weights(1), 1)
    _send(writer, sample_weights(2), 2)
    compare(sample_weights(2), _receive(reader, None), "latest")
    assert reader.received_global_steps == 2
    with pytest.raises(ckpt.TransferTimeoutError, match="no step newer than 2"):
        _receive(reader, None)
    _send(writer, sample_weights(5), None)  # None: newest + 1
    assert writer.published_steps() == [1, 2, 3]
    assert [n for n, _ in _receive(reader, None)] == [n for n, _ in sample_weights(5)]
    assert reader.received_global_steps == 3


def test_a_reader_never_sees_a_half_written_step(tmp_path):
    """The writer stalls in the middle of writing step 2: readers see step 1 only, no partial step 2."""
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=5)
    _send(writer, sample_weights(1), 1)
    halfway, release = threading.Event(), threading.Event()

    def slow():
        for i, item in enumerate(sample_weights(2)):
            if i == 6:
                halfway.set()
                release.wait(10)
            yield item

    thread = threading.Thread(target=lambda: asyncio.run(writer.send_weights(slow(), 2)))
    thread.start()
    try:
        assert halfway.wait(10)
        assert writer.published_steps() == [1]
        assert any(p.name.startswith(".tmp-step-00000002") for p in tmp_path.iterdir())
        reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=0.2)
        with pytest.raises(ckpt.TransferTimeoutError, match="global_steps=2 was not published .* timeout of 0.2 s"):
            _receive(reader, 2)
        compare(sample_weights(1), _receive(reader, None), "step 1 while 2 is written")
    finally:
        release.set()
        thread.join(10)
    assert writer.published_steps() == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temporary renamed away


def test_a_failed_write_publishes_nothing(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)

    def broken():
        yield "a", torch.ones(3)
        raise RuntimeError("trainer crashed")

    with pytest.raises(RuntimeError, match="trainer crashed"):
        _send(writer, broken(), 1)
    assert os.listdir(tmp_path) == []


def test_pruning_during_a_read_does_not_disturb_the_reader(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=1, shard_size=1000)
    _send(writer, sample_weights(1), 1)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path)

    async def read_while_pruned():
        stream = reader.receive_weights(1)
        first = await stream.__anext__()
        await writer.send_weights(iter(sample_weights(2)), 2)  # prunes step 1 (keep_last=1)
        return [(first[0], first[1].clone())] + [(n, t.clone()) async for n, t in stream]

    got = asyncio.run(read_while_pruned())
    assert writer.published_steps() == [2]
    compare(sample_weights(1), got, "step 1 read across its pruning")
    assert len(list((tmp_path / "step-00000002").glob("*.safetensors"))) > 1  # sharded by shard_size


def test_republishing_a_step_and_bad_config_are_refused(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    _send(writer, sample_weights(1), 1)
    with pytest.raises(ckpt.CheckpointConfigError, match="global_steps=1 is already published"):
        _send(writer, sample_weights(1), 1)
    with pytest.raises(ckpt.CheckpointConfigError, match="keep_last must be an int >= 1, got 0"):
        ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=0)
    with pytest.raises(ckpt.CheckpointConfigError, match="global_steps must be None or an int >= 0, got -3"):
        _send(writer, [], -3)


def test_received_tensors_land_on_the_requested_device(tmp_path, hal_device):
    import hal

    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    _send(writer, sample_weights(1), 1)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, device=hal_device)

    async def kinds():
        return {t.device.type async for _, t in reader.receive_weights(1)}
    assert asyncio.run(kinds()) == {hal.get_device_name(hal_device)}


def test_a_step_below_the_newest_is_refused_naming_both_and_the_way_out(tmp_path):
    """A trainer resumed from step 3 after 5 and 6 were published: writing 3 and pruning it at once (readers
    then told 6 is on offer) is refused before anything is written; the message's way out works."""
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, keep_last=2)
    for step in (5, 6):
        _send(writer, sample_weights(step), step)
    with pytest.raises(ckpt.CheckpointConfigError) as info:
        _send(writer, sample_weights(3), 3)
    text = str(info.value)
    assert "global_steps=3 is below the newest step published" in text and "global_steps=6" in text
    assert "fresh root or remove step-00000005, step-00000006" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000006"]  # nothing written
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path)
    compare(sample_weights(6), _receive(reader, 6), "newest step after the refusal")
    for step in (5, 6):
        shutil.rmtree(tmp_path / f"step-0000000{step}")
    _send(writer, sample_weights(3), 3)
    compare(sample_weights(3), _receive(ckpt.get_checkpoint_engine("file", root=tmp_path), 3), "republished 3")


@pytest.mark.parametrize("where", ["index", "shard"])
def test_a_step_whose_index_or_shard_tag_disagrees_is_refused(tmp_path, where):
    """A step directory whose index.json or a shard's safetensors metadata carries another global_steps
    (a copied or hand-edited directory) raises TransferError naming the file and both tags, yielding nothing."""
    from safetensors.torch import load_file, save_file

    writer = ckpt.get_checkpoint_engine("file", root=tmp_path, shard_size=1000)
    _send(writer, sample_weights(4), 4)
    step_dir = tmp_path / "step-00000004"
    shards = sorted(step_dir.glob("*.safetensors"))
    if where == "index":
        index = json.loads((step_dir / "index.json").read_text())
        (step_dir / "index.json").write_text(json.dumps({**index, "global_steps": 9}))
        expected = "tagged global_steps=4, index=9, expected 4"
    else:
        save_file(load_file(shards[-1]), shards[-1], {"global_steps": "9"})
        expected = f"{shards[-1].name} is tagged global_steps=9, index=4, expected 4"
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path)
    with pytest.raises(ckpt.TransferError, match=expected):
        _receive(reader, 4)
    assert reader.received_global_steps is None


class FailsOnce(ckpt.InMemoryRolloutAdapter):
    """A rollout whose next apply fails once :attr:`fail_next` is set, after the first tensor (e.g. out of
    memory while loading)."""

    fail_next = False

    async def update_weights(self, weights, wire_format="named_tensors", *, global_steps=None, **kwargs):
        if self.fail_next:
            self.fail_next = False
            async for _ in weights:
                raise RuntimeError("apply failed")
        return await super().update_weights(weights, wire_format, global_steps=global_steps, **kwargs)


def test_a_step_whose_apply_failed_is_offered_again_on_retry(tmp_path):
    """TRL 5932: step 2 was read but its apply failed; the retry (``global_steps=None``: the newest step newer
    than the last received) gets step 2, not "no step newer than 2"."""
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=0.5)
    adapter = FailsOnce()
    worker = ckpt.CheckpointEngineWorker(reader, adapter)
    _send(writer, sample_weights(1), 1)
    assert asyncio.run(worker.update_weights(None)) == 1
    _send(writer, sample_weights(2), 2)
    adapter.fail_next = True
    with pytest.raises(RuntimeError, match="apply failed"):
        asyncio.run(worker.update_weights(None))
    assert adapter.served_step == 1 and reader.received_global_steps == 1  # not applied: not received
    assert asyncio.run(worker.update_weights(None)) == 2  # the retry
    assert adapter.served_step == 2
    compare(sample_weights(2), list(adapter.state_dict().items()), "retried step 2")


def test_a_stream_closed_before_its_end_does_not_count_as_received(tmp_path):
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=0.5)
    _send(writer, sample_weights(1), 1)
    _receive(reader, 1)

    async def first_then_close():
        stream = reader.receive_weights(None)
        await stream.__anext__()
        assert reader.received_global_steps == 2  # the contract: known once the first tensor is yielded
        await stream.aclose()

    _send(writer, sample_weights(2), 2)
    asyncio.run(first_then_close())
    assert reader.received_global_steps == 1
    compare(sample_weights(2), _receive(reader, None), "step 2 after a closed stream")


def test_a_receive_started_before_the_publish_waits_for_the_step(tmp_path):
    """verl's manager runs send and receive at once; with the default timeout the reader waits for the step."""
    writer = ckpt.get_checkpoint_engine("file", root=tmp_path)
    reader = ckpt.get_checkpoint_engine("file", root=tmp_path)
    assert reader.timeout == 60.0  # bounded, like every other engine

    async def both():
        got, _ = await asyncio.gather(collect(reader.receive_weights(5)),
                                      writer.send_weights(iter(sample_weights(5)), 5))
        return got

    compare(sample_weights(5), asyncio.run(both()), "received while being published")
    assert reader.received_global_steps == 5


def test_a_step_never_published_fails_within_the_timeout_naming_step_and_timeout(tmp_path):
    import time

    reader = ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(ckpt.TransferTimeoutError, match=r"global_steps=5 was not published .* timeout of 0.3 s "
                                                        r"\(published: \[\]\)"):
        _receive(reader, 5)
    assert 0.3 <= time.monotonic() - start < 5


def test_send_buffer_bytes_are_the_host_copies_of_the_update():
    cls = type(ckpt.get_checkpoint_engine("file", root="unused"))
    assert cls.send_buffer_bytes(1 << 20, 12345) == {"host_copies_bytes": 12345}
    assert "host copies" in cls.send_buffer_words
