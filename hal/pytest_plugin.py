"""pytest plugin: run the same tests on every device kind of this machine.

Opt-in: ``pytest_plugins = ["hal.pytest_plugin"]`` or ``-p hal.pytest_plugin``. ``--hal-device cpu,npu-sim``
(or ``HAL_TEST_DEVICES``) picks the lanes, by default every available kind; the ``hal_device`` fixture
parametrizes a test over them and ``@pytest.mark.hal_device(...)`` restricts it. A kind named but unavailable
fails the run. ``hal_store`` hosts a ``TCPStore`` on a kernel-picked port. npu-sim's strict mode
(``HAL_SIM_STRICT=1``) is on while enabled.
"""

from __future__ import annotations

import os

import pytest

from devices import BUILTIN_KINDS

ENV_VAR = "HAL_TEST_DEVICES"
DEFAULT_LANES = tuple(BUILTIN_KINDS)  # the built-in kinds, in resolution order
ALWAYS_LISTED = ("npu-sim", "cpu")  # default lanes reported as skipped (not silently dropped) when unavailable
PREV_STRICT = pytest.StashKey[str | None]()  # HAL_SIM_STRICT before the plugin set it, restored at unconfigure


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--hal-device", action="store", default=None,
                     help=f"comma-separated hal device kinds to test on (default: ${ENV_VAR} or every available one)")


def requested_kinds(config: pytest.Config) -> tuple[list[str], bool]:
    """Return the lanes for this run and whether the user named them."""
    raw = config.getoption("--hal-device") or os.environ.get(ENV_VAR, "")
    kinds = [k.strip().lower() for k in raw.split(",") if k.strip()]
    return (kinds, True) if kinds else (list(DEFAULT_LANES), False)


def _probe(kind: str) -> str | None:
    """Return ``None`` when ``kind`` is available here, else the reason it is not."""
    import hal

    try:
        state = hal.availability(kind)
    except hal.HalError as exc:
        return str(exc)
    return None if state else state.reason


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hal_device(*kinds): run only on these hal device kinds")
    config.addinivalue_line("markers", "multiprocess: spawns a process group")
    # Set only while the plugin is enabled; the previous value comes back at unconfigure.
    config.stash[PREV_STRICT] = os.environ.get("HAL_SIM_STRICT")
    os.environ["HAL_SIM_STRICT"] = os.environ.get("HAL_SIM_STRICT", "1")
    kinds, explicit = requested_kinds(config)
    if explicit:
        missing = {kind: reason for kind in kinds if (reason := _probe(kind)) is not None}
        if missing:
            detail = "; ".join(f"{kind!r}: {reason}" for kind, reason in missing.items())
            raise pytest.UsageError(f"requested hal device kind(s) cannot be tested here: {detail}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if PREV_STRICT not in config.stash:
        return
    prev = config.stash[PREV_STRICT]
    if prev is None:
        os.environ.pop("HAL_SIM_STRICT", None)
    else:
        os.environ["HAL_SIM_STRICT"] = prev


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hal_device" not in metafunc.fixturenames:
        return
    kinds, explicit = requested_kinds(metafunc.config)
    marker = metafunc.definition.get_closest_marker("hal_device")
    if marker is not None:
        kinds = [k for k in kinds if k in marker.args]
    params = []
    for kind in kinds:
        reason = _probe(kind)
        if reason is None:
            params.append(pytest.param(kind, id=kind))
        elif explicit or kind in ALWAYS_LISTED:
            params.append(pytest.param(kind, id=kind, marks=pytest.mark.skip(
                reason=f"device kind {kind!r} unavailable: {reason}")))
    if not params:
        params.append(pytest.param(None, id="no-device", marks=pytest.mark.skip(
            reason=f"no requested device kind ({', '.join(kinds) or 'none'}) applies to this test")))
    metafunc.parametrize("hal_device", params)


@pytest.fixture
def hal_store():
    """Host a ``TCPStore`` on 127.0.0.1 at a kernel-picked ``hal_store.port`` for the test.

    Other processes join with ``hal.connect_store("127.0.0.1", port, rank, world_size, is_master=False)``.
    """
    import hal

    return hal.connect_store("127.0.0.1", 0, 0, 1, timeout=60, is_master=True)
