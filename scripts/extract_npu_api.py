"""Extract the public Python API names of ``torch_npu.npu`` from a torch-npu wheel, without importing it.

The wheel is read with ``zipfile`` and ``torch_npu/npu/__init__.py`` parsed with ``ast``: the names are
its ``__all__`` plus every public name bound at module level (``def``, ``class``, assignments, imports),
since ``torch.npu`` is that module. Nothing from the wheel is executed or installed.

Usage (the committed list was made this way)::

    pip download --no-deps -d /tmp/npuwheel torch-npu==2.14.0 \\
        --platform manylinux_2_28_x86_64 --only-binary=:all: --python-version 3.11
    python scripts/extract_npu_api.py /tmp/npuwheel/torch_npu-2.14.0-*.whl -o devices/npu_api_names.txt

Output: a header of ``#`` lines (wheel file name, version, sha256, source path) then one name a line,
sorted.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import pathlib
import sys
import zipfile

MODULE_PATH = "torch_npu/npu/__init__.py"


def _literal_strings(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    return []


def public_names(source: str) -> set[str]:
    """``__all__`` (literal lists, ``=`` and ``+=``/``.extend``) plus public module-level bindings of ``source``."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    names.update(_literal_strings(node.value))
                else:
                    names.update(_targets(target))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == "__all__":
            names.update(_literal_strings(node.value))
        elif isinstance(node, ast.AnnAssign):
            names.update(_targets(node.target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names.add((alias.asname or alias.name).split(".")[0])
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "extend"
              and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "__all__"):
            for arg in node.value.args:
                names.update(_literal_strings(arg))
    return {n for n in names if not n.startswith("_")}


def wheel_version(zf: zipfile.ZipFile) -> str:
    """The ``Version:`` field of the wheel's ``*.dist-info/METADATA``.

    Raises:
        ValueError: the wheel has no METADATA with a version.
    """
    for name in zf.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in zf.read(name).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    raise ValueError("no *.dist-info/METADATA with a Version field in the wheel")


def extract(wheel: pathlib.Path) -> tuple[str, list[str]]:
    """(version, sorted public names) of ``torch_npu.npu`` in ``wheel``.

    Raises:
        ValueError: ``wheel`` has no ``torch_npu/npu/__init__.py``.
    """
    with zipfile.ZipFile(wheel) as zf:
        if MODULE_PATH not in zf.namelist():
            raise ValueError(f"{wheel} has no {MODULE_PATH}; is it a torch-npu wheel?")
        source = zf.read(MODULE_PATH).decode("utf-8")
        return wheel_version(zf), sorted(public_names(source))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=pathlib.Path, help="a torch_npu-*.whl file")
    parser.add_argument("-o", "--output", type=pathlib.Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    version, names = extract(args.wheel)
    digest = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    text = "".join([
        "# Public names of torch_npu.npu (torch.npu), extracted by scripts/extract_npu_api.py\n",
        f"# wheel: {args.wheel.name}\n",
        f"# version: {version}\n",
        f"# sha256: {digest}\n",
        f"# source: {MODULE_PATH} (__all__ + public module-level bindings)\n",
    ] + [f"{n}\n" for n in names])
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
