"""Device kinds: the only package that knows which hardware exists.

Each built-in kind is one module holding one ``SPEC`` (a frozen :class:`devices.base.DeviceSpec`).
They are listed here by module path, in automatic-resolution order, and imported only when asked for.
Third-party kinds come from the entry-point group ``hal.devices`` (see :mod:`hal.registry`).

``Availability`` and ``DeviceSpec`` are loaded on first access: torch imports this package inside every
``import torch`` (the sim's autoload entry point, :mod:`devices.npu_sim.autoload`), and unasked that must cost
next to nothing: the sim package's top (its spec on :mod:`devices.base`, whose imports torch has already
made) and nothing of the extension, ``torch.npu`` or ``hccl``.
"""

# kind -> module holding SPEC. Order is the auto-resolution order (npu, cuda, then cpu last);
# npu-sim is never picked automatically (auto_probe=False) and must be asked for.
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
