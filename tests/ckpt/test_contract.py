"""Every built-in checkpoint engine through the contract suite of ``ckpt.testing``, plus engines that break it."""

import asyncio

import pytest

import ckpt
from ckpt.testing import CONTRACT_CHECKS, ContractFailure, run_check, run_contract_suite
from ckpt.testing import standalone_pair


def _colocated():
    async def make():
        engine = ckpt.get_checkpoint_engine("colocated", timeout=10)
        return engine, engine
    return make


def _file(tmp_path):
    async def make():
        root = tmp_path / f"ckpts-{len(list(tmp_path.iterdir()))}"
        return (ckpt.get_checkpoint_engine("file", root=root, keep_last=2),
                ckpt.get_checkpoint_engine("file", root=root, timeout=10))
    return make


def _collective(direct_threshold):
    async def make():
        return standalone_pair("collective", bucket_size=64 << 10, device="cpu", timeout=20,
                               direct_threshold=direct_threshold)
    return make


ENGINES = ["colocated", "file", "collective-packed", "collective-direct"]


@pytest.mark.parametrize("check", list(CONTRACT_CHECKS))
@pytest.mark.parametrize("engine", ENGINES)
def test_builtin_engine_keeps_the_contract(engine, check, tmp_path):
    make = {"colocated": _colocated(), "file": _file(tmp_path), "collective-packed": _collective(0),
            "collective-direct": _collective(256)}[engine]
    asyncio.run(run_check(make, check, timeout=60))


def _transfer_library(name, device):
    async def make():
        ok, reason = ckpt.checkpoint_engine_availability(name, device)
        if not ok:
            pytest.skip(f"{name}: {reason}")
        return standalone_pair(name, bucket_size=64 << 10, device=device, timeout=20)
    return make


@pytest.mark.parametrize("check", list(CONTRACT_CHECKS))
@pytest.mark.parametrize("engine", ["nixl", "mooncake", "kimi"])
def test_transfer_library_engine_keeps_the_contract(engine, check, hal_device):
    """NIXL and Mooncake (host memory on cpu, the sim's device memory in place on npu-sim), 64 KiB buckets: the
    mixed sample's large tensors travel in chunks. Kimi's checkpoint-engine where a kind it runs on is tested
    (npu-sim, cuda, npu; skipped with the reason on cpu): its buckets grow to the largest tensor."""
    asyncio.run(run_check(_transfer_library(engine, hal_device), check, timeout=60))


def test_kimi_is_refused_here_with_the_reason_and_the_alternatives():
    ok, reason = ckpt.checkpoint_engine_availability("kimi")
    if ok:
        pytest.skip("a device kind Kimi's checkpoint-engine supports is available: its contract test runs instead")
    with pytest.raises(ckpt.CheckpointEngineUnavailableError) as info:
        ckpt.get_checkpoint_engine("kimi")
    text = str(info.value)
    assert "'kimi' is unavailable here" in text and "runs only on device kinds" in text
    from ckpt.kimi import supported_kinds

    assert supported_kinds() and all(repr(k) in text for k in supported_kinds())
    assert "available: " in text and "collective" in text.split("available: ")[-1]
    assert isinstance(info.value, RuntimeError)


class _SyncSendEngine(ckpt.CheckpointEngine):
    """The upstream bug: send_weights is a plain def (awaiting its result raises TypeError)."""

    def send_weights(self, weights, global_steps=None):
        self.offer = (global_steps, list(weights))

    async def receive_weights(self, global_steps=None):
        step, weights = self.offer
        self.received_global_steps = step
        for item in weights:
            yield item


class _DuckSyncReceive:
    """Not a subclass of the ABC; receive_weights returns a list."""

    received_global_steps = None

    def prepare(self):
        return {}

    @classmethod
    def build_topology(cls, trainer_world_size, rollout_world_size, metadata):
        return {}, {}

    def init_process_group(self, **kwargs): ...
    def finalize(self): ...

    async def send_weights(self, weights, global_steps=None):
        self.offer = (global_steps, list(weights))

    def receive_weights(self, global_steps=None):
        self.received_global_steps = self.offer[0]
        return self.offer[1]


class _WrongStepEngine(ckpt.ColocatedCheckpointEngine):
    """Async everywhere but reports step + 1: a behavioural violation."""

    async def receive_weights(self, global_steps=None):
        async for item in super().receive_weights(None):
            yield item
        self.received_global_steps += 1


@pytest.mark.parametrize("bad", [_SyncSendEngine, _DuckSyncReceive])
def test_contract_suite_catches_a_method_that_is_not_async(bad):
    async def make():
        engine = object.__new__(bad)
        return engine, engine
    failures = asyncio.run(run_contract_suite(make, timeout=10))
    assert set(failures) == set(CONTRACT_CHECKS)
    assert "ContractError" in failures["call_contract"]
    name = "send_weights" if bad is _SyncSendEngine else "receive_weights"
    assert f"{name} is a plain function (def)" in failures["call_contract"]


