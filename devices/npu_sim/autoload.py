"""Activate the simulated npu inside ``import torch``, before any consumer's first import.

torch loads every entry point of the group ``torch.backends`` at the end of ``import torch`` (its
out-of-tree backend autoload, ``torch._import_device_backends``; torch_npu registers itself the same
way). hal declares :func:`autoload` there (``pyproject.toml``), so a process started by torchrun,
multiprocessing or Ray, where no code of the user's runs before verl's or vLLM's imports, has ``torch.npu``,
``hccl`` and ``import torch_npu`` from its first ``import torch`` on.

It does nothing unless asked: ``HAL_DEVICE=npu-sim`` (or ``npu-sim:<index>``), or ``HAL_NPU_SIM_AUTOLOAD=1``
with any ``HAL_DEVICE``. It also gives the process what a CANN install answers (``npu-smi``, the toolkit's
version file; :mod:`devices.npu_sim.cann`), written under hal's cache folder. ``HAL_NPU_SIM_AUTOLOAD=0`` turns it off even with ``HAL_DEVICE=npu-sim`` (hal then
registers the sim on first use, as before), and torch's ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns off every
backend autoload. Unasked, it reads two environment variables and registers nothing: this module imports
only ``os``, and its package's top (:mod:`devices.npu_sim`) only the spec's dataclass base. A failure (a compiler error on the first build, a real torch_npu present) becomes a
``RuntimeWarning``, never an exception: ``import torch`` must keep working.
"""

import os

OPT_IN_ENV = "HAL_NPU_SIM_AUTOLOAD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def wanted(environ=None) -> bool:
    """Whether the environment asks for the sim at ``import torch`` (see the module doc)."""
    environ = os.environ if environ is None else environ
    opt_in = environ.get(OPT_IN_ENV, "").strip().lower()
    if opt_in in _FALSE:
        return False
    if opt_in in _TRUE:
        return True
    return environ.get("HAL_DEVICE", "").strip().lower().partition(":")[0] == "npu-sim"


def autoload() -> None:
    """The ``torch.backends`` entry point: register the sim when :func:`wanted`, else return at once.

    Never raises (except ``KeyboardInterrupt``/``SystemExit``): a failure is reported as a ``RuntimeWarning``
    naming the cause, and torch goes on without the sim.
    """
    if not wanted():
        return
    try:
        from devices import npu_sim

        npu_sim.register()  # also writes and activates npu-smi and the toolkit's version file (cann.activate)
    except Exception as exc:  # noqa: BLE001 - import torch must survive any failure of the sim
        import warnings

        warnings.warn(f"hal npu-sim autoload failed, torch continues without the simulated npu: "
                      f"{type(exc).__name__}: {sim_error_line(exc)}", RuntimeWarning, stacklevel=2)


def sim_error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (a compiler's output can be long)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else ""
