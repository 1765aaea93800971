"""A rollout's refusal reaches the trainer's send_weights (issue 50, point 4; verl 7495: a rollout sampled the
initial policy for weeks), on every engine: hal's CheckpointEngineWorker reports
each update; a receiver that does not (verl's) leaves the sender as it was. And the weight checker
(``send_weights(..., check=True)``) through the same reports."""

import asyncio

import pytest
import torch

import ckpt
import hal
from ckpt.checker import WeightCheckError
from ckpt.delta import DeltaCheckpointEngine, DeltaReceiver
from ckpt.outcome import UpdateRefusedError
from ckpt.testing import collect, sample_weights, standalone_pair

ENGINES = ["collective", "nixl", "mooncake", "kimi", "file", "colocated", "delta", "ipc"]


def _pair(name, tmp_path, device="cpu"):
    if name == "file":
        return (ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=10),
                ckpt.get_checkpoint_engine("file", root=tmp_path, timeout=10))
    if name == "colocated":
        engine = ckpt.get_checkpoint_engine("colocated", timeout=10)
        return engine, engine
    inner = "collective" if name == "delta" else name
    ok, reason = ckpt.checkpoint_engine_availability(inner, device)
    if not ok:
        pytest.skip(f"{inner}: {reason}")
    devices = (None, None) if hal.is_host(device) else (f"{device}:0", f"{device}:1")  # a device per rank
    if name == "ipc":  # its ranks meet at an endpoint, not a rendezvous
        from ckpt.ipc import default_endpoint

        endpoint = default_endpoint()
        return tuple(ckpt.get_checkpoint_engine("ipc", rank=r, world_size=2, endpoint=endpoint, device=d or device,
                                                bucket_size=1 << 16, timeout=10) for r, d in enumerate(devices))
    sender, receiver = standalone_pair(inner, devices, device=device, bucket_size=1 << 16, timeout=10)
    if name == "delta":
        return DeltaCheckpointEngine(sender), DeltaCheckpointEngine(receiver)
    return sender, receiver


def _close(*engines):
    for engine in {id(e): e for e in engines}.values():
        close = getattr(engine, "close", None)
        if close is not None:
            close()


class _Served(ckpt.InMemoryRolloutAdapter):
    """A rollout that applies the update, then serves one tensor other than received (``corrupt``)."""

    def __init__(self, corrupt=None):
        super().__init__()
        self.corrupt = corrupt

    async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
        await super().update_weights(weights, wire_format, **kwargs)
        if self.corrupt is not None:
            self._weights[self.corrupt] = self._weights[self.corrupt].clone().fill_(7)


class _DeltaServed:
    """A delta rollout as verl's adapters are: flushes applied in place by a DeltaReceiver."""

    def __init__(self, like):
        self.weights = {n: torch.zeros_like(t) for n, t in like}
        self.receiver = DeltaReceiver(self.weights)
        self.corrupt = None

    async def update_weights(self, flushes, wire_format="delta_flush", global_steps=None, **_):
        served = await receive_flushes(self.receiver, flushes)
        if self.corrupt is not None:
            self.weights[self.corrupt].fill_(7)
        return served

    def state_dict(self):
        return dict(self.weights)


async def receive_flushes(receiver, flushes):
    served = None
    try:
        async for named, is_last in flushes:
            served = receiver.apply_flush(named, is_last=is_last)
    except BaseException as exc:
        receiver.abort(f"{type(exc).__name__}: {exc}")
        raise
    return served


def _weights(name, step):
    if name != "delta":
        return sample_weights(step)
    g = torch.Generator().manual_seed(step)
    return [("fp32.weight", torch.randn(6, 8, generator=g)), ("bf16.weight", torch.randn(4, 16, generator=g).bfloat16())]


