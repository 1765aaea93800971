"""``tests.ports.pick_port``: a port no outgoing connection can take before its server binds it."""

import socket

import pytest

from tests import ports
from tests.ports import held_port, pick_port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_port_is_free_and_below_the_kernels_ephemeral_range():
    low, high = ports.ephemeral_port_range()
    picked = {pick_port() for _ in range(20)}
    assert all(10_000 <= p < low and _bindable(p) for p in picked), (picked, low)
    assert len(picked) > 1  # drawn at random, not one fixed port


def test_a_busy_port_is_never_returned(monkeypatch):
    with held_port() as taken:
        # a range of one port to draw from, and that one taken: the operating system chooses instead
        monkeypatch.setattr(ports, "_LOWEST_PICKED_PORT", taken)
        monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (taken + 1, 65535))
        port = pick_port()
    assert port != taken and _bindable(port)


def test_without_a_range_to_draw_from_the_operating_system_chooses(tmp_path, monkeypatch):
    low, high = ports.ephemeral_port_range()
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")  # no room below the range
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(wide))
    assert low <= pick_port() <= high  # bound to port 0: the kernel's range
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert low <= pick_port() <= high


def _nonlocal_bind() -> bool:
    try:
        with open("/proc/sys/net/ipv4/ip_nonlocal_bind") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_nonlocal_bind(), reason="this host lets a socket bind any address (ip_nonlocal_bind=1)")
def test_a_host_that_is_not_local_raises():
    with pytest.raises(OSError):
        pick_port("192.0.2.1")  # TEST-NET-1 (RFC 5737): never an address of this machine


def test_picking_leaves_the_callers_random_stream_alone():
    import random

    random.seed(0)
    expected = random.random()
    random.seed(0)
    pick_port()
    assert random.random() == expected  # ranks seeded alike stay alike whichever of them picked a port
