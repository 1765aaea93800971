"""Emulated per-rank network links: each endpoint (a trainer rank, a rollout) in its own network namespace.

:func:`emulated_network` gives every endpoint a namespace with one veth (``eth0``, an address in
``10.231.0.0/24``) whose peer sits on a bridge in a hub namespace; a token bucket (``tc ... tbf``) limits each
direction, as a full-duplex NIC of that rate. A process enters an endpoint with :func:`enter_namespace`.
Needs root (``CAP_NET_ADMIN``), iproute2 and the kernel's veth, bridge and tbf (:func:`links_available` says
why not). Namespaces are ``hallinks-<pid>-<n>-<endpoint>``; teardown always runs, and those of a dead process
are removed by the next :func:`emulated_network`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import os
import re
import shutil
import subprocess
from typing import Iterator, Mapping, Sequence

import hal

PREFIX = "hallinks-"  # namespace prefix, then the creating pid
SUBNET = "10.231.0"  # endpoint i gets 10.231.0.<i+1>
IFNAME = "eth0"  # the endpoint's interface (for GLOO_SOCKET_IFNAME)
MAX_LINK_GBIT = 400.0  # Gbit/s, the fastest link accepted
MAX_ENDPOINTS = 250
CMD_TIMEOUT_S = 30.0
_NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,40}$")
_counter = itertools.count()
_available: tuple[bool, str] | None = None


class LinksError(RuntimeError):
    """An ``ip`` / ``tc`` command failed or timed out; the message holds the command and its stderr."""


def _cmd(argv: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise LinksError(f"{' '.join(argv)!r} did not finish within {timeout:g} s") from exc
    if check and done.returncode != 0:
        raise LinksError(f"{' '.join(argv)!r} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def _tbf(rate_bps: float) -> list[str]:
    """``tc`` arguments of a token bucket of ``rate_bps`` bits/s (bucket >= 128 KiB, queue 200 ms: no incast loss)."""
    burst = max(int(rate_bps / 8 * 0.010), 128 << 10)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "200ms"]


def links_available() -> tuple[bool, str]:
    """Whether emulated links can be built here: ``(True, "")``, or ``(False, reason)``; cached per process."""
    global _available
    if _available is not None:
        return _available
    if os.geteuid() != 0:
        _available = (False, "emulated links need root (ip netns / tc need CAP_NET_ADMIN)")
        return _available
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        _available = (False, f"emulated links need iproute2's {' and '.join(missing)} on PATH")
        return _available
    try:
        with emulated_network({"a": 1e6, "b": 1e6}):
            pass
    except (LinksError, OSError) as exc:
        _available = (False, f"building network namespaces with veth, bridge and tbf failed: {exc}")
        return _available
    _available = (True, "")
    return _available


def list_namespaces() -> list[str]:
    """Names of every network namespace on the machine (``ip netns list``)."""
    out = _cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete this module's namespaces whose creating process no longer runs; returns their names."""
    removed = []
    for name in list_namespaces():
        match = re.match(rf"^{re.escape(PREFIX)}(\d+)-", name)
        if match and not hal.process_alive(int(match.group(1))):
            _cmd(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


@dataclasses.dataclass(frozen=True)
class EmulatedNetwork:
    """A built network (picklable): endpoint -> ``namespaces``, ``addresses``, ``rates`` (bits/s); ``hub`` holds the
    bridge."""

    namespaces: dict[str, str]
    addresses: dict[str, str]
    hub: str
    rates: dict[str, float]
    ports: dict[str, str]  # endpoint -> its veth peer in the hub namespace

    @property
    def ifname(self) -> str:
        """The interface of every endpoint inside its namespace (for ``GLOO_SOCKET_IFNAME``)."""
        return IFNAME

    def namespace(self, endpoint: str) -> str:
        """The namespace of ``endpoint``; KeyError lists the endpoints."""
        if endpoint not in self.namespaces:
            raise KeyError(f"no endpoint {endpoint!r} in this network (endpoints: {sorted(self.namespaces)})")
        return self.namespaces[endpoint]

    def address(self, endpoint: str) -> str:
        """The IPv4 address of ``endpoint``."""
        self.namespace(endpoint)
        return self.addresses[endpoint]

    def enter(self, endpoint: str) -> str:
        """Move the calling thread into ``endpoint``'s namespace, gloo onto its interface; returns its address."""
        enter_namespace(self.namespace(endpoint))
        os.environ["GLOO_SOCKET_IFNAME"] = self.ifname
        return self.address(endpoint)

    def set_rate(self, endpoint: str, rate_bps: float) -> None:
        """Change ``endpoint``'s link to ``rate_bps`` bits/s both ways, also while traffic flows."""
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0 bits/s, got {rate_bps!r}")
        ns = self.namespace(endpoint)
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", IFNAME, "root", *_tbf(rate_bps)])
        _cmd(["tc", "-n", self.hub, "qdisc", "replace", "dev", self.ports[endpoint], "root", *_tbf(rate_bps)])

    def run(self, argv: Sequence[str], endpoint: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``endpoint``'s namespace; LinksError when it fails or runs past ``timeout`` seconds."""
        return _cmd(["ip", "netns", "exec", self.namespace(endpoint), *argv], timeout=timeout)

    def popen(self, argv: Sequence[str], endpoint: str, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``endpoint``'s namespace (``Popen`` keywords pass through); the caller waits for it."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(endpoint), *argv], **kwargs)


def link_gbit_to_bps(gbit: float, flag: str = "--link-gbit") -> float:
    """The rate in bits/s of a link given in Gbit/s as ``flag``; UsageError outside (0, MAX_LINK_GBIT]."""
    from hal.apps.errors import UsageError

    if not 0 < gbit <= MAX_LINK_GBIT:  # NaN fails both comparisons
        raise UsageError(f"{flag} takes a rate in Gbit/s in (0, {MAX_LINK_GBIT:g}], got {gbit}")
    return gbit * 1e9


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (``setns(2)``); call before opening sockets or
    threads."""
    path = os.path.join(_NETNS_DIR, namespace)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, os.CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {namespace!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def emulated_network(rates: Mapping[str, float]) -> Iterator[EmulatedNetwork]:
    """Build one namespace per endpoint, each linked to a shared bridge at its rate (bits/s, each direction).

    Endpoint names: letters, digits, ``_``, ``.``, at most 40 characters. On leaving, every namespace is deleted,
    also on an exception; processes still inside keep theirs until they exit.
    """
    if not rates or len(rates) > MAX_ENDPOINTS:
        raise ValueError(f"need 1..{MAX_ENDPOINTS} endpoints, got {len(rates)}")
    for name, rate in rates.items():
        if not _NAME.match(name):
            raise ValueError(f"endpoint name {name!r} must be 1-40 characters of letters, digits, '_' and '.'")
        if not rate > 0:
            raise ValueError(f"rate of endpoint {name!r} must be > 0 bits/s, got {rate!r}")
    remove_stale()
    base = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
    hub = base + "hub"
    net = EmulatedNetwork(namespaces={name: base + name for name in rates},
                          addresses={name: f"{SUBNET}.{i + 1}" for i, name in enumerate(rates)},
                          hub=hub, rates={name: float(rate) for name, rate in rates.items()},
                          ports={name: f"p{i}" for i, name in enumerate(rates)})
    made: list[str] = []
    try:
        _cmd(["ip", "netns", "add", hub])
        made.append(hub)
        _cmd(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", hub, "link", "set", "br0", "up"])
        for name, rate in net.rates.items():
            ns, port = net.namespaces[name], net.ports[name]
            _cmd(["ip", "netns", "add", ns])
            made.append(ns)
            _cmd(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", hub])
            _cmd(["ip", "-n", hub, "link", "set", port, "master", "br0"])
            _cmd(["ip", "-n", hub, "link", "set", port, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{net.addresses[name]}/24", "dev", IFNAME])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            _cmd(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *_tbf(rate)])    # its upload
            _cmd(["tc", "-n", hub, "qdisc", "add", "dev", port, "root", *_tbf(rate)])     # its download
        yield net
    finally:
        for ns in reversed(made):
            _cmd(["ip", "netns", "del", ns], check=False)
