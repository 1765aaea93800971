"""Issue 30: no module reaches into a private attribute of another object of the project (``lane._send``,
``adapter._staging_target``): an object's private names are its own, and what a sibling needs is a public seam.

Reaches into other libraries' privates are a different matter, kept to their adapter modules and guarded by
``tests/devices/test_torch_compat.py`` (torch's) with the few it allows (``os._exit``, ``sys._getframe``,
checkpoint-engine's and Ray's)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "ckpt", "engines", "devices")
OURS = {*PACKAGES, "tests"}
"""The project's top-level packages: a private name imported from one of them is a reach."""
# Modules whose job is to reach into a foreign library's privates (torch's, checkpoint-engine's): their objects
# are that library's, whatever the attribute's name.
FOREIGN_ADAPTERS = ("devices/torch_compat.py", "ckpt/kimi_library.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(trees: list[ast.AST]) -> set[str]:
    """The private names the project defines: functions, classes, class attributes and ``self._x``/``cls._x``."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                if isinstance(node, ast.ClassDef):
                    own.update(t.id for stmt in node.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                               for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                               if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    return {n for n in own if _private(n)}


def private_reaches(sources: dict[str, str], own: set[str] | None = None) -> list[str]:
    """``file:line: code`` of each read or write of one of the project's private names on an object that is not
    ``self``, ``cls`` or ``super()``. Publishing a function under its own name on a module object the project
    builds (``memory._set_allocator_settings = _set_allocator_settings``, the sim's torch_npu API) is not a
    reach."""
    trees = {rel: ast.parse(text) for rel, text in sources.items()}
    own = own_private_names(list(trees.values())) if own is None else own
    found = []
    for rel, tree in trees.items():
        published = {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Name) for t in node.targets
                     if isinstance(t, ast.Attribute) and t.attr == node.value.id}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in own) or node.attr in published:
                continue
            base = ast.unparse(node.value)
            if base not in ("self", "cls") and not base.startswith("super("):
                found.append(f"{rel}:{node.lineno}: {base}.{node.attr}")
    return found


def private_imports(sources: dict[str, str]) -> list[str]:
    """``file:line: module:name`` of each import of a private name from one of the project's modules
    (``from ckpt.wire import _Meta``); a private module is import-linter's (``[tool.importlinter]``)."""
    found = []
    for rel, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            # ``from . import _mod``: a private module of its own package, which import-linter's contract allows
            if isinstance(node, ast.ImportFrom) and (node.module if node.level else
                                                     (node.module or "").split(".")[0] in OURS):
                found += [f"{rel}:{node.lineno}: {'.' * node.level + (node.module or '')}:{a.name}"
                          for a in node.names if _private(a.name)]
    return found


def test_the_scan_finds_a_private_name_imported_from_a_sibling_module():
    source = ("from ckpt.wire import _Meta, Meta\nfrom . import _helpers\nfrom torch._C import _x\nimport os\n"
              "from .wire import _Meta\n")
    assert private_imports({"m.py": source}) == ["m.py:1: ckpt.wire:_Meta", "m.py:5: .wire:_Meta"]


def test_no_module_imports_a_private_name_of_another():
    sources = {path.relative_to(ROOT).as_posix(): path.read_text()
               for package in OURS for path in sorted((ROOT / package).rglob("*.py"))}
    assert private_imports(sources) == []


def test_the_scan_finds_a_reach_into_a_sibling():
    source = ("class Lane:\n    def _send(self):\n        self._parts = {}\n"
              "    def go(self, lane):\n        self._send(); lane._send(); return lane._parts, os._exit\n"
              "memory._fn = _fn\n")
    assert private_reaches({"m.py": source}) == ["m.py:5: lane._send", "m.py:5: lane._parts"]


def test_no_module_reaches_into_another_objects_private_names():
    sources = {path.relative_to(ROOT).as_posix(): path.read_text()
               for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    own = own_private_names([ast.parse(text) for text in sources.values()])
    ours = {rel: text for rel, text in sources.items() if rel not in FOREIGN_ADAPTERS}
    assert private_reaches(ours, own) == []
