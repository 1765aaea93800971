"""The Ray clusters of these tests: one ``LocalCluster`` head shared by every test that needs a one-node cluster
(own ports, temp dir, token; started once per test process, stopped when its folder's tests are done), this process its driver.

Ray tests are skipped when ray is not installed (it is an optional extra that setup.sh installs).
"""

from __future__ import annotations

import contextlib

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hal-posttrain[ray]')")

_driver_of: list = [None]  # the LocalCluster this process's Ray driver is connected to


def connect_driver(cluster) -> None:
    """Make ``cluster`` the one this process's driver talks to (disconnecting from another first)."""
    if _driver_of[0] is not cluster:
        ray.shutdown()
        _driver_of[0] = None
        cluster.connect()
        _driver_of[0] = cluster


def disconnect_driver() -> None:
    ray.shutdown()
    _driver_of[0] = None


@contextlib.contextmanager
def ray_cluster(**kwargs):
    """Start a head node with ``kwargs`` (see LocalCluster), connect this process, and tear both down."""
    from hal.ray import LocalCluster

    cluster = LocalCluster(**kwargs)
    cluster.start()
    try:
        connect_driver(cluster)
        yield cluster
    finally:
        if _driver_of[0] is cluster:
            disconnect_driver()
        cluster.stop()
        assert cluster.pids() == []


@pytest.fixture(scope="package")  # stopped after this folder's tests: an idle cluster still costs CPU
def _one_node():
    # 4 CPUs, 3 simulated npus, 2 declared Ascend NPUs and 2 GPUs (no hardware: only Ray's bookkeeping and env)
    with ray_cluster(num_cpus=4, resources={"NPU_SIM": 3, "NPU": 2, "GPU": 2}) as c:
        yield c


@pytest.fixture
def cluster(_one_node):
    """The shared one-node cluster, this process's driver connected to it."""
    connect_driver(_one_node)
    yield _one_node
