"""Shared fixtures. The device lanes and ``free_port`` come from the project's pytest plugin
(``hal.pytest_plugin``, registered by the package's ``pytest11`` entry point)."""

import pytest

import hal


@pytest.fixture(autouse=True)
def _fresh_hal_resolution(monkeypatch):
    """Each test starts with no HAL_DEVICE and no cached auto pick (probe results of kinds stay valid)."""
    monkeypatch.delenv("HAL_DEVICE", raising=False)
    hal.device._auto_kind = None
    yield
    hal.device._auto_kind = None
