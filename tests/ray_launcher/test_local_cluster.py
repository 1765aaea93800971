"""``hal.ray.LocalCluster``: a node whose processes bind their own ports, so no port picked ahead can be lost."""

from __future__ import annotations

import pytest

from tests.ports import held_port
from tests.ray_launcher.conftest import ray, ray_cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

RAY_DEFAULT_GCS_PORT = 6379  # `ray start --head` without --port


def test_a_node_comes_up_even_when_every_port_picked_ahead_is_taken():
    # A CI run failed with "Address already in use": the GCS port hal had picked was taken by another process
    # before Ray bound it. The worst case of that race is a picker whose every port is already taken.
    with held_port() as taken:
        with ray_cluster(num_cpus=1) as node:
            port = int(node.address.rsplit(":", 1)[1])
            assert port not in (taken, RAY_DEFAULT_GCS_PORT)
            assert ray.cluster_resources()["CPU"] == 1.0
        assert node.pids() == []
