"""Shared fixtures. The device lanes (``hal_device``, ``--hal-device``) and ``hal_store`` come from the
project's pytest plugin, which is opt-in: this suite enables it here."""

import os

import pytest

import hal

pytest_plugins = ["hal.pytest_plugin", "pytester"]  # pytester: tests/hal/test_pytest_plugin.py runs pytest in-process


@pytest.fixture(autouse=True)
def _fresh_hal_resolution(monkeypatch):
    """Each test starts with no HAL_DEVICE and no cached auto pick (probe results of kinds stay valid)."""
    monkeypatch.delenv("HAL_DEVICE", raising=False)
    hal.device._auto_kind = None
    yield
    hal.device._auto_kind = None


@pytest.fixture(autouse=True)
def _sim_current_device_restored():
    """A test that builds engines for ``npu-sim:1`` in this process leaves npu:1 current (an engine binds its
    device on the calling thread); later tests in the same worker expect torch's default, device 0."""
    yield
    spec = hal.registry.get_spec("npu-sim")
    if spec.is_set_up():
        spec.torch_module().set_device(0)


# -- pytest-xdist: the longest tests start first, and tests sharing an expensive fixture share a worker -------

def _declared_cost(item: pytest.Item) -> tuple[float, int]:
    """What a test declares about its length: its timeout above the default, then a multi-process marker."""
    mark = item.get_closest_marker("timeout")
    timeout = float(mark.args[0]) if mark is not None and mark.args else 0.0
    heavy = item.get_closest_marker("multiprocess") is not None or item.get_closest_marker("interop") is not None
    return timeout, int(heavy)


def _shared_scope(item: pytest.Item) -> str | None:
    """The group of tests that share an instance of a fixture ``item`` uses: its module for a module-scoped
    fixture of this suite, the fixture's directory for a package- or session-scoped one; None if none."""
    group = None
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            if not fixturedef.baseid or fixturedef.scope in ("function", "class"):
                continue  # pytest's and plugins' own fixtures (baseid "") are cheap or per test
            if fixturedef.scope == "module":
                group = group or item.module.__name__
            else:
                return fixturedef.baseid
    return group


def pytest_itemcollected(item: pytest.Item) -> None:
    """The fast lane (``-m "not slow"``) leaves out what starts a rank group or drives another framework
    (a multiprocess or interop marker) and what declares a timeout above the default, besides the tests
    marked ``slow`` (the longest of the rest, from ``--durations``); here, before ``-m`` selects."""
    timeout, heavy = _declared_cost(item)
    if heavy or timeout > float(item.config.getini("timeout") or 0):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order whole modules by the longest test they declare (a timeout above the default, then a
    multiprocess or interop marker), longest first, keeping each module's own order, so pytest-xdist
    starts the long tests while short ones fill the gaps instead of one worker finishing a long test alone;
    and put tests that share a module/session fixture (a Ray cluster, an FSDP run) in one ``xdist_group``,
    so the fixture is built once rather than on each worker."""
    cost: dict[str, tuple[float, int]] = {}
    xdist = config.pluginmanager.hasplugin("xdist")  # without it (-p no:xdist) the mark is unknown: a warning
    for item in items:
        module = item.nodeid.split("::")[0]
        cost[module] = max(cost.get(module, (0.0, 0)), _declared_cost(item))
        group = _shared_scope(item) if xdist else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    first_seen = {module: i for i, module in reversed(list(enumerate(i.nodeid.split("::")[0] for i in items)))}
    items.sort(key=lambda i: (tuple(-c for c in cost[i.nodeid.split("::")[0]]), first_seen[i.nodeid.split("::")[0]]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n`` without ``--dist`` (or ``--dist load``) schedules as ``--dist loadgroup`` in the order above
    (tests without a group are scheduled one by one, as with ``load``)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadGroupScheduling

    config.option.loadscopereorder = False  # keep the longest-first order instead of largest group first
    return LoadGroupScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` starts one worker more than the cores this process may use (pytest-xdist's own choice is one
    per core). The suite's rank groups spend part of their time waiting (on peers, sockets, deadlines, a
    library's shutdown): with one worker per core the 2 cores of this project's machines stood idle 20% of a
    run (vmstat), and the suite took 331 s; with three workers, 12% and 299 s. ``PYTEST_XDIST_AUTO_NUM_WORKERS``,
    where set, still decides (pytest-xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1
