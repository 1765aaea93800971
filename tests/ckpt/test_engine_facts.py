"""The engines' class facts (:class:`ckpt.CheckpointEngine`) and the registry's questions about them: what the job,
the CLI and the benchmarks read instead of lists of engine names."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]

FACTS = {  # each built-in engine's facts that are true; every other fact is false
    "collective": {"accepts_repeated_global_steps", "bucketed", "bytes_cross_a_network", "hosts_rendezvous",
                   "receives_inside_vllm", "supports_multi_sender"},
    "colocated": {"accepts_repeated_global_steps", "one_process"},
    "file": {"publishes_to_files", "ranks_may_share_a_device"},
    "ipc": {"bucketed", "ranks_may_share_a_device", "stages_in_shared_memory"},
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


def engine_name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of each comparison of an engine (a name containing ``engine``, or ``name``) with one of
    ``names`` as a string: ``engine == "file"``, ``options.engine in ("nixl", "kimi")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = {e.value for side in sides for e in ([side] if isinstance(side, ast.Constant) else
                                                         getattr(side, "elts", [])) if isinstance(e, ast.Constant)}
        subjects = [ast.unparse(side) for side in sides if not isinstance(side, (ast.Constant, ast.Tuple,
                                                                                  ast.List, ast.Set))]
        if literals & names and any("engine" in s or s.split(".")[-1] == "name" for s in subjects):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_an_engine_compared_by_name():
    assert engine_name_comparisons('if options.engine in ("nixl", "kimi"):\n    pass\nok = name == "file"\n'
                                   'step = step == "ipc"\n', set(FACTS)) == [
        (1, "options.engine in ('nixl', 'kimi')"), (3, "name == 'file'")]


def test_no_engine_is_compared_by_name_outside_the_registry():
    """Issue 30: the job, CLI and benchmarks ask an engine's class (``checkpoint_engine_says``); a list of names
    at a call site goes stale when an engine is added (``BUCKETED_ENGINES`` missed ipc)."""
    found = []
    for package in ("hal", "ckpt", "engines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "ckpt/registry.py":
                continue
            found += [f"{path.relative_to(ROOT)}:{line}: {code}"
                      for line, code in engine_name_comparisons(path.read_text(), set(FACTS))]
    assert found == []
