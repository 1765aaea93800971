"""verl 0.9.1's CheckpointEngine lifecycle on hal's engines, without verl: construction as verl's registry
does it, sync prepare / classmethod build_topology / init_process_group / finalize every update, and a
communicator kept while the topology is unchanged."""

import asyncio
import gc
import os
import threading

import pytest
import torch

import ckpt
import hal
from ckpt.collective import CollectiveCheckpointEngine
from ckpt.testing import collect, compare, sample_weights, transfer
from tests.ports import pick_port


def test_engines_build_as_verls_registry_builds_them(tmp_path):
    for name, extra in (("colocated", {}), ("collective", {"device": "cpu"}), ("file", {"root": tmp_path})):
        for is_master in (True, False):
            engine = ckpt.get_checkpoint_engine(name, bucket_size=1 << 20, is_master=is_master, **extra)
            assert engine.bucket_size == 1 << 20 and engine.is_master is is_master
            assert engine.wire_format == "named_tensors"
            metadata = engine.prepare()
            assert isinstance(metadata, dict)
            engine.finalize()
            if hasattr(engine, "close"):
                engine.close()


def test_build_topology_rejects_metadata_without_a_master():
    with pytest.raises(ckpt.CheckpointConfigError, match="metadata\\[0\\] must be the prepare\\(\\) result of the master"):
        CollectiveCheckpointEngine.build_topology(1, 1, [None, None])
    with pytest.raises(ckpt.CheckpointConfigError, match="all 1 \\+ 2 workers"):
        CollectiveCheckpointEngine.build_topology(1, 2, [{}, {}])


def _lifecycle(trainers, rollouts):
    """prepare on all, build_topology on the class, init_process_group on all at once (threads)."""
    metadata = [e.prepare() for e in trainers + rollouts]
    tkw, rkw = type(trainers[0]).build_topology(len(trainers), len(rollouts), metadata)
    for side, engines in ((tkw, trainers), (rkw, rollouts)):
        assert all(len(v) == len(engines) for v in side.values())
    calls = [(e, {k: v[i] for k, v in side.items()}) for side, engines in ((tkw, trainers), (rkw, rollouts))
             for i, e in enumerate(engines)]
    errors = []

    def run(engine, kwargs):
        try:
            engine.init_process_group(**kwargs)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return tkw, rkw


async def _update(trainers, rollouts, step):
    weights = sample_weights(step)

    async def send(engine):
        await engine.send_weights(iter(weights), step)

    results = await asyncio.gather(*(send(e) for e in trainers),
                                   *(collect(e.receive_weights(step)) for e in rollouts))
    for got in results[len(trainers):]:
        compare(weights, got, f"update {step}")
    for engine in rollouts:
        assert engine.received_global_steps == step


def test_verl_lifecycle_keeps_the_communicator_while_the_topology_is_unchanged():
    kw = dict(bucket_size=64 << 10, device="cpu", timeout=30)
    trainers = [CollectiveCheckpointEngine(is_master=True, **kw), CollectiveCheckpointEngine(**kw)]
    rollouts = [CollectiveCheckpointEngine(**kw) for _ in range(2)]
    everyone = trainers + rollouts
    try:
        groups, generations, held = [], [], []
        for step in (1, 2, 3, 4):
            tkw, rkw = _lifecycle(trainers, rollouts)
            assert tkw["rank"] == [0, -1] and rkw["rank"] == [1, 2] and rkw["world_size"] == [3, 3]
            generations.append(tkw["generation"][0])
            asyncio.run(_update(trainers, rollouts, step))
            groups.append(tuple(e._group for e in everyone))
            for e in everyone:
                e.finalize()
            # the buckets stay for the next update (refilling them every update cost more than the transfer)
            held.append([e.buffer_bytes for e in everyone])
        assert len(set(map(lambda g: tuple(map(id, g)), groups))) == 1 and groups[0][1] is None  # one communicator; trainer 1 is outside
        assert generations == [1, 1, 1, 1]
        assert held[0][0] >= 2 * (64 << 10) and held[0][2] >= 2 * (64 << 10) and held[0][1] == 0, held
        assert all(h == held[0] for h in held), held  # kept, not regrown, while the topology is unchanged
        # a changed topology (one rollout leaves) forms a new generation, and transfers still work
        tkw, rkw = _lifecycle(trainers, rollouts[:1])
        assert tkw["generation"] == [2, 2] and rkw == {"rank": [1], "world_size": [2], "master_addr": tkw["master_addr"][:1],
                                                      "master_port": tkw["master_port"][:1], "generation": [2]}
        assert trainers[0]._group is not groups[0][0] and groups[0][0].backend is None  # the old one is closed
        asyncio.run(_update(trainers, rollouts[:1], 5))
        for e in everyone:
            e.close()
        assert [e.buffer_bytes for e in everyone] == [0, 0, 0, 0]  # close() frees them
    finally:
        for e in everyone:
            e.close()


