"""Device kinds: the only package that knows which hardware exists.

Each built-in kind is one module holding one ``SPEC``, imported only when asked for; third-party kinds come
from the ``hal.devices`` entry points. ``import torch`` imports this package (npu-sim's autoload), so
``Availability`` and ``DeviceSpec`` load lazily.
"""

# kind -> module holding SPEC, in auto-resolution order; npu-sim must be asked for (auto_probe=False).
BUILTIN_KINDS: dict[str, str] = {
    "npu": "devices.npu",
    "cuda": "devices.cuda",
    "npu-sim": "devices.npu_sim",
    "cpu": "devices.cpu",
}

# The kind automatic resolution falls back to, always available; plugin kinds are tried before it.
FALLBACK_KIND = "cpu"

__all__ = ["Availability", "DeviceSpec", "BUILTIN_KINDS", "FALLBACK_KIND"]


def __getattr__(name: str):
    if name in ("Availability", "DeviceSpec"):
        from devices import base

        return getattr(base, name)
    raise AttributeError(f"module 'devices' has no attribute {name!r}")