def _mismatched(weights):
    """A rollout that expects one tensor under another name (a name mapping bug)."""
    expected = {n: t for n, t in weights if n != "fp32.weight"}
    expected["model.fp32.weight"] = weights[0][1]
    return ckpt.InMemoryRolloutAdapter(expected)


async def _update(sender, receiver, adapter, weights, step, **send):
    worker = ckpt.CheckpointEngineWorker(receiver, adapter)
    return await asyncio.wait_for(asyncio.gather(sender.send_weights(weights, step, **send),
                                                 worker.update_weights(step), return_exceptions=True), 60)


@pytest.mark.parametrize("name", ENGINES)
def test_a_rollout_that_refuses_an_update_fails_the_trainers_send_naming_the_cause(name, tmp_path, hal_device):
    sender, receiver = _pair(name, tmp_path, hal_device)
    try:
        async def go():
            if name != "delta":
                return await _update(sender, receiver, _mismatched(sample_weights(1)), sample_weights(1), 1), None
            adapter = _DeltaServed(_weights(name, 1))
            assert await _update(sender, receiver, adapter, _weights(name, 1), 1) == [None, 1]  # the seed
            adapter.receiver = DeltaReceiver(adapter.weights)  # restarted: it holds no base the delta applies to
            refused = await _update(sender, receiver, adapter, _weights(name, 2), 2)
            return refused, await _update(sender, receiver, adapter, _weights(name, 3), 3)
        (sent, got), after = asyncio.run(go())
    finally:
        _close(sender, receiver)
    assert isinstance(sent, UpdateRefusedError), sent
    assert isinstance(got, Exception) and f"{type(got).__name__}: {got}" in str(sent), (sent, got)
    assert len(sent.refusals) == 1
    if name == "delta":
        assert after == [None, 3]  # the refusal made the next update a seed, which it applies
    else:
        assert "'model.fp32.weight'" in str(sent) and "WeightMismatchError" in str(sent), sent


@pytest.mark.parametrize("name", ENGINES)
def test_applied_updates_are_reported_and_a_receiver_that_reports_nothing_leaves_the_sender_as_it_was(name, tmp_path, hal_device):
    sender, receiver = _pair(name, tmp_path, hal_device)
    try:
        async def go():
            if name != "delta":  # verl's CheckpointEngineWorker: it consumes the stream and says nothing
                _, got = await asyncio.wait_for(asyncio.gather(sender.send_weights(sample_weights(1), 1),
                                                               collect(receiver.receive_weights(1))), 60)
                assert len(got) == len(sample_weights(1)) and sender.outcomes == {}
            adapter = _DeltaServed(_weights(name, 2)) if name == "delta" else _Served()
            results = await _update(sender, receiver, adapter, _weights(name, 2), 2)
            assert results == [None, 2], results
        asyncio.run(go())
    finally:
        _close(sender, receiver)
    [(_, outcome)] = sender.outcomes.items()
    assert (outcome.step, outcome.error) == (2, None)


@pytest.mark.parametrize("name", ENGINES)
def test_the_weight_check_names_what_a_rollout_serves_wrongly_and_passes_what_it_serves_right(name, tmp_path, hal_device):
    sender, receiver = _pair(name, tmp_path, hal_device)
    try:
        async def go():
            adapter = _DeltaServed(_weights(name, 1)) if name == "delta" else _Served()
            ok = await _update(sender, receiver, adapter, _weights(name, 1), 1, check=True)
            adapter.corrupt = "bf16.weight"
            bad = await _update(sender, receiver, adapter, _weights(name, 2), 2, check=True)
            return ok, bad
        ok, bad = asyncio.run(go())
    finally:
        _close(sender, receiver)
    assert ok == [None, 1], ok
    sent, got = bad
    assert got == 2  # applied: the rollout cannot tell, the check can
    assert isinstance(sent, WeightCheckError) and "'bf16.weight' differs" in str(sent), sent
    [found] = sent.mismatches.values()
    assert len(found) == 1 and found[0].startswith("'bf16.weight' differs"), found


