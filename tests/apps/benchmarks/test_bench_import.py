"""The import-cost benchmark: medians of what its fresh interpreters report, and ``import hal`` imports
no vendor package even where one is installed."""

from __future__ import annotations

import os
import subprocess

import pytest

from hal.apps.benchmarks import bench_import


def test_run_takes_medians_of_the_rounds_and_flags_any_vendor_import(monkeypatch):
    printed = iter(["3.0 0.30 False", "1.0 0.10 False", "2.0 0.50 True"])
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=next(printed) + "\n", stderr="")

    monkeypatch.setattr(bench_import.subprocess, "run", fake_run)
    result = bench_import.run(rounds=3)
    assert (result["torch_s"], result["hal_s"], result["rounds"], result["imports_vendor"]) == (2.0, 0.30, 3, True)
    assert result["ratio"] == pytest.approx(2.3 / 2.0)
    assert len(calls) == 3 and calls[0][-len(bench_import.vendor_modules()):] == bench_import.vendor_modules()


def _fake_vendor(root, import_at_startup: bool) -> dict[str, str]:
    """An environment whose path holds a stand-in vendor package (and optionally imports it at start-up)."""
    for name in bench_import.vendor_modules():
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("")
        if import_at_startup:
            (root / "sitecustomize.py").write_text(f"import {name}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_DEVICE", "HAL_SIM_STRICT")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_import_hal_leaves_an_installed_vendor_package_alone(tmp_path):
    result = bench_import.run(rounds=1, env=_fake_vendor(tmp_path, import_at_startup=False))
    assert result["imports_vendor"] is False
    assert result["torch_s"] > 0 and result["hal_s"] > 0


def test_the_probe_sees_a_vendor_package_that_was_imported(tmp_path):
    # the control for the test above: the same stand-in, imported before hal, is reported
    assert bench_import.run(rounds=1, env=_fake_vendor(tmp_path, import_at_startup=True))["imports_vendor"] is True