def test_standalone_engine_driven_by_verls_lifecycle_reuses_its_group():
    # a port the kernel gave a moment ago: the lazy first update has no prepare() to host it and report it
    common = dict(world_size=2, master_addr="127.0.0.1", master_port=pick_port("127.0.0.1"), bucket_size=4096,
                  device="cpu", timeout=20)
    sender, receiver = CollectiveCheckpointEngine(rank=0, **common), CollectiveCheckpointEngine(rank=1, **common)

    async def lazy_first():  # hal's standalone use: no lifecycle calls at all
        compare(sample_weights(1), await transfer(sender, receiver, sample_weights(1), 1, 1), "lazy")
    try:
        asyncio.run(lazy_first())
        first = sender._group
        for step in (2, 3):
            _lifecycle([sender], [receiver])
            asyncio.run(_update([sender], [receiver], step))
            sender.finalize(), receiver.finalize()
        assert sender._group is first and first.backend is not None  # the group formed lazily is kept
    finally:
        sender.close(), receiver.close()


def _open_fds():
    """Descriptors open in this process after a full collection: sockets of an earlier test's unreachable
    objects close when the collector runs, whenever that is (a CI run saw 82, 82, 82, 78)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_transfer_library_engine_keeps_agent_buffers_and_connections_across_verls_updates(name):
    ok, reason = ckpt.checkpoint_engine_availability(name)
    if not ok:
        pytest.skip(f"{name}: {reason}")
    kw = dict(bucket_size=64 << 10, device="cpu", timeout=30)
    trainers = [ckpt.get_checkpoint_engine(name, is_master=True, master_addr="127.0.0.1", **kw),
                ckpt.get_checkpoint_engine(name, **kw)]
    rollouts = [ckpt.get_checkpoint_engine(name, **kw) for _ in range(2)]

    def held():  # what each update would otherwise set up again: the library's agent, control channels, buffers
        sender = trainers[0]
        return ([sender._transport, sender._store, sender._control, sender._region.data_ptr()]
                + [sender._peers[r] for r in (1, 2)]
                + [x for e in rollouts for x in (e._transport, e._control, e._region.data_ptr())])
    try:
        kept, fds = [], []
        for step in (1, 2, 3, 4):
            tkw, rkw = _lifecycle(trainers, rollouts)
            assert tkw["rank"] == [0, -1] and rkw["rank"] == [1, 2]
            asyncio.run(_update(trainers, rollouts, step))
            kept.append(held())
            for e in trainers + rollouts:
                e.finalize()
            fds.append(_open_fds())
        same = [(a == b) if isinstance(a, int) else (a is b) for k in kept[1:] for a, b in zip(kept[0], k)]
        assert all(same), f"an update set something up again: {same}"
        # sockets, the library's files and registrations: no update adds one (UCX may close one late, after
        # the first update: CI once saw 119, 117, 117, 117)
        assert all(later <= earlier for earlier, later in zip(fds, fds[1:])), fds
        # a changed topology (one rollout leaves) releases them: new connections, new agents, still correct
        _lifecycle(trainers, rollouts[:1])
        asyncio.run(_update(trainers, rollouts[:1], 5))
        assert trainers[0]._transport is not kept[0][0] and list(trainers[0]._peers) == [1]
        assert rollouts[0]._transport is not kept[0][6]
    finally:
        for e in trainers + rollouts:
            e.close()
    assert all(e._transport is None and e._peers == {} and e._control is None for e in trainers + rollouts)


class _Decorated(ckpt.ColocatedCheckpointEngine):
    """Async methods wrapped as verl wraps its own (``@torch.no_grad()``): the wrappers are plain functions."""

    @torch.no_grad()
    async def send_weights(self, weights, global_steps=None):
        await super().send_weights(weights, global_steps)

    @torch.no_grad()
    async def receive_weights(self, global_steps=None, *, placement=None):
        async for item in super().receive_weights(global_steps, placement=placement):
            yield item


def test_decorated_async_methods_keep_the_contract():
    from ckpt.testing import run_contract_suite

    assert not type(_Decorated.__dict__["send_weights"]).__name__.startswith("coroutine")
    assert ckpt.contract_violations(_Decorated) == []
    ckpt.register_checkpoint_engine("decorated-test", _Decorated)
    try:
        async def make():
            engine = ckpt.get_checkpoint_engine("decorated-test", bucket_size=1 << 20, timeout=5)
            return engine, engine
        assert asyncio.run(run_contract_suite(make, timeout=30)) == {}
    finally:
        ckpt.unregister_checkpoint_engine("decorated-test")


class _AsyncLifecycle(ckpt.ColocatedCheckpointEngine):
    async def prepare(self):  # verl calls it synchronously: the coroutine would never run
        return {}


def test_an_async_lifecycle_method_is_a_violation():
    assert ckpt.contract_violations(_AsyncLifecycle) == [
        "prepare is a coroutine function ('async def'); verl calls it synchronously, so it must be a plain 'def'"]


ONE_TO_MANY = ("collective", "nixl", "mooncake", "kimi")


def _one_to_many_classes():
    from ckpt.one_to_many import OneToManyEngine

    classes = {}
    for name in ONE_TO_MANY:
        try:
            classes[name] = ckpt.checkpoint_engine_factory(name)
        except ckpt.CheckpointEngineError:  # a backend that failed to import: nothing to check here
            continue
    assert "collective" in classes
    assert all(issubclass(cls, OneToManyEngine) for cls in classes.values()), classes
    return classes


def test_one_to_many_engines_share_one_base_topology_and_take_verls_keywords():
    from ckpt.one_to_many import VERL_KEYWORDS, OneToManyEngine, named_parameters

    for name, cls in _one_to_many_classes().items():
        assert cls.build_topology.__func__ is OneToManyEngine.build_topology.__func__, name
        assert cls.init_process_group is OneToManyEngine.init_process_group, name
        accepted = set(named_parameters(cls.__init__)) | set(getattr(cls, "extra_keywords", ()))
        if name in ("nixl", "mooncake"):  # they pass the rest to P2PCheckpointEngine
            accepted |= set(named_parameters(cls.__mro__[1].__init__))
        assert set(VERL_KEYWORDS) <= accepted, (name, accepted)
    tkw, rkw = OneToManyEngine.build_topology(2, 2, [
        {"is_master": True, "master_addr": "h", "master_port": 7, "generation": 3, "joined": None}, {}, {}, {}])
    assert tkw == {"rank": [0, -1], "world_size": [3, 3], "master_addr": ["h", "h"], "master_port": [7, 7],
                   "generation": [4, 4]}
    assert rkw["rank"] == [1, 2] and rkw["generation"] == [4, 4]


@pytest.mark.parametrize("name", ONE_TO_MANY)
def test_an_unknown_keyword_is_refused_naming_it_and_the_accepted_ones(name):
    cls = _one_to_many_classes().get(name)
    if cls is None:
        pytest.skip(f"{name} did not import here")
    with pytest.raises(ckpt.CheckpointConfigError) as info:
        cls(bucket_size=1 << 20, is_master=True, bucket_sise=4096, device="cpu")
    text = str(info.value)
    assert "'bucket_sise'" in text and "bucket_size" in text and "timeout" in text and "is_master" in text


def test_init_process_group_refuses_an_unknown_keyword():
    engine = CollectiveCheckpointEngine(bucket_size=1 << 20, device="cpu")
    with pytest.raises(ckpt.CheckpointConfigError, match="unknown keyword.*'ranks'.*accepts generation, master_addr"):
        engine.init_process_group(ranks=1, world_size=2, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ckpt.CheckpointConfigError, match="store_addr must be 'host:port', got 'h:'"):
        CollectiveCheckpointEngine(store_addr="h:", device="cpu")


def _store_answers(port: int) -> bytes:
    """Set and read back a key in the store at 127.0.0.1:``port`` (``hal.DistributedTimeoutError`` within 2 s
    when nobody serves it)."""
    client = hal.connect_store("127.0.0.1", port, 1, 2, 2.0, is_master=False)
    client.set("probe", str(port))
    return client.get("probe")


@pytest.mark.parametrize("name, device", [("nixl", "cpu"), ("mooncake", "cpu"), ("kimi", "npu-sim")])
def test_the_masters_prepare_reports_a_store_it_already_serves_and_keeps_across_topologies(name, device):
    """No port is picked and bound later: the address the master's ``prepare()`` hands verl's manager answers at
    once (before kimi hosted its store, it picked a free port and bound it at the first send, when another
    process may have taken it), keeps answering across new generations, and is gone after ``close()``."""
    ok, reason = ckpt.checkpoint_engine_availability(name, device)
    if not ok:
        pytest.skip(f"{name} on {device}: {reason}")
    engine = ckpt.get_checkpoint_engine(name, is_master=True, master_addr="127.0.0.1", bucket_size=64 << 10,
                                        device=device, timeout=10)
    try:
        port = engine.prepare()["master_port"]
        assert _store_answers(port) == str(port).encode()
        for generation in (1, 2):  # verl's manager forming new groups: the store stays where it was reported
            engine.init_process_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port,
                                      generation=generation)
            assert engine.prepare()["master_port"] == port and _store_answers(port) == str(port).encode()
    finally:
        engine.close()
    gc.collect()
    with pytest.raises(hal.DistributedTimeoutError):
        _store_answers(port)


@pytest.mark.parametrize("name, device", [("nixl", "cpu"), ("mooncake", "cpu"), ("kimi", "npu-sim")])
def test_a_master_told_another_address_hosts_its_store_there(name, device):
    """``init_process_group`` with another ``master_port`` than the one the store was hosted at: the next
    ``prepare()`` reports that address, and it is served (a review found it reported, nobody listening)."""
    ok, reason = ckpt.checkpoint_engine_availability(name, device)
    if not ok:
        pytest.skip(f"{name} on {device}: {reason}")
    engine = ckpt.get_checkpoint_engine(name, is_master=True, master_addr="127.0.0.1", bucket_size=64 << 10,
                                        device=device, timeout=10)
    try:
        first = engine.prepare()["master_port"]
        other = pick_port("127.0.0.1")
        engine.init_process_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=other, generation=1)
        assert engine.prepare()["master_port"] == other != first
        assert _store_answers(other) == str(other).encode()
    finally:
        engine.close()
