"""Every ``# noqa`` marker names the rules it silences and says why, after them (``# noqa: BLE001 - why``);
``ruff``'s RUF100 (in ``pyproject.toml``) removes those no rule needs."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("devices", "hal", "engines", "ckpt", "tests", "ci", "scripts")
MARKER = re.compile(r"#\s*noqa\b(?P<rest>.*)$", re.IGNORECASE)
JUSTIFIED = re.compile(r"^:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*\s*(-|\(|:)\s*\w+.*\w", re.IGNORECASE)
"""``: CODE[, CODE...]`` then a reason of at least two words, after ``-``, ``(`` or ``:``."""


def unjustified(root: Path, folders: tuple[str, ...] = FOLDERS) -> list[str]:
    """``file:line: text`` of every marker (in a comment, as ruff reads them) without codes or without a
    reason after them."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
                match = MARKER.search(token.string) if token.type == tokenize.COMMENT else None
                if match and not JUSTIFIED.match(match.group("rest").strip()):
                    found.append(f"{path.relative_to(root)}:{token.start[0]}: {match.group(0)}")
    return found


def test_every_noqa_marker_names_its_rules_and_a_reason():
    found = unjustified(ROOT)
    print("\n".join(found))
    assert found == []


@pytest.mark.parametrize("line,ok", [
    ("x = 1  # noqa: BLE001 - every worker's failure is reported, by name", True),
    ("import generate  # noqa: E402  (ci/ is a scripts folder, not a package)", True),
    ("x = 1  # noqa: F401, E402 - imported for its side effect", True),
    ("x = 1  # noqa", False),
    ("x = 1  # noqa: F401", False),
    ("x = 1  # noqa: F401 -", False),
    ("x = 1  # NOQA:E731", False),
])
def test_a_marker_without_rules_or_reason_is_reported(tmp_path, line, ok):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"{line}\n")
    assert unjustified(tmp_path, ("pkg",)) == ([] if ok else [f"pkg/m.py:1: {line[line.index('#'):]}"])
