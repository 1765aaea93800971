"""Where the soak's worker processes live: a scratch directory of the run's own and, where the machine allows,
a private mount namespace and an emulated network, so faults hit only the soak's processes.

The scratch directory (``$TMPDIR/hal-soak-*``) holds the workers' ``TMPDIR``, logs and the file engine's root.
The mount namespace (``unshare --mount``, entered with ``nsenter``; held by a ``cat`` on the driver's pipe)
gives the workers a private ``/dev/shm`` and a small disk for ``full_shm`` and ``full_disk``. The emulated
network (:func:`hal.apps.links.emulated_network`) serves link faults. Without root the faults that need these
are skipped with the reason (:func:`machine_support`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Any

from hal.apps.soak.strike import Surroundings, remove_ballast

LINK_RATE_BPS = 10e9  # bits/s of a link no fault throttles
NAMESPACE_START_S = 30.0  # seconds for the holder to mount
_support: dict[str, str | None] | None = None


def _mounts_reason() -> str | None:
    """Why a private mount namespace with a ``tmpfs`` cannot be made here (``None``: it can)."""
    if os.geteuid() != 0:
        return "a private mount namespace with its own /dev/shm needs root"
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"util-linux's {' and '.join(missing)} not on PATH"
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True,
                              timeout=NAMESPACE_START_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --mount failed: {exc}"
    if done.returncode != 0:
        return f"unshare --mount with a tmpfs on /dev/shm failed: {done.stderr.strip()}"
    return None


def machine_support() -> dict[str, str | None]:
    """What this machine allows the soak: ``{"mounts": reason or None, "links": reason or None}``, probed once."""
    global _support
    if _support is None:
        from hal.apps.links import links_available

        ok, why = links_available()
        _support = {"mounts": _mounts_reason(), "links": None if ok else why}
    return _support


class Sandbox:
    """The run's scratch directory and its namespaces where asked for and possible (sizes in bytes); a context
    manager that removes them on leaving."""

    def __init__(self, workers: int, mounts: bool, links: bool, shm_bytes: int = 256 << 20,
                 disk_bytes: int = 64 << 20) -> None:
        self.workers, self.want_mounts, self.want_links = workers, mounts, links
        self.shm_bytes, self.disk_bytes = shm_bytes, disk_bytes
        self.root = ""
        self.holder: subprocess.Popen | None = None
        self.network: Any = None
        self._stack = contextlib.ExitStack()

    # -- life -----------------------------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        from hal.apps.shutdown import scratch_dir

        try:
            self.root = self._stack.enter_context(scratch_dir("hal-soak-"))
            for sub in ("tmp", "logs", "files", "disk"):
                os.makedirs(os.path.join(self.root, sub))
            if self.want_links:
                from hal.apps.links import emulated_network

                self.network = self._stack.enter_context(
                    emulated_network({f"w{i}": LINK_RATE_BPS for i in range(self.workers)}))
            if self.want_mounts:
                self._start_holder()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start_holder(self) -> None:
        script = (f"mount -t tmpfs -o size={self.shm_bytes} tmpfs /dev/shm && "
                  f"mount -t tmpfs -o size={self.disk_bytes} tmpfs {self.disk_dir} && echo ready && exec cat")
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
        self._stack.callback(self._stop_holder)
        line = self.holder.stdout.readline()  # blocks until the mounts are done (or the shell failed)
        if line.strip() != "ready":
            self.holder.wait(timeout=NAMESPACE_START_S)
            raise RuntimeError(f"the soak's mount namespace did not start: {self.holder.stderr.read().strip()}")

    def _stop_holder(self) -> None:
        holder = self.holder
        if holder is None:
            return
        with contextlib.suppress(OSError):
            holder.stdin.close()  # cat ends: the namespace goes with the last process inside it
        try:
            holder.wait(timeout=NAMESPACE_START_S)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        for stream in (holder.stdout, holder.stderr):
            stream.close()
        self.holder = None

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    # -- what workers get -----------------------------------------------------------------------------------

    @property
    def mounts(self) -> bool:
        """The workers live in a private mount namespace."""
        return self.holder is not None

    @property
    def disk_dir(self) -> str:
        """The file engine's root when the private disk exists (else a plain directory of the scratch)."""
        return os.path.join(self.root, "disk")

    @property
    def files_dir(self) -> str:
        """The file engine's root: on the private disk where there is one."""
        return self.disk_dir if self.want_mounts else os.path.join(self.root, "files")

    @property
    def tmp_dir(self) -> str:
        """The workers' ``TMPDIR``."""
        return os.path.join(self.root, "tmp")

    def log_path(self, index: int, incarnation: int) -> str:
        """The log (stdout and stderr) of worker ``index``'s ``incarnation``-th process."""
        return os.path.join(self.root, "logs", f"worker{index}-{incarnation}.log")

    def prefix(self, index: int) -> list[str]:
        """The command that starts worker ``index`` inside the sandbox's namespaces (``[]``: none)."""
        args = []
        if self.holder is not None:
            args.append(f"--mount=/proc/{self.holder.pid}/ns/mnt")
        if self.network is not None:
            args.append(f"--net=/run/netns/{self.network.namespace(f'w{index}')}")
        return ["nsenter", *args, f"--wd={os.getcwd()}", "--"] if args else []

    def env(self, index: int) -> dict[str, str]:
        """What worker ``index``'s environment adds: its ``TMPDIR``, and gloo's interface inside a network."""
        env = {"TMPDIR": self.tmp_dir}
        if self.network is not None:
            env["GLOO_SOCKET_IFNAME"] = self.network.ifname
        return env

    def node_ip(self, index: int) -> str:
        """The address worker ``index`` is reached at."""
        return self.network.address(f"w{index}") if self.network is not None else "127.0.0.1"

    def surroundings(self, index: int) -> Surroundings:
        """What worker ``index``'s strikes act on."""
        return Surroundings(network=self.network, endpoint=f"w{index}" if self.network is not None else None,
                            disk_dir=self.disk_dir if self.mounts else None,
                            shm_dir="/dev/shm" if self.mounts else None)

    # -- what the driver reads and repairs ------------------------------------------------------------------

    def inside(self, path: str) -> str:
        """``path`` as the workers see it, from the driver (through the holder's ``/proc/<pid>/root``)."""
        return f"/proc/{self.holder.pid}/root{path}" if self.holder is not None else path

    def shm_segments(self) -> list[str]:
        """The workers' ``/dev/shm`` entries (the private one; else the machine's ``hal-*`` entries)."""
        path = self.inside("/dev/shm")
        names = sorted(os.listdir(path)) if os.path.isdir(path) else []
        return names if self.mounts else [n for n in names if n.startswith("hal-")]

    def temp_entries(self) -> list[str]:
        """What the workers left in their ``TMPDIR`` (torch's per-user compile cache aside)."""
        return sorted(n for n in os.listdir(self.tmp_dir) if not n.startswith("torchinductor_"))

    def repair(self, kind: str, target: int) -> None:
        """Undo what a fault of ``kind`` on worker ``target`` left: a full filesystem's ballast, a link down or
        throttled."""
        if kind == "full_disk":
            remove_ballast(self.inside(self.disk_dir))
        elif kind == "full_shm":
            remove_ballast(self.inside("/dev/shm"))
        elif kind in ("cut_link", "slow_link") and self.network is not None:
            endpoint = f"w{target}"
            subprocess.run(["ip", "-n", self.network.namespace(endpoint), "link", "set", self.network.ifname, "up"],
                           check=True, capture_output=True, timeout=NAMESPACE_START_S)
            self.network.set_rate(endpoint, LINK_RATE_BPS)


__all__ = ["LINK_RATE_BPS", "Sandbox", "machine_support"]
