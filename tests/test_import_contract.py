"""The import contract (DESIGN.md's layers) is import-linter's ``[tool.importlinter]`` in ``pyproject.toml``;
this module runs it on the tree and shows each contract failing on a small tree with one breach.

What import-linter has no contract for is checked here on the same grimp graph: a test module importing another
test module, and an import circle through a package and one of its own modules (``acyclic_siblings`` sees
siblings only). A private *name* imported from another module (``from x import _y``) is
``tests/test_private_reaches.py``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("devices", "hal", "engines", "ckpt", "tests")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` run in ``root`` (its ``pyproject.toml``, its packages first on the path)."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=root, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(root), "PATH": "", "NO_COLOR": "1", "COLUMNS": "200"})


def test_the_tree_keeps_the_import_contract():
    run = lint_imports(ROOT)
    print(run.stdout, run.stderr)
    assert run.returncode == 0
    assert "Contracts: 10 kept, 0 broken." in run.stdout


GRAPH_CHECKS = """
import json, sys
import grimp
graph = grimp.build_graph(*sys.argv[1:], cache_dir=None)
imports = [(m, t) for m in sorted(graph.modules) for t in sorted(graph.find_modules_directly_imported_by(m)) if t != m]
is_test = lambda name: name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")
print(json.dumps({
    "circles": sorted({tuple(sorted((m, t))) for m, t in imports if graph.chain_exists(importer=t, imported=m)}),
    "test_imports": [[m, t] for m, t in imports if is_test(m) and is_test(t)],
}))
"""


def graph_checks(root: Path) -> dict[str, list[list[str]]]:
    """On grimp's graph of the packages under ``root`` (in a fresh interpreter, ``root`` first on the path):
    ``circles``, each pair of modules that import each other, directly or through others (a module with the
    first module it imports that leads back to it); ``test_imports``, each test module importing another."""
    run = subprocess.run([sys.executable, "-c", GRAPH_CHECKS, *PACKAGES], cwd=root, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(root), "PATH": ""})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_no_import_circle_and_no_test_module_imports_another():
    """A test module imports only helper modules, so running one test file never runs another's module body."""
    assert graph_checks(ROOT) == {"circles": [], "test_imports": []}


def test_a_circle_through_a_package_and_its_own_module_is_found(tmp_path):
    tree = CLEAN | {"hal/__init__.py": "from hal import device\n",
                    "hal/device.py": "import hal\nfrom devices import cpu\n"}
    assert graph_checks(write_tree(tmp_path, tree))["circles"] == [["hal", "hal.device"]]


def test_a_test_module_importing_another_is_found(tmp_path):
    tree = CLEAN | {"tests/test_y.py": "from tests.test_x import case\n"}
    assert graph_checks(write_tree(tmp_path, tree))["test_imports"] == [["tests.test_y", "tests.test_x"]]


# -- each contract fails on a deliberate breach -----------------------------------------------------------

