"""Issue 30: the job's calls on its workers name the method itself (``Trainer.train``, ``RawMember.host``), not
a string (``"train"``, ``"raw.host"``), so a reader, or a tool, follows each call to the code that runs. At run
time a string is refused (:func:`ckpt.manager.method_class`); this scan also covers paths no test runs."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "ckpt", "engines")
METHOD_ARG = {"call": 1, "submit": 1, "invoke": 0, "on_trainers": 0, "Call": 0}
"""The calls that carry a worker method, and which positional argument is the method."""


def calls_by_string(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each call of :data:`METHOD_ARG` whose method argument is a string literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        position = METHOD_ARG.get(name)
        if position is None:
            continue
        given = [node.args[position]] if len(node.args) > position else []
        given += [k.value for k in node.keywords if k.arg == "method"]
        if any(isinstance(arg, ast.Constant) and isinstance(arg.value, str) for arg in given):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_scan_finds_a_method_named_by_a_string():
    source = ('await manager.call([0], "raw.host")\nawait manager.call([0], RawMember.host)\n'
              'group.submit(1, "update_weights", 1)\nworker.invoke("where")\nCall("stop")\nstore.call("clone")\n'
              'await manager.call([0], method="raw.join")\n')
    assert calls_by_string(source) == [(1, "manager.call([0], 'raw.host')"),
                                       (3, "group.submit(1, 'update_weights', 1)"), (4, "worker.invoke('where')"),
                                       (5, "Call('stop')"), (7, "manager.call([0], method='raw.join')")]


def test_no_worker_method_is_named_by_a_string():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{line}: {code}" for line, code in calls_by_string(path.read_text())]
    assert found == []
