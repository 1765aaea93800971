"""Activate the simulated npu inside ``import torch``, before any consumer's first import.

:func:`autoload` is a ``torch.backends`` entry point (as torch_npu's), so processes started by torchrun,
multiprocessing or Ray have ``torch.npu``, ``hccl`` and ``import torch_npu`` from their first ``import torch``.
It acts only with ``HAL_DEVICE=npu-sim[:i]`` or ``HAL_NPU_SIM_AUTOLOAD=1`` (``=0`` turns it off), also writing
the CANN answers (:mod:`devices.npu_sim.cann`); unasked it imports only ``os``. A failure becomes a
``RuntimeWarning``: ``import torch`` must keep working.
"""

import os

OPT_IN_ENV = "HAL_NPU_SIM_AUTOLOAD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def wanted(environ=None) -> bool:
    """Return whether the environment asks for the sim at ``import torch``."""
    environ = os.environ if environ is None else environ
    opt_in = environ.get(OPT_IN_ENV, "").strip().lower()
    if opt_in in _FALSE:
        return False
    if opt_in in _TRUE:
        return True
    return environ.get("HAL_DEVICE", "").strip().lower().partition(":")[0] == "npu-sim"


def autoload() -> None:
    """Register the sim when :func:`wanted` (the ``torch.backends`` entry point); failures become a RuntimeWarning."""
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
    """Return the first line of ``exc``'s message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else ""