@pytest.mark.multiprocess
def test_multi_sender_lanes_carry_the_refusal_to_every_sender_and_check_their_row_parts():
    from hal.apps.multiprocess import run_multiprocess
    from tests.ckpt import mp_workers

    results = run_multiprocess(mp_workers.multi_sender_refusal, 3, timeout=120)
    for sender in (0, 1):
        refused, checked = results[sender]
        assert refused[0] == "UpdateRefusedError" and "rollout rank 2: WeightMismatchError" in refused[1], refused
        assert "'model.vec'" in refused[1]
        assert checked is None, checked  # every trainer rank's row parts digest as the rollout serves them
    assert results[2][0][0] == "WeightMismatchError" and results[2][1] is None, results[2]


def test_a_collective_init_timeout_names_the_missing_rank_in_words():
    """issue 50, point 7: the rendezvous timed out naming only a store key (keys: /ckpt/1//0/2)."""
    engine = ckpt.get_checkpoint_engine("collective", rank=0, world_size=3, master_addr="127.0.0.1", timeout=3,
                                        device="cpu")
    port = engine.prepare()["master_port"]
    joined = ckpt.get_checkpoint_engine("collective", rank=1, world_size=3, master_addr="127.0.0.1",
                                        master_port=port, timeout=3, device="cpu")
    try:
        async def go():
            return await asyncio.gather(engine.send_weights([], 1), collect(joined.receive_weights(1)),
                                        return_exceptions=True)
        sent, _ = asyncio.run(go())
    finally:
        _close(engine, joined)
    assert isinstance(sent, ckpt.TransferTimeoutError), sent
    assert "rollout rank 2 did not join within 3 s" in str(sent) and "rollout rank 1 did not" not in str(sent), sent


def test_the_digest_is_one_of_the_region_where_either_side_holds_it():
    """A trainer's row shard and a rollout's column slice digest as the same region of the checkpoint tensor."""
    from ckpt.checker import digest, digests, region_key, served_digests

    full = torch.randn(8, 12, dtype=torch.float32).to(torch.bfloat16)
    rows = digests([("w", ckpt.RowShard(full[2:6], 2, (8, 12)))])
    assert list(rows) == ["w[2:6]"]
    assert served_digests(rows, {"w": full}) == rows
    key = region_key("w", [(0, 8), (4, 8)])
    assert served_digests([key], {"w": full})[key] == digest(full[:, 4:8].contiguous(), (0, 4), (8, 12))
    moved = full.clone()
    moved[[2, 3]] = moved[[3, 2]]  # two rows swapped: same values, other places
    assert served_digests(rows, {"w": moved}) != rows
    columns = full.clone()
    columns[:, 0:4], columns[:, 4:8] = full[:, 4:8], full[:, 0:4]  # a tensor-parallel split mixed up in every row
    assert digests([("w", columns)]) != digests([("w", full)])
    flipped = full.clone()
    flipped.view(torch.int16)[5, 7] ^= 1  # one bit
    assert served_digests(rows, {"w": flipped}) != rows
    assert digest(full) == digests([("w", full)])["w"]


def test_the_file_boards_list_of_a_folder_removed_under_it_is_empty(tmp_path, monkeypatch):
    # a rollout's close() deleted the last promise (and its folder) between the sender's is_dir() and iterdir():
    # the trainer's close failed with FileNotFoundError on '.reports/report/promise' (cpu, engine file)
    from pathlib import Path

    from ckpt.outcome import DirectoryBoard

    board = DirectoryBoard(tmp_path)
    board.put("report/promise/rollout-1", b"1")
    assert board.list("report/promise") == ["rollout-1"]
    board.delete("report/promise/rollout-1")
    monkeypatch.setattr(Path, "is_dir", lambda self: True)  # the race's window: the folder was there a moment ago
    assert board.list("report/promise") == []
