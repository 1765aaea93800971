"""Emulated per-rank links (hal.apps.links) and the senders benchmark on them (issue 22)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from hal.apps import links
from hal.apps.benchmarks.bench_senders import bench_senders, model_shapes, shard_ranges



@pytest.fixture
def needs_links():
    """Skip, with the reason, where network namespaces, veth, bridge or tbf cannot be built (not root, no
    iproute2, no CAP_NET_ADMIN); probed once per process, at the first test that needs it."""
    ok, reason = links.links_available()
    if not ok:
        pytest.skip(f"emulated links unavailable: {reason}")

_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); print("ready", flush=True)
s.settimeout(30); c, _ = s.accept(); c.settimeout(30)
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5201), timeout=30)
buf = b"x" * (1 << 16)
for _ in range(int(sys.argv[2]) >> 16):
    c.sendall(buf)
c.close()
"""


def _transfer(net, src: str, dst: str, nbytes: int) -> float:
    """Bytes/s of one TCP stream of ``nbytes`` from ``src`` to ``dst`` (first byte to last, at ``dst``)."""
    server = net.popen([sys.executable, "-c", _SERVER, net.address(dst)], dst, stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the server in the namespace did not start")
        net.run([sys.executable, "-c", _CLIENT, net.address(dst), str(nbytes)], src, timeout=60)
        out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)
    got, seconds = out.split()
    assert int(got) == nbytes
    return int(got) / float(seconds)


@pytest.mark.usefixtures("needs_links")
def test_link_rate_limits_a_tcp_transfer_and_teardown_removes_the_namespaces():
    rate = 40e6  # bits/s: 5 MB/s, about 2 s for 10 MiB
    with links.emulated_network({"a": rate, "b": 4 * rate}) as net:
        names = set(net.namespaces.values()) | {net.hub}
        assert names <= set(links.list_namespaces())
        assert net.address("a") == "10.231.0.1" and net.address("b") == "10.231.0.2"
        measured = _transfer(net, "a", "b", 10 << 20)  # a's upload is the limit
        assert 0.75 * rate / 8 <= measured <= 1.25 * rate / 8, f"{measured * 8 / 1e6:.1f} Mbit/s, set {rate / 1e6:g}"
        net.set_rate("a", 4 * rate)
        net.set_rate("b", rate)
        down = _transfer(net, "a", "b", 10 << 20)  # now b's download (the hub side's qdisc) is the limit
        assert 0.75 * rate / 8 <= down <= 1.25 * rate / 8, f"{down * 8 / 1e6:.1f} Mbit/s, set {rate / 1e6:g}"
    assert not names & set(links.list_namespaces())


@pytest.mark.usefixtures("needs_links")
def test_teardown_runs_on_an_error_and_stale_namespaces_of_dead_processes_go():
    with pytest.raises(KeyboardInterrupt):
        with links.emulated_network({"a": 1e6}) as net:
            names = set(net.namespaces.values()) | {net.hub}
            raise KeyboardInterrupt
    assert not names & set(links.list_namespaces())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = f"{links.PREFIX}{dead.pid}-0-x"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    mine = f"{links.PREFIX}{os.getpid()}-999-x"  # a live process's: kept
    subprocess.run(["ip", "netns", "add", mine], check=True, timeout=30)
    try:
        assert stale in links.remove_stale()
        left = links.list_namespaces()
        assert stale not in left and mine in left
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_links_available_names_the_reason(monkeypatch):
    monkeypatch.setattr(links, "_available", None)
    monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
    ok, why = links.links_available()
    assert not ok and "root" in why


def test_emulated_network_rejects_bad_endpoints():
    with pytest.raises(ValueError, match="rate of endpoint 'a'"):
        with links.emulated_network({"a": 0}):
            pass
    with pytest.raises(ValueError, match="endpoint name"):
        with links.emulated_network({"a b": 1e6}):
            pass


@pytest.mark.parametrize("senders", [1, 2, 3, 4])
def test_dim0_shards_tile_the_model_as_torch_chunk_does(senders):
    shapes = model_shapes(3 << 20)
    numel = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.arange(numel)
    covered = torch.zeros(numel, dtype=torch.int64)
    offsets, offset = [], 0
    for s in shapes:
        offsets.append(offset)
        offset += torch.Size(s).numel()
    for sender in range(senders):
        for index, start, stop in shard_ranges(shapes, senders, sender):
            covered[start:stop] += 1
            full = flat[offsets[index]:offsets[index] + torch.Size(shapes[index]).numel()].view(shapes[index])
            chunk = torch.chunk(full, senders, dim=0)[sender]  # FSDP2's dim-0 shard of this rank
            assert torch.equal(flat[start:stop], chunk.reshape(-1))
    assert torch.equal(covered, torch.ones(numel, dtype=torch.int64))  # every element once, none twice
    assert any(shape[0] % 4 for shape in shapes)  # uneven shards are exercised


@pytest.mark.usefixtures("needs_links")
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_senders_deliver_an_update_faster_than_one():
    t0 = time.monotonic()
    result = bench_senders(size_mb=4, rate_mbit=50, rollout_factor=4, rollouts=1, senders=(1, 2), rounds=1,
                           rollout_limited=False)
    rows = {row["senders"]: row for row in result["rows"]}
    assert rows[1]["bytes"] == rows[2]["bytes"] == result["bytes"] > 4_000_000
    # one sender cannot beat its own link (50 Mbit/s = 6.25 MB/s)
    assert rows[1]["gbps"] * 1e9 <= 1.1 * 50e6 / 8
    assert rows[2]["ratio"] > 1.4, result
    print(f"2 senders / 1 sender: {rows[2]['ratio']:.2f} ({time.monotonic() - t0:.0f} s in all)")


def test_bench_senders_refuses_a_bad_path_before_building_anything():
    mine = f"{links.PREFIX}{os.getpid()}-"  # other tests and workers make and remove their own meanwhile
    with pytest.raises(ValueError, match="module:factory"):
        bench_senders(size_mb=1, path="no-colon")
    with pytest.raises(ModuleNotFoundError):
        bench_senders(size_mb=1, path="hal.apps.benchmarks.no_such_module:Path")
    if links.links_available()[0]:
        assert not [name for name in links.list_namespaces() if name.startswith(mine)]
