"""Ray clusters for hal's jobs: :class:`LocalCluster`, a Ray node as a child process stopped by its process id
(never ``ray stop``), and :func:`connect_cluster`, a bounded connection to a running cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from hal import registry
from hal.device import ENV_VAR
from hal.ray.placement import SCHEDULE_AS_ENV, RayLaunchError, node_environment, require_ray, resource_name

# Object store of a LocalCluster node, in bytes: weights go through the checkpoint engine, not Ray.
DEFAULT_OBJECT_STORE_BYTES = 256 << 20


# ---- a Ray node as a child process ---------------------------------------------------------------------
# Every port is 0: a port picked here and bound later by Ray can be taken in between ("Address already in use").
_RAY_PORT_OPTIONS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")


def _reload_ray_auth() -> None:
    """Make Ray re-read ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` and its other ``RAY_*`` settings (it caches them)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# Longest Unix socket path on Linux, in bytes (Ray refuses longer).
AF_UNIX_PATH_MAX = 107
# Bytes Ray 2.60 appends to its temporary directory for its longest socket (session dir, plasma_store, .N).
_RAY_SOCKET_SUFFIX = 67
# Where ray_temp_parent looks, in order, when the system's temporary directory is too long for Ray.
_SHORT_TEMP_PARENTS = ("/tmp", "/var/tmp", "/dev/shm")
_TEMP_DIR_PREFIX = "hal-ray-"


def ray_temp_parent(base: str | None = None) -> str:
    """Return where :class:`LocalCluster` makes its temporary directory: ``base`` (default ``$TMPDIR``) if Ray's
    sockets fit :data:`AF_UNIX_PATH_MAX`, else the first short writable one of /tmp, /var/tmp, /dev/shm.
    """
    base = base if base is not None else tempfile.gettempdir()
    room = AF_UNIX_PATH_MAX - _RAY_SOCKET_SUFFIX - len(_TEMP_DIR_PREFIX) - 8 - 1  # mkdtemp adds 8 characters
    for parent in (base, *_SHORT_TEMP_PARENTS):
        if len(os.fsencode(parent)) <= room and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return parent
    raise RayLaunchError(f"Ray's Unix sockets under {base!r} ({len(os.fsencode(base))} bytes) would exceed "
                         f"{AF_UNIX_PATH_MAX} bytes, and none of {', '.join(_SHORT_TEMP_PARENTS)} is a writable "
                         f"directory: set TMPDIR to a directory of at most {room} bytes, or pass LocalCluster(temp_dir=...)")


# ---- connecting to a cluster ---------------------------------------------------------------------------
# Seconds connect_cluster gives a cluster's head to answer, per stage (TCP, then Ray's own client).
CONNECT_TIMEOUT_S = 10.0
_RAY_CONNECT_BOUNDS = {
    # Ray 2.60 otherwise retries 20 times for 35 s each; one attempt, the client timeout filled in with the caller's
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": None,
}


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    """Return ``(host, port)`` of a ``HOST:PORT`` address; ``None`` for ``auto``, ``ray://...`` and the like."""
    if "://" in address:
        return None
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _unreachable(host: str, port: int, timeout: float) -> str | None:
    """Return why a TCP connection to ``host:port`` fails within ``timeout`` seconds; ``None`` when it opens."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "connection refused (nothing listens on that port)"
    except socket.gaierror as exc:
        return f"unknown host {host!r} ({exc.strerror})"
    except TimeoutError:
        return (f"no answer within {timeout:g} s (the host is down or unreachable, or a firewall drops the "
                f"connection)")
    except OSError as exc:
        return exc.strerror or str(exc)


class _CapturedStderr:
    """Send file descriptor 2 to a temporary file for a ``with`` block; the output is in :attr:`text` after it."""

    text = ""

    def __enter__(self) -> _CapturedStderr:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        with self._file:
            self._file.seek(0)
            self.text = self._file.read().decode(errors="replace")


def connect_cluster(address: str, timeout: float = CONNECT_TIMEOUT_S, **init_kwargs: Any) -> Any:
    """``ray.init`` this driver to the running cluster at ``address`` in bounded time; return Ray's context.

    ``address``: ``HOST:PORT`` of the head, ``auto`` or ``ray://``. ``timeout`` (seconds) bounds each stage: a
    plain TCP connect, then one attempt of Ray's client (about ``timeout + 10`` s in all). Ray's log output is
    replayed on success, dropped on failure, which raises RayLaunchError naming the address and why.
    """
    import math

    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    ray = require_ray()
    check = ("check that the cluster's head runs there ('ray start --head' on it; 'ray status' there prints the "
             "address to pass) and that this machine can reach it")
    endpoint = _tcp_endpoint(address)
    if endpoint is not None:
        reason = _unreachable(*endpoint, timeout)
        if reason is not None:
            raise RayLaunchError(f"cannot reach the Ray cluster at {address}: {reason}; {check}")
    bounds = {k: v if v is not None else str(math.ceil(timeout)) for k, v in _RAY_CONNECT_BOUNDS.items()
              if k not in os.environ}
    os.environ.update(bounds)
    try:
        _reload_ray_auth()  # Ray reads its RAY_* settings when told to
        with _CapturedStderr() as said:
            try:
                context = ray.init(address=address, **init_kwargs)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError: all one sentence
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                reason = lines[0].rstrip(".") if lines else "no reason given"
                raise RayLaunchError(f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: "
                                     f"{reason}; {check}") from None
    finally:
        for key in bounds:
            os.environ.pop(key, None)
    sys.stderr.write(said.text)
    return context


@dataclasses.dataclass
class LocalCluster:
    """A Ray node run by ``ray start --block`` as a child process of this one, stopped by its process id.

    All ports are bound as port 0, the temporary directory is its own (``temp_dir``: at most 40 bytes), the
    dashboard is off and a token made for this cluster is passed through ``RAY_AUTH_TOKEN``. ``head``: the
    head's ``host:port`` to join (``None`` starts a head). ``node_env``: more environment of the node's
    processes. ``schedule_as``: kinds run under another resource (``{"npu-sim": "NPU"}``, see
    :func:`node_environment`). Use :meth:`start`, :meth:`connect`, :meth:`stop`, or a ``with`` block.
    """

    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    num_cpus: int = 2
    node_ip: str = "127.0.0.1"
    head: str | None = None
    token: str | None = None
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    temp_dir: str | None = None
    timeout: float = 60.0
    node_env: dict[str, str] = dataclasses.field(default_factory=dict)
    schedule_as: dict[str, str] = dataclasses.field(default_factory=dict)
    process: subprocess.Popen | None = dataclasses.field(default=None, init=False, repr=False)
    address: str | None = dataclasses.field(default=None, init=False)
    start_seconds: float | None = dataclasses.field(default=None, init=False)
    log_path: str | None = dataclasses.field(default=None, init=False)

    def env(self) -> dict[str, str]:
        """Return the variables a process needs to talk to this cluster plus those its node was started with.

        ``HAL_SIM_HOST`` (the node's address) makes each node of a one-machine cluster its own simulated host.
        """
        kinds = [k for k in registry.known_kinds() if resource_name(k) in self.resources]
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token or "", "RAY_USAGE_STATS_ENABLED": "0",
                "HAL_SIM_HOST": self.node_ip, **node_environment(kinds, self.schedule_as)}

    def start(self) -> str:
        """Start the node and wait until it serves (head) or joined (worker); return the head's address.

        Raises RayLaunchError (ending with the tail of its log) if it does not come up within ``timeout``.
        """
        require_ray()
        if self.process is not None:
            raise RayLaunchError(f"this LocalCluster node is already running (pid {self.process.pid})")
        self.token = self.token or uuid.uuid4().hex
        if self.temp_dir is None:  # its Unix sockets must fit in AF_UNIX_PATH_MAX bytes: a long $TMPDIR is passed over
            self.temp_dir = tempfile.mkdtemp(prefix=_TEMP_DIR_PREFIX, dir=ray_temp_parent())
            self._own_temp_dir = True
        elif len(os.fsencode(self.temp_dir)) + _RAY_SOCKET_SUFFIX > AF_UNIX_PATH_MAX:
            raise RayLaunchError(f"temp_dir {self.temp_dir!r} is too long for Ray's Unix sockets (at most "
                                 f"{AF_UNIX_PATH_MAX - _RAY_SOCKET_SUFFIX} bytes, got {len(os.fsencode(self.temp_dir))})")
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
               f"--node-ip-address={self.node_ip}", f"--num-cpus={self.num_cpus}",
               f"--num-gpus={int(self.resources.get('GPU', 0))}",
               f"--resources={json.dumps({k: v for k, v in self.resources.items() if k != 'GPU'})}",
               f"--object-store-memory={self.object_store_bytes}",
               f"--temp-dir={self.temp_dir}", "--min-worker-port=0", "--max-worker-port=0",
               "--disable-usage-stats", "--include-log-monitor=false",
               *[f"--{name}=0" for name in _RAY_PORT_OPTIONS]]
        if self.head is None:
            cmd += ["--head", "--port=0", "--include-dashboard=false"]
        else:
            cmd += [f"--address={self.head}"]
        self.log_path = os.path.join(self.temp_dir, "ray-start.log")
        # HAL_DEVICE is the binding's to set, per actor: a node-wide one would activate the simulated npu
        # inside `import torch` of every worker, before hal could give it its own visible device
        env = {**{k: v for k, v in os.environ.items() if k != ENV_VAR}, **self.node_env, **self.env()}
        begin = time.perf_counter()
        with open(self.log_path, "ab") as log:
            # its own session: every Ray process it starts shares it, so stop() can find them by id
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - begin
        return self.address

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _wait_up(self) -> None:
        deadline = time.monotonic() + self.timeout
        pattern = re.compile(r"ray start --address='([^']+)'")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RayLaunchError(f"ray start exited with status {self.process.returncode}:\n{self._log_tail()}")
            text = self._log_tail(200_000)
            if self.head is None:
                match = pattern.search(text)
                if match and "--block" in text:
                    self.address = match.group(1)
                    return
            elif "Ray runtime started" in text and "--block" in text:
                self.address = self.head
                return
            time.sleep(0.1)
        raise RayLaunchError(f"the Ray node at {self.node_ip} did not come up within {self.timeout:g} s:\n"
                             f"{self._log_tail()}")

    def connect(self, **init_kwargs: Any):
        """``ray.init`` this driver to the cluster with its token and ``HAL_RAY_SCHEDULE_AS``; return Ray's context."""
        ray = require_ray()
        os.environ.update({k: v for k, v in self.env().items() if k.startswith("RAY_AUTH") or k == SCHEDULE_AS_ENV})
        _reload_ray_auth()
        return ray.init(address=self.address, log_to_driver=init_kwargs.pop("log_to_driver", False),
                        logging_level=init_kwargs.pop("logging_level", logging.WARNING), **init_kwargs)

    def pids(self) -> list[int]:
        """Return the ids of this node's processes still alive (its ``ray start`` and what that started)."""
        if self.process is None:
            return []
        sid, found = self.process.pid, []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # session id is field 6 of stat (index 3 after the name)
                found.append(int(entry))
        return found

    def stop(self, timeout: float = 30.0) -> None:
        """Stop this node's processes by id: SIGTERM to ``ray start``, then SIGKILL to any left after ``timeout`` s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5.0
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        deadline = time.monotonic() + 5.0  # a killed process may write its last log lines until the kernel reaps it
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.process = None
        if getattr(self, "_own_temp_dir", False):  # made by start(): logs and sockets go with the node
            for _ in range(20):  # a file written during the removal makes rmtree miss its folder: go again
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                if not os.path.exists(self.temp_dir):
                    break
                time.sleep(0.1)
            self.temp_dir, self._own_temp_dir = None, False

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["LocalCluster", "CONNECT_TIMEOUT_S", "connect_cluster", "AF_UNIX_PATH_MAX", "ray_temp_parent"]
