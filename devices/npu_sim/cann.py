"""What a CANN install answers, for the simulated npu: an ``npu-smi`` and the toolkit's version file.

verl reads the driver and toolkit versions through them. :func:`prepare` writes both under
``$HAL_CACHE_DIR/npu_sim/cann/<key>`` and :func:`activate` puts them on ``PATH`` / ``ASCEND_HOME_PATH`` (a real
install wins). The default versions are the last before verl's IPC gate (25.3.rc1, 8.3.RC1), so verl takes its
shared-memory path.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil

# Software Version of the simulated driver (npu-smi info -t board).
DRIVER_VERSION = "25.2.0"
# version= of the simulated toolkit's ascend_toolkit_install.info.
CANN_VERSION = "8.2.RC1"
# Overrides DRIVER_VERSION (e.g. 25.3.rc1, to give the sim a driver with IPC).
DRIVER_VERSION_ENV = "HAL_SIM_DRIVER_VERSION"
# Overrides CANN_VERSION (e.g. 8.3.RC1).
CANN_VERSION_ENV = "HAL_SIM_CANN_VERSION"


def driver_version() -> str:
    """Return the driver version the sim reports: ``$HAL_SIM_DRIVER_VERSION``, else :data:`DRIVER_VERSION`."""
    return os.environ.get(DRIVER_VERSION_ENV, "").strip() or DRIVER_VERSION


def cann_version() -> str:
    """Return the toolkit version the sim reports: ``$HAL_SIM_CANN_VERSION``, else :data:`CANN_VERSION`."""
    return os.environ.get(CANN_VERSION_ENV, "").strip() or CANN_VERSION

_SCRIPT = """#!/bin/sh
# npu-smi of hal's simulated npu (devices/npu_sim/cann.py): `info` and `info -t board -i <id>` only.
IDS="{ids}"
if [ "$1" != "info" ]; then echo "npu-smi (hal npu-sim): only 'info' is simulated" >&2; exit 1; fi
if [ "$#" -eq 1 ]; then
  echo "+------------------------------------------------------------------------------------------------+"
  echo "| npu-smi {driver}                 Version: {driver}                                              |"
  echo "+---------------------------+---------------+----------------------------------------------------+"
  echo "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|"
  echo "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |"
  echo "+===========================+===============+====================================================+"
  for i in $IDS; do
    printf '| %-5s %-19s | OK            | 0.0         0                 0    / 0             |\\n' "$i" "{name}"
    printf '| 0                         | NA            | 0           0    / 0          0    / {memory_mb}         |\\n'
    echo "+===========================+===============+====================================================+"
  done
  exit 0
fi
if [ "$2" = "-t" ] && [ "$3" = "board" ] && [ "$4" = "-i" ]; then
  for i in $IDS; do
    if [ "$i" = "$5" ]; then
      echo "        NPU ID                         : $i"
      echo "        Product Name                   : {name}"
      echo "        Manufacturer                   : hal (simulated)"
      echo "        Software Version               : {driver}"
      echo "        Firmware Version               : {driver}"
      echo "        Compatibility                  : OK"
      echo "        Chip Count                     : 1"
      exit 0
    fi
  done
  echo "The card id $5 is invalid: the simulated npu has cards $IDS" >&2
  exit 1
fi
echo "npu-smi (hal npu-sim): unsupported arguments: $*" >&2
exit 1
"""


def device_ids(environ=None) -> list[str]:
    """Return the simulated devices' ids: ``ASCEND_RT_VISIBLE_DEVICES``'s entries, else ``0..n-1``."""
    environ = os.environ if environ is None else environ
    listed = [v.strip() for v in environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if listed:
        return listed
    count = int(environ.get("HAL_SIM_NPU_COUNT", "").strip() or 8)
    return [str(i) for i in range(count)]


def prepare(root: pathlib.Path, ids: list[str], memory_bytes: int, name: str = "Ascend-sim") -> dict[str, str]:
    """Write ``root/bin/npu-smi`` and the toolkit's version file (idempotent) and return the variables to find them.

    Returns ``{"PATH_PREPEND": ..., "ASCEND_HOME_PATH": ...}``; ``memory_bytes`` is each device's memory.
    """
    home = root / "ascend-toolkit" / "latest"
    info = home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
    smi = root / "bin" / "npu-smi"
    if not (smi.exists() and info.exists()):
        info.parent.mkdir(parents=True, exist_ok=True)
        smi.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(f"package_name=Ascend-cann-toolkit\nversion={cann_version()}\narch={platform.machine()}\n"
                        "os=linux\n# written by hal for its simulated npu (devices/npu_sim/cann.py)\n")
        tmp = smi.with_name(f"npu-smi.{os.getpid()}")
        tmp.write_text(_SCRIPT.format(ids=" ".join(ids), driver=driver_version(), name=name,
                                      memory_mb=memory_bytes >> 20))
        tmp.chmod(0o755)
        os.replace(tmp, smi)  # last: a complete folder is one whose npu-smi exists
    return {"PATH_PREPEND": str(smi.parent), "ASCEND_HOME_PATH": str(home)}


def activate(cache_root: pathlib.Path, memory_bytes: int) -> dict[str, str]:
    """Prepare the CANN answers under ``cache_root/npu_sim/cann/<key>`` and put them on this process's environment.

    Returns the variables set; ``{}`` where a real install's ``ASCEND_HOME_PATH`` or ``npu-smi`` is found.
    """
    ours = cache_root / "npu_sim" / "cann"
    smi, home = shutil.which("npu-smi"), os.environ.get("ASCEND_HOME_PATH")
    if any(p and not pathlib.Path(p).resolve().is_relative_to(ours.resolve()) for p in (smi, home)):
        return {}  # a real install (or someone else's answers) wins
    ids = device_ids()
    key = hashlib.sha256(f"{ids} {memory_bytes} {driver_version()} {cann_version()} {_SCRIPT}".encode()).hexdigest()[:12]
    target = ours / key
    if home and pathlib.Path(home).resolve().is_relative_to(target.resolve()):
        return {}  # already these answers
    found = prepare(target, ids, memory_bytes)
    path = found.pop("PATH_PREPEND")
    os.environ["PATH"] = path + os.pathsep + os.environ.get("PATH", "")
    os.environ.update(found)
    return {"PATH": path, **found}
