"""Guard: only devices/ may name hardware. hal/, engines/, ckpt/ and cli/ ask hal instead.

A grep for these patterns outside devices/ must find nothing; this test is the one place allowed to
spell them, because it asserts exactly that.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSUMERS = ("hal", "engines", "ckpt", "cli")
FORBIDDEN = re.compile(r"""torch\.cuda|torch_npu|\.cuda\(|["']nccl["']|["']hccl["']""")


def _code_lines(path: pathlib.Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        yield number, line


@pytest.mark.parametrize("package", CONSUMERS)
def test_no_hardware_names_outside_devices(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for number, line in _code_lines(path):
            if FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "hardware names outside devices/:\n" + "\n".join(offenders)


def test_guard_pattern_catches_what_it_should():
    for bad in ('torch.cuda.synchronize()', 'import torch_npu', 'x.cuda()', 'backend="nccl"', "b = 'hccl'"):
        assert FORBIDDEN.search(bad), bad
    for fine in ("hal.get_torch_device().synchronize()", "backend = spec.dist_backend", "# torch.cuda in a comment"):
        assert not FORBIDDEN.search(fine) or fine.startswith("#"), fine


@pytest.mark.parametrize("package", ("hal", "engines", "ckpt", "devices", "cli"))
def test_no_assert_statements_in_library_code(package):
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / package).rglob("*.py"))
                 for n, line in _code_lines(p) if re.match(r"\s*assert\s", line)]
    assert not offenders, "assert vanishes under python -O; raise instead: " + ", ".join(offenders)
