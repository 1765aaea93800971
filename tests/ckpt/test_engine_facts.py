"""The engines' class facts (:class:`ckpt.CheckpointEngine`) and the registry's questions about them: what the job,
the CLI and the benchmarks read instead of lists of engine names."""

from __future__ import annotations

import pathlib

import pytest

import ckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]

FACTS = {  # each built-in engine's facts that are true; every other fact is false
    "collective": {"accepts_repeated_global_steps", "bucketed", "bytes_cross_a_network", "hosts_rendezvous",
                   "receives_inside_vllm", "supports_multi_sender", "supports_reshard"},
    "colocated": {"accepts_repeated_global_steps", "one_process"},
    "file": {"publishes_to_files", "ranks_may_share_a_device"},
    "ipc": {"bucketed", "ranks_may_share_a_device", "stages_in_shared_memory", "supports_reshard"},
    "kimi": {"bucketed", "hosts_rendezvous", "rollout_pulls", "uses_transfer_library"},
    "mooncake": {"bucketed", "bytes_cross_a_network", "hosts_rendezvous", "uses_transfer_library"},
    "nixl": {"bucketed", "bytes_cross_a_network", "hosts_rendezvous", "uses_transfer_library"},
}
ALL_FACTS = sorted(k for k, v in vars(ckpt.CheckpointEngine).items() if isinstance(v, bool))


@pytest.mark.parametrize("name", sorted(FACTS))
def test_each_builtin_engine_states_its_facts(name):
    assert {fact for fact in ALL_FACTS if ckpt.checkpoint_engine_says(name, fact)} == FACTS[name]


def test_engines_where_lists_the_engines_that_state_a_fact():
    assert ckpt.checkpoint_engines_where("publishes_to_files") == ["file"]
    assert ckpt.checkpoint_engines_where("one_process") == ["colocated"]
    assert ckpt.checkpoint_engines_where("uses_transfer_library") == ["kimi", "mooncake", "nixl"]


def test_a_misspelt_fact_or_an_unknown_engine_is_an_error_not_false():
    with pytest.raises(AttributeError, match=r"'bucketted' is not a class fact of CheckpointEngine; facts: "
                                             r"accepts_repeated_global_steps, bucketed"):
        ckpt.checkpoint_engine_says("collective", "bucketted")
    with pytest.raises(AttributeError, match="'timeout'"):  # an attribute, but not a fact
        ckpt.checkpoint_engines_where("timeout")
    with pytest.raises(ckpt.UnknownCheckpointEngineError, match="'nope'"):
        ckpt.checkpoint_engine_says("nope", "bucketed")


def test_a_third_party_engine_is_asked_like_a_builtin():
    class Shared(ckpt.ColocatedCheckpointEngine):
        publishes_to_files = True

    ckpt.register_checkpoint_engine("third-party-files", Shared)
    try:
        assert ckpt.checkpoint_engine_says("third-party-files", "publishes_to_files")
        assert ckpt.checkpoint_engines_where("publishes_to_files") == ["file", "third-party-files"]
    finally:
        ckpt.unregister_checkpoint_engine("third-party-files")


def test_how_an_engine_moves_bytes_is_its_classes_word_for_the_kind():
    """``hal sync`` says which transport the ipc engine uses on the kind (a fresh user could not tell whether
    their buckets went through device IPC or /dev/shm); the other built-in engines add nothing to their name."""
    import types

    import hal

    cuda_like = types.SimpleNamespace(kind="cuda", ipc_transport=lambda: "device", host_memory=False)
    assert ckpt.checkpoint_engine_transport("ipc", cuda_like) == "cuda IPC handles, read in place"
    old_cann = types.SimpleNamespace(kind="npu", ipc_transport=lambda: "shm", host_memory=False)
    assert ckpt.checkpoint_engine_transport("ipc", old_cann) == "shared memory, /dev/shm, copied to and from npu memory"
    for kind in ("cpu", "npu-sim"):
        spec = hal.resolve_device(kind)
        expected = ("shared memory, /dev/shm" + ("" if kind == "cpu" else f", copied to and from {kind} memory")
                    if spec.ipc_transport() == "shm" else f"{kind} IPC handles, read in place")
        assert ckpt.checkpoint_engine_transport("ipc", spec) == expected
        assert all(ckpt.checkpoint_engine_transport(name, spec) is None for name in FACTS if name != "ipc")
