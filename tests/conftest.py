"""Shared fixtures. The device lanes (``hal_device``, ``--hal-device``) and ``hal_free_port`` come from the
project's pytest plugin, which is opt-in: this suite enables it here."""

import pytest

import hal

pytest_plugins = ["hal.pytest_plugin"]


@pytest.fixture(autouse=True)
def _fresh_hal_resolution(monkeypatch):
    """Each test starts with no HAL_DEVICE and no cached auto pick (probe results of kinds stay valid)."""
    monkeypatch.delenv("HAL_DEVICE", raising=False)
    hal.device._auto_kind = None
    yield
    hal.device._auto_kind = None
