"""Issue 30: no engine or device name is compared as a string outside the places that own the names
(``ckpt/registry.py`` for engines, ``devices/`` for device kinds). A list of names at a call site goes stale
when an engine or a kind is added (``BUCKETED_ENGINES`` missed ipc); the code asks the class instead
(``ckpt.checkpoint_engine_says``, a spec's ``host_memory``, ``hal.is_host``, ``Tensor.is_cpu``)."""

from __future__ import annotations

import ast
import pathlib

import ckpt
import hal

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "ckpt", "engines")
ENGINE_NAMES = set(ckpt.known_checkpoint_engines())
DEVICE_NAMES = set(hal.known_kinds()) | {hal.resolve_device(k).name for k in ("cpu", "npu-sim")}


def name_comparisons(source: str, names: set[str], subject=lambda code: True) -> list[tuple[int, str]]:
    """``(line, code)`` of each comparison (``==``, ``!=``, ``in``) of something whose code ``subject`` accepts
    with one of ``names`` as a string literal, alone or in a tuple, list or set."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = {e.value for side in sides for e in ([side] if isinstance(side, ast.Constant) else
                                                         getattr(side, "elts", [])) if isinstance(e, ast.Constant)}
        subjects = [ast.unparse(side) for side in sides if not isinstance(side, (ast.Constant, ast.Tuple,
                                                                                  ast.List, ast.Set))]
        if literals & names and any(subject(s) for s in subjects):
            found.append((node.lineno, ast.unparse(node)))
    return found


def is_engine(code: str) -> bool:
    """An engine's name: a variable or attribute containing ``engine``, or a ``name``."""
    return "engine" in code or code.split(".")[-1] == "name"


def scan(names: set[str], subject, allowed: tuple[str, ...]) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in allowed:
                found += [f"{rel}:{line}: {code}" for line, code in name_comparisons(path.read_text(), names, subject)]
    return found


def test_the_scan_finds_names_compared_as_strings():
    source = ('if options.engine in ("nixl", "kimi"):\n    pass\nok = name == "file"\nstep = step == "ipc"\n'
              'host = t.device.type != "cpu"\nsim = kind in ["npu-sim"]\n')
    assert name_comparisons(source, {"nixl", "kimi", "file", "ipc"}, is_engine) == [
        (1, "options.engine in ('nixl', 'kimi')"), (3, "name == 'file'")]
    assert name_comparisons(source, {"cpu", "npu-sim"}) == [(5, "t.device.type != 'cpu'"), (6, "kind in ['npu-sim']")]


def test_the_names_scanned_are_the_registered_ones():
    assert {"collective", "colocated", "file", "ipc", "kimi", "mooncake", "nixl"} <= ENGINE_NAMES
    assert {"cpu", "cuda", "npu", "npu-sim"} <= DEVICE_NAMES


def test_no_engine_is_compared_by_name_outside_the_registry():
    assert scan(ENGINE_NAMES, is_engine, ("ckpt/registry.py",)) == []


def test_no_device_name_is_compared_as_a_string_outside_devices():
    assert scan(DEVICE_NAMES, lambda code: True, ()) == []
