"""Benchmarks: each prints ratios measured side by side in one run (the machine is shared and noisy)."""

from __future__ import annotations

from typing import Any, Callable


def emit(result: dict[str, Any], as_json: bool, print_table: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The end of a benchmark's ``main``: print ``result`` as indented JSON on stdout when ``as_json``, else
    as ``print_table(result)`` draws it; returns ``result``."""
    if as_json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return result
