"""The import contract of issue 19, read from the source with ``ast`` (every import, function-level ones too).

Layers, imports pointing down only:

* ``devices``: hardware knowledge; imports nothing from ``hal``, ``engines`` or ``ckpt``, and outside
  ``devices.npu_sim`` nothing from the simulator (the registry names it as a string);
* ``hal`` (every module outside ``hal.apps``): the API; imports nothing from ``engines``, ``ckpt``, ``hal.apps``;
* ``engines``, ``ckpt``: consumers of the API; nothing from ``hal.apps``, nothing from ``devices`` (they ask
  ``hal``), and not each other;
* ``hal.apps``: applications, may import anything; its benchmarks import nothing from its command line
  (``hal.apps.cli``) but through the one call into the weight-sync job (``hal.apps.benchmarks.job``).

Also: no import circle between modules; no module imports a private name (``from x import _y``) or a
private module (``import x._y``, ``from tests.ckpt import _mp``) of another module of this repository (a
third-party library's private names are each package's own review: torch's go to ``devices.torch_compat``);
and no test module (``test_*.py``) imports another test module (shared test code lives in helper modules).

Each rule is shown to fail on a small package written to a temporary directory with one breach.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("devices", "hal", "engines", "ckpt", "tests")
"""The top-level packages whose modules are read (the repository's own; ``.venv`` and build folders are not)."""

FORBIDDEN = {
    "devices": ({"hal", "hal.apps", "engines", "ckpt", "devices.npu_sim"},
                "devices knows hardware and imports nothing above it; a real kind knows no simulator (issue 30: "
                "it tells the sim's stand-in module by devices.base.SIMULATION_MARKER; the registry names "
                "devices.npu_sim as a string)"),
    "devices.npu_sim": ({"hal", "hal.apps", "engines", "ckpt"}, "the simulated npu is a device kind like the others"),
    "hal": ({"engines", "ckpt", "hal.apps"}, "hal's API imports only devices"),
    "engines": ({"hal.apps", "devices", "ckpt"}, "engines asks hal (not devices), never hal.apps or ckpt"),
    "ckpt": ({"hal.apps", "devices", "engines"}, "ckpt asks hal (not devices), never hal.apps or engines"),
    "hal.apps.weightsync": ({"hal.apps.cli", "hal.apps.benchmarks"},
                            "the weight-sync job is a library: the command line and the benchmarks run it"),
    "hal.apps.benchmarks": ({"hal.apps.cli"}, "the benchmarks run on library code (the job, the engines), not the CLI"),
}
"""Layer -> (the layers it must not import, why)."""

LAYERS = ("devices", "devices.npu_sim", "hal", "hal.apps", "hal.apps.weightsync", "hal.apps.benchmarks", "engines", "ckpt")


def layer(module: str) -> str | None:
    """The layer of a dotted module name: the longest prefix in :data:`LAYERS` (``None``: outside them)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def in_layer(module: str, target_layer: str) -> bool:
    return module == target_layer or module.startswith(target_layer + ".")


@dataclass(frozen=True)
class Import:
    """One imported name: ``module`` (absolute, dotted), ``name`` (``None`` for ``import module``), where."""

    module: str
    name: str | None
    path: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: ``{dotted name: file}``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def imports_of(root: Path, name: str, path: Path) -> list[Import]:
    """Every import statement of a module, at any depth (functions, ``if TYPE_CHECKING``, ``try``)."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = str(path.relative_to(root))
        if isinstance(node, ast.Import):
            out += [Import(a.name, None, where, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            out += [Import(base, a.name, where, node.lineno) for a in node.names]
    return out


def target(imp: Import, modules: dict[str, Path]) -> str:
    """The module an import runs: ``module.name`` when that is a module, else ``module``."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    return imp.module


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def is_test(module: str) -> bool:
    return module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # recursive; the module graph is a few hundred nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every breach of the contract in ``packages`` under ``root``, one line each (file:line, what, why)."""
    modules = read_modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    found = []
    for name, path in modules.items():
        own = layer(name)
        for imp in imports_of(root, name, path):
            to = target(imp, modules)
            shown = imp.module + (f" ({imp.name})" if imp.name else "")
            if to in modules and to != name:
                graph[name].add(to)
            forbidden, why = FORBIDDEN.get(own, (set(), ""))
            hit = [f for f in forbidden if in_layer(to, f)]
            if hit:
                found.append(f"{imp.path}:{imp.line}: layers: {name} imports {shown}: {why}")
            names = [p for p in imp.module.split(".") if p] + ([imp.name] if imp.name else [])
            if names[0] in packages and any(is_private(p) for p in names):
                found.append(f"{imp.path}:{imp.line}: private: {name} imports {shown}: a private name of another "
                             "module")
            if is_test(name) and is_test(to) and to != name:
                found.append(f"{imp.path}:{imp.line}: tests: {name} imports {shown}: a test module imports no "
                             "other test module")
    found += [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return sorted(set(found))


# -- the real tree ----------------------------------------------------------------------------------------

def test_the_tree_keeps_the_import_contract():
    found = violations(ROOT)
    print("\n".join(found))
    assert found == []


def test_the_checker_reads_every_package_and_function_level_imports():
    modules = read_modules(ROOT, PACKAGES)
    assert {"devices", "hal", "hal.apps.cli.bench", "engines", "ckpt.collective", "tests.test_layers"} <= set(modules)
    bench = imports_of(ROOT, "hal.apps.cli.bench", modules["hal.apps.cli.bench"])
    # imported inside print_tables, not at the top
    assert ("hal.apps.benchmarks", "bench_offload") in {(i.module, i.name) for i in bench}


# -- each rule fails on a deliberate breach ---------------------------------------------------------------

def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A small tree of the five packages, every module empty but those in ``files``."""
    base = {f"{p}/__init__.py": "" for p in PACKAGES} | {"hal/apps/__init__.py": "", "hal/apps/cli/__init__.py": "",
                                                         "hal/apps/benchmarks/__init__.py": "",
                                                         "hal/apps/weightsync/__init__.py": ""}
    for rel, text in (base | files).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


CLEAN = {
    "devices/cpu.py": "import torch\n",
    "hal/device.py": "from devices import cpu\n",
    "hal/apps/cli/main.py": "import engines\nimport ckpt\nfrom hal.apps.benchmarks import bench\n",
    "hal/apps/benchmarks/bench.py": "import hal\nimport engines\n",
    "hal/apps/benchmarks/job.py": "def run():\n    from hal.apps.weightsync import loop\n",
    "hal/apps/weightsync/loop.py": "import ckpt\nfrom hal.apps import errors\n",
    "engines/base.py": "import hal\nfrom hal.device import resolve\n",
    "ckpt/base.py": "from hal import device\nfrom . import registry\n",
    "ckpt/registry.py": "",
    "tests/test_x.py": "from tests.helpers import fixture\nfrom hal.device import __doc__\n",
    "tests/helpers.py": "",
}


def test_a_tree_that_keeps_the_contract_has_no_violations(tmp_path):
    assert violations(write_tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("path,text,expected", [  # expected: "line: rule: what"
    ("devices/cpu.py", "def f():\n    import hal\n", "2: layers: devices.cpu imports hal"),
    ("devices/cpu.py", "from engines import base\n", "1: layers: devices.cpu imports engines (base)"),
    ("hal/device.py", "import ckpt.base\n", "1: layers: hal.device imports ckpt.base"),
    ("hal/device.py", "from hal.apps.cli import main\n", "1: layers: hal.device imports hal.apps.cli (main)"),
    ("engines/base.py", "from devices import cpu\n", "1: layers: engines.base imports devices (cpu)"),
    ("engines/base.py", "import ckpt\n", "1: layers: engines.base imports ckpt"),
    ("ckpt/base.py", "from engines.base import X\n", "1: layers: ckpt.base imports engines.base (X)"),
    ("ckpt/base.py", "from hal.apps import cli\n", "1: layers: ckpt.base imports hal.apps (cli)"),
    ("hal/apps/benchmarks/bench.py", "from hal.apps.cli.main import x\n",
     "1: layers: hal.apps.benchmarks.bench imports hal.apps.cli.main (x)"),
    ("tests/test_x.py", "from tests.helpers import _fixture\n",
     "1: private: tests.test_x imports tests.helpers (_fixture)"),
    ("tests/test_x.py", "from tests import _helpers\n", "1: private: tests.test_x imports tests (_helpers)"),
    ("tests/test_x.py", "import hal._private.x\n", "1: private: tests.test_x imports hal._private.x"),
    ("ckpt/base.py", "from ._wire import Meta\n", "1: private: ckpt.base imports ckpt._wire (Meta)"),
    ("tests/test_y.py", "from tests.test_x import case\n", "1: tests: tests.test_y imports tests.test_x (case)"),
])
def test_each_breach_is_reported_naming_file_line_and_import(tmp_path, path, text, expected):
    found = [f for f in violations(write_tree(tmp_path, CLEAN | {path: text})) if not f.startswith("cycle:")]
    assert len(found) == 1 and found[0].startswith(f"{path}:{expected}:"), found  # (a circle it closes is reported too)


def test_an_import_circle_is_reported_even_through_a_function_level_import(tmp_path):
    tree = CLEAN | {"ckpt/registry.py": "def load():\n    from ckpt.base import X\n"}  # base imports registry
    assert violations(write_tree(tmp_path, tree)) == ["cycle: ckpt.base -> ckpt.registry"]
    three = CLEAN | {"tests/helpers.py": "import tests.more\n", "tests/more.py": "from tests import test_x\n"}
    assert violations(write_tree(tmp_path / "b", three)) == ["cycle: tests.helpers -> tests.more -> tests.test_x"]
