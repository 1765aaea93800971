"""The torch_npu names hal's sim is checked against: ``devices/npu_api_names.txt`` (module-level names of
``torch_npu/npu/__init__.py`` in the torch-npu 2.14.0 wheel, extracted by ``scripts/extract_npu_api.py``)."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
LIST = REPO / "devices" / "npu_api_names.txt"


def real_names() -> set[str]:
    """Every name of the committed list (comment lines skipped)."""
    return {line.strip() for line in LIST.read_text().splitlines() if line.strip() and not line.startswith("#")}
