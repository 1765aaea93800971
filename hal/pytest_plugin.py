"""pytest plugin: run the same tests on every device kind of this machine.

* ``--device cpu,npu-sim`` (or ``HAL_TEST_DEVICES=cpu,npu-sim``) chooses the lanes; by default every
  available kind among npu, cuda, npu-sim and cpu.
* A test that takes the ``device`` fixture is parametrized over those kinds (``test_x[npu-sim]``); a kind
  that was asked for but is unavailable is skipped with the probe's reason, naming what is missing.
* ``@pytest.mark.device("npu-sim", "cuda")`` restricts a test to some kinds.
* ``free_port`` gives a TCP port that is safe under pytest-xdist.

Registered through the ``pytest11`` entry point, so it is active wherever the package is installed.
"""

from __future__ import annotations

import os

import pytest

ENV_VAR = "HAL_TEST_DEVICES"
DEFAULT_LANES = ("npu", "cuda", "npu-sim", "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", action="store", default=None,
                     help=f"comma-separated device kinds to test on (default: ${ENV_VAR} or every available one)")


def pytest_configure(config: pytest.Config) -> None:
    # npu-sim strict mode: a stray call into the CUDA module from project code fails the test (spawned ranks inherit it).
    os.environ.setdefault("HAL_SIM_STRICT", "1")
    config.addinivalue_line("markers", "device(*kinds): run only on these device kinds")
    config.addinivalue_line("markers", "multiprocess: spawns a process group")


def requested_kinds(config: pytest.Config) -> tuple[list[str], bool]:
    """(kinds, explicit): the lanes for this run, and whether the user named them."""
    raw = config.getoption("--device") or os.environ.get(ENV_VAR, "")
    kinds = [k.strip().lower() for k in raw.split(",") if k.strip()]
    return (kinds, True) if kinds else (list(DEFAULT_LANES), False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames:
        return
    import hal

    kinds, explicit = requested_kinds(metafunc.config)
    marker = metafunc.definition.get_closest_marker("device")
    if marker is not None:
        kinds = [k for k in kinds if k in marker.args]
    params = []
    for kind in kinds:
        try:
            state = hal.availability(kind)
            reason = state.reason
        except hal.HalError as exc:
            state, reason = None, str(exc)
        if state:
            params.append(pytest.param(kind, id=kind))
        elif explicit or kind in ("cpu", "npu-sim"):
            params.append(pytest.param(kind, id=kind, marks=pytest.mark.skip(
                reason=f"device kind {kind!r} unavailable: {reason}")))
    if not params:
        params.append(pytest.param(None, id="no-device", marks=pytest.mark.skip(
            reason=f"no requested device kind ({', '.join(kinds) or 'none'}) applies to this test")))
    metafunc.parametrize("device", params)


@pytest.fixture
def free_port() -> int:
    """A free TCP port on 127.0.0.1, distinct across pytest-xdist workers."""
    from hal.testing import free_port as _free_port

    return _free_port()