def test_contract_suite_catches_a_wrong_step():
    async def make():
        engine = _WrongStepEngine(timeout=5)
        return engine, engine
    with pytest.raises(ContractFailure, match="received_global_steps is 4, the sender sent 3"):
        asyncio.run(run_check(make, "round_trip_mixed_dtypes"))


def test_registry_refuses_a_sync_engine_class_and_duplicates():
    with pytest.raises(ckpt.ContractError, match="send_weights is a plain function"):
        ckpt.register_checkpoint_engine("sync-send", _SyncSendEngine)
    assert "sync-send" not in ckpt.known_checkpoint_engines()
    with pytest.raises(ckpt.DuplicateCheckpointEngineError, match="'file'"):
        ckpt.register_checkpoint_engine("file", ckpt.FileCheckpointEngine)


def test_registry_refuses_a_factory_that_builds_a_sync_engine():
    ckpt.register_checkpoint_engine("duck-sync", lambda **cfg: _DuckSyncReceive())
    try:
        with pytest.raises(ckpt.ContractError, match="receive_weights is a plain function"):
            ckpt.get_checkpoint_engine("duck-sync")
    finally:
        ckpt.unregister_checkpoint_engine("duck-sync")


def test_third_party_engine_registers_and_runs_the_suite():
    ckpt.register_checkpoint_engine("third-party", ckpt.ColocatedCheckpointEngine)
    try:
        async def make():
            engine = ckpt.get_checkpoint_engine("third-party", timeout=5)
            return engine, engine
        assert asyncio.run(run_contract_suite(make, timeout=30)) == {}
    finally:
        ckpt.unregister_checkpoint_engine("third-party")


def test_unknown_engine_lists_known_names_and_import_failures(monkeypatch):
    from ckpt import registry

    monkeypatch.setitem(registry._import_errors, "broken", "ImportError: No module named 'vendor_ckpt'")
    with pytest.raises(ckpt.UnknownCheckpointEngineError) as info:
        ckpt.get_checkpoint_engine("nope")
    text = str(info.value)
    for part in ("'nope'", "collective", "colocated", "file", "broken: ImportError: No module named 'vendor_ckpt'"):
        assert part in text
    assert isinstance(info.value, KeyError) and isinstance(info.value, ckpt.CheckpointEngineError)


def _engine_class(name):
    from ckpt import collective, colocated, file, kimi, mooncake, nixl

    return {"collective": collective.CollectiveCheckpointEngine, "colocated": colocated.ColocatedCheckpointEngine,
            "file": file.FileCheckpointEngine, "nixl": nixl.NixlCheckpointEngine,
            "mooncake": mooncake.MooncakeCheckpointEngine, "kimi": kimi.KimiCheckpointEngine}[name]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "10", True])
@pytest.mark.parametrize("name", ["collective", "colocated", "file", "nixl", "mooncake", "kimi"])
def test_every_engine_refuses_a_timeout_that_is_not_a_finite_positive_number(name, value, tmp_path):
    """nan made the file engine's wait endless and the collective's fail late with a bare ValueError; every
    constructor refuses it (and inf, negatives, strings, bools) up front, naming the parameter and value.
    The class is built directly: the transfer-library engines check their arguments before their library."""
    extra = {"root": tmp_path} if name == "file" else {}
    with pytest.raises(ckpt.CheckpointConfigError) as info:
        _engine_class(name)(timeout=value, **extra)
    assert f"timeout must be a finite real number of seconds > 0, got {value!r}" in str(info.value) or (
        name == "file" and f"timeout must be a finite real number of seconds >= 0, got {value!r}" in str(info.value))
    assert isinstance(info.value, ValueError)


def test_the_file_engine_accepts_a_zero_timeout_and_checks_poll_interval(tmp_path):
    assert ckpt.FileCheckpointEngine(tmp_path, timeout=0).timeout == 0.0
    with pytest.raises(ckpt.CheckpointConfigError, match=r"poll_interval must be a finite real number of seconds "
                                                          r"> 0, got nan"):
        ckpt.FileCheckpointEngine(tmp_path, poll_interval=float("nan"))


def test_registering_a_builtin_name_before_any_lookup_is_refused(monkeypatch):
    """The built-ins were loaded on first lookup, after the duplicate check: registering 'collective' first
    silently replaced it. A fresh registry (restored after the test) now refuses it, and bad names are
    configuration errors naming the value."""
    from ckpt import registry

    monkeypatch.setattr(registry, "_engines", {})
    monkeypatch.setattr(registry, "_import_errors", {})
    monkeypatch.setattr(registry, "_loaded", False)

    class Impostor(ckpt.ColocatedCheckpointEngine):
        pass

    with pytest.raises(ckpt.DuplicateCheckpointEngineError, match="already registered as 'collective'"):
        ckpt.register_checkpoint_engine("collective", Impostor)
    assert ckpt.checkpoint_engine_factory("collective") is ckpt.CollectiveCheckpointEngine
    for bad in ("", 3):
        with pytest.raises(ckpt.CheckpointConfigError, match=f"name must be a non-empty str, got {bad!r}") as info:
            ckpt.register_checkpoint_engine(bad, Impostor)
        assert not isinstance(info.value, ckpt.DuplicateCheckpointEngineError)