CLEAN = {
    "devices/cpu.py": "import torch\n",
    "devices/npu_sim/__init__.py": "import torch\n",
    "hal/device.py": "from devices import cpu\n",
    "hal/apps/cli/main.py": "import engines\nimport engines.base\nimport ckpt\nimport ckpt.base\n"
                            "from hal.apps.benchmarks import bench\n",
    "hal/apps/benchmarks/bench.py": "import hal\nimport engines\n",
    "hal/apps/benchmarks/job.py": "def run():\n    from hal.apps.weightsync import loop\n",
    "hal/apps/weightsync/loop.py": "import ckpt\nfrom hal.apps import errors\n",
    "hal/apps/errors.py": "",
    "hal/apps/__init__.py": "import engines\n",
    "engines/base.py": "import hal\nfrom hal.device import resolve\n",
    "ckpt/base.py": "from hal import device\nfrom . import registry\n",
    "ckpt/registry.py": "",
    "ckpt/_wire.py": "",
    "tests/test_x.py": "from tests.helpers import fixture\nfrom hal.device import __doc__\n",
    "tests/helpers.py": "",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """The five packages with this repository's ``[tool.importlinter]``; every module empty but ``files``."""
    packages = {f"{p}/__init__.py": "" for p in (*PACKAGES, "hal/apps", "hal/apps/cli", "hal/apps/benchmarks",
                                                 "hal/apps/weightsync")}
    for rel, text in (packages | files).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (root / "pyproject.toml").write_text(toml({"tool": {"importlinter": config}}))
    return root


def toml(table: dict, prefix: str = "") -> str:
    """The few TOML shapes ``[tool.importlinter]`` uses (strings, booleans, lists, arrays of tables)."""
    def value(v):
        return "true" if v is True else "false" if v is False else repr(v) if isinstance(v, str) else \
            "[" + ", ".join(value(x) for x in v) + "]"
    lines, nested = [], []
    for key, v in table.items():
        if isinstance(v, dict):
            nested.append(f"\n[{prefix}{key}]\n" + toml(v, f"{prefix}{key}."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            nested += [f"\n[[{prefix}{key}]]\n" + toml(item) for item in v]
        else:
            lines.append(f"{key} = {value(v)}")
    return "\n".join(lines) + "\n" + "".join(nested)


def test_a_tree_that_keeps_the_contract_passes(tmp_path):
    run = lint_imports(write_tree(tmp_path, CLEAN))
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path,text,contract,chain", [
    ("devices/cpu.py", "def f():\n    import hal\n", "devices knows hardware", "devices.cpu -> hal"),
    ("devices/cpu.py", "from engines import base\n", "devices knows hardware", "devices.cpu -> engines.base"),
    ("devices/cpu.py", "from devices.npu_sim import x\n", "knows no simulator", "devices.cpu -> devices.npu_sim"),
    ("hal/device.py", "import ckpt.base\n", "hal's API imports only devices", "hal.device -> ckpt.base"),
    ("hal/device.py", "from hal.apps.cli import main\n", "hal's API imports only devices",
     "hal.device -> hal.apps.cli.main"),
    ("hal/__init__.py", "import engines\n", "hal's package module imports only devices", "hal -> engines"),
    ("hal/__init__.py", "from hal.apps import cli\n", "hal's package module imports only devices",
     "hal -> hal.apps.cli"),
    ("devices/__init__.py", "from devices.npu_sim import x\n", "the devices package module knows no simulator",
     "devices -> devices.npu_sim"),
    ("engines/base.py", "from devices import cpu\n", "engines and ckpt ask hal", "engines.base -> devices.cpu"),
    ("engines/base.py", "import ckpt\n", "engines and ckpt ask hal", "engines.base -> ckpt"),
    ("ckpt/base.py", "from engines.base import X\n", "engines and ckpt ask hal", "ckpt.base -> engines.base"),
    ("ckpt/base.py", "from hal.apps import cli\n", "engines and ckpt ask hal", "ckpt.base -> hal.apps.cli"),
    ("hal/apps/weightsync/loop.py", "from hal.apps.benchmarks import bench\n", "the weight-sync job is a library",
     "hal.apps.weightsync.loop -> hal.apps.benchmarks.bench"),
    ("hal/apps/benchmarks/bench.py", "from hal.apps.cli.main import x\n", "the benchmarks run on library code",
     "hal.apps.benchmarks.bench -> hal.apps.cli.main"),
    ("tests/test_x.py", "from ckpt._wire import Meta\n", "private module", "tests.test_x -> ckpt._wire"),
    ("ckpt/registry.py", "def load():\n    from ckpt.base import X\n", "no import circle", ".registry -> .base"),
])
def test_each_breach_breaks_its_contract_naming_the_import(tmp_path, path, text, contract, chain):
    run = lint_imports(write_tree(tmp_path, CLEAN | {path: text}))
    assert run.returncode == 1, run.stdout + run.stderr
    broken = broken_contracts(run.stdout)
    named = [name for name in broken if contract in name]
    assert len(named) == 1 and chain in broken[named[0]], run.stdout


def broken_contracts(report: str) -> dict[str, str]:
    """``lint-imports``' report section "Broken contracts": ``{contract name: its text}``."""
    lines = report.split("Broken contracts", 1)[1].splitlines()
    heads = [i - 1 for i, line in enumerate(lines) if i > 1 and line and set(line) == {"-"} and lines[i - 1]]
    return {lines[h]: "\n".join(lines[h + 2:end]) for h, end in zip(heads, [*heads[1:], len(lines)])}
