"""A Ray cluster per test module: one ``LocalCluster`` head (own ports, temp dir, token), this process its driver.

Ray tests are skipped when ray is not installed (it is an optional extra that setup.sh installs).
"""

from __future__ import annotations

import contextlib

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hal-posttrain[ray]')")


@contextlib.contextmanager
def ray_cluster(**kwargs):
    """Start a head node with ``kwargs`` (see LocalCluster), connect this process, and tear both down."""
    from hal.ray import LocalCluster

    cluster = LocalCluster(**kwargs)
    cluster.start()
    try:
        cluster.connect()
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
        assert cluster.pids() == []
