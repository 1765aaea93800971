"""hal.distributed classifies failures by exception type, never by message text."""

import datetime

import pytest
import torch.distributed as dist

import hal
from hal.distributed import RENDEZVOUS_ERRORS, PendingWork, peer_failure
from tests.ports import pick_port


@pytest.mark.parametrize("exc, expected", [
    (RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"), True),  # gloo's own type
    (RuntimeError("anything at all"), True),  # the type decides, not the words
    (TimeoutError(), True),
    (dist.DistBackendError("Duplicate NPU detected"), False),  # a backend's typed error says what is wrong
    (dist.DistStoreError("x"), True),
    (NotImplementedError("all_to_all"), False),  # a RuntimeError subclass, but no peer failed
    (ValueError("timed out"), False),  # the words say timeout; the type does not
    (TypeError("connection closed"), False),
])
def test_peer_failure_by_type(exc, expected):
    assert peer_failure(exc) is expected


def test_rendezvous_errors_cover_torch_store_errors():
    for cls in (dist.DistStoreError, dist.DistNetworkError, dist.DistBackendError, TimeoutError):
        assert issubclass(cls, RENDEZVOUS_ERRORS)
    assert not issubclass(ValueError, RENDEZVOUS_ERRORS)


def test_connect_store_unreachable_is_a_timeout_error():
    port = pick_port()  # free a moment ago: nothing listens there
    with pytest.raises(hal.DistributedTimeoutError, match=f"127.0.0.1:{port}"):
        hal.connect_store("127.0.0.1", port, rank=1, world_size=2, timeout=datetime.timedelta(seconds=1))


def test_hosting_a_store_on_a_taken_port_says_it_could_not_host_not_that_it_waited():
    served = hal.connect_store("127.0.0.1", 0, 0, 2, timeout=5, is_master=True)
    with pytest.raises(hal.DistributedTimeoutError, match=f"could not host the rendezvous store at 127.0.0.1:"
                                                          f"{served.port} .*pass is_master=False") as info:
        hal.connect_store("127.0.0.1", served.port, rank=0, world_size=2, timeout=30)  # rank 0: it hosts
    assert "within" not in str(info.value)


def test_store_group_wait_maps_a_backend_runtime_error():
    class Broken:
        def wait(self, timeout):
            raise RuntimeError("Connection closed by peer")

    group = hal.StoreGroup(None, 0, 2, datetime.timedelta(seconds=1), hal.resolve_device("cpu"))
    with pytest.raises(hal.DistributedTimeoutError, match="a peer is dead or missing"):
        PendingWork(group, Broken(), "broadcast").wait()


def test_store_group_wait_passes_other_errors_through():
    class Unsupported:
        def wait(self, timeout):
            raise NotImplementedError("no such collective")

    group = hal.StoreGroup(None, 0, 2, datetime.timedelta(seconds=1), hal.resolve_device("cpu"))
    with pytest.raises(NotImplementedError):
        PendingWork(group, Unsupported(), "broadcast").wait()
