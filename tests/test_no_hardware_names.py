"""Guards over the library's source: only devices/ names hardware, no ``assert`` in library code, and no
citation of notes that do not ship with it.

The hardware guard reads code, not prose: identifiers (``torch.cuda``, ``x.cuda()``, ``torch_npu``,
``Backend.NCCL``, ``ProcessGroupNCCL``, ``is_nccl_available``), string literals that are a backend or a
device type (``"nccl"``, ``'hccl'``, ``"cuda:0"``) and strings that spell vendor code (a probe run by
``python -c``). Messages may mention NCCL; comments and docstrings may name hardware. This file is the one
place allowed to spell the patterns.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import textwrap
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSUMERS = ("hal", "engines", "ckpt")  # hal includes hal/apps/cli and hal/apps/benchmarks
LIBRARY = ("hal", "engines", "ckpt", "devices")

HARDWARE_NAME = re.compile(r"(?i)nccl|hccl|^cuda$|^torch_npu$")
HARDWARE_TEXT = re.compile(r"torch_npu|torch\.cuda|\.cuda\(")  # in strings: code that would run (a probe)
HARDWARE_LITERAL = re.compile(r"""^[rbuRBU]?(["'])(cuda|nccl|hccl)(:\d+)?\1$""", re.I)


def hardware_names(source: str) -> list[tuple[int, str]]:
    """``(line, token)`` for each hardware name in the code of ``source`` (comments and docstrings skipped)."""
    prose: set[int] = set()  # lines of string statements: docstrings of modules, classes, functions, fields
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    found = []
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)  # Python 3.12 splits f-strings into tokens
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            hit = HARDWARE_NAME.search(tok.string)
        elif tok.type == tokenize.STRING:
            hit = tok.start[0] not in prose and (HARDWARE_LITERAL.match(tok.string) or HARDWARE_TEXT.search(tok.string))
        else:
            hit = tok.type == fstring_middle and HARDWARE_TEXT.search(tok.string)
        if hit:
            found.append((tok.start[0], tok.string))
    return found


def _library_files(packages) -> list[pathlib.Path]:
    return [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]


def test_the_guard_reads_every_consumer_module_including_the_cli_and_benchmarks():
    files = {p.relative_to(ROOT).as_posix() for p in _library_files(CONSUMERS)}
    for expected in ("hal/apps/cli/main.py", "hal/apps/cli/sync.py", "hal/apps/benchmarks/bench_offload.py",
                     "hal/apps/benchmarks/bench_import.py", "engines/fsdp_engine.py", "ckpt/collective.py"):
        assert expected in files, expected


@pytest.mark.parametrize("package", CONSUMERS)
def test_no_hardware_names_outside_devices(package):
    offenders = [f"{path.relative_to(ROOT)}:{line}: {token}" for path in _library_files([package])
                 for line, token in hardware_names(path.read_text())]
    assert not offenders, "hardware names outside devices/ (ask hal or the device spec instead):\n" + "\n".join(offenders)


BAD = {
    "torch.cuda.synchronize()": "cuda",
    "import torch_npu": "torch_npu",
    "x = y.cuda()": "cuda",
    'backend = "nccl"': '"nccl"',
    "b = 'hccl'": "'hccl'",
    'd = torch.device("cuda:1")': '"cuda:1"',
    "if name == dist.Backend.NCCL: pass": "NCCL",
    "b = dist.Backend.HCCL": "HCCL",
    "pg = dist.ProcessGroupNCCL(store, 0, 1)": "ProcessGroupNCCL",
    "ok = dist.is_nccl_available()": "is_nccl_available",
    "probe = \"import sys; print('torch_npu' in sys.modules)\"": "\"import sys; print('torch_npu' in sys.modules)\"",
}


@pytest.mark.parametrize("code", sorted(BAD))
def test_the_guard_flags_hardware_in_code(code):
    assert hardware_names(code + "\n") == [(1, BAD[code])]


def test_the_guard_leaves_comments_docstrings_and_hal_calls_alone():
    fine = textwrap.dedent('''
        """Module doc: torch.cuda, torch_npu, NCCL and "nccl" are fine in prose."""
        import hal  # torch.cuda in a trailing comment
        # backend = "nccl" in a comment line


        def f(spec):
            """Uses ProcessGroupNCCL underneath; ``x.cuda()`` is what this avoids."""
            hal.get_torch_device().synchronize()
            return spec.dist_backend, "the NCCL-free path"
    ''')
    assert hardware_names(fine) == []
    # the same file with one line of code that names hardware is caught, on that line
    assert hardware_names(fine + "torch.cuda.synchronize()\n") == [(11, "cuda")]


def assert_statements(source: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)]


@pytest.mark.parametrize("package", LIBRARY)
def test_no_assert_statements_in_library_code(package):
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in _library_files([package]) for n in assert_statements(p.read_text())]
    assert not offenders, "assert vanishes under python -O; raise instead: " + ", ".join(offenders)


def test_the_assert_check_finds_nested_asserts_only():
    assert assert_statements("def f(x):\n    if x:\n        assert x > 0, 'x'\n    # assert in a comment\n") == [3]


UNSHIPPED = re.compile(r"DESIGN\.md|BASELINES\.md")


def test_shipped_text_cites_no_unshipped_notes():
    # readers of the package and its repository cannot open the team's notes, so nothing may point at them
    shipped = _library_files(LIBRARY) + [ROOT / "README.md", ROOT / "pyproject.toml"]
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in shipped
                 for n, line in enumerate(p.read_text().splitlines(), 1) if UNSHIPPED.search(line)]
    assert not offenders, "cite public sources, not unshipped notes: " + ", ".join(offenders)
