"""How much ``import hal`` adds to ``import torch``.

Each round starts a fresh interpreter that times ``import torch`` and then ``import hal`` with
``time.perf_counter`` inside the process, so both figures come from the same process and start-up noise
of the interpreter itself is left out. The ratio of the medians, (torch + hal) / torch, is the figure to
report; ``hal_ms`` is what ``import hal`` costs once torch is loaded.

    hal bench --only import --rounds 10
"""

from __future__ import annotations

import statistics
import subprocess
import sys

PROBE = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import hal; "
         "t2 = time.perf_counter(); import sys; print(t1 - t0, t2 - t1, any(m in sys.modules for m in sys.argv[1:]))")
"""Run as ``python -c PROBE VENDOR_MODULE...``; prints torch seconds, hal seconds, and whether any of the
named vendor modules was imported by then."""


def vendor_modules() -> list[str]:
    """Import names of the vendor packages behind the built-in kinds (their distribution names with ``_``)."""
    import hal
    from devices import BUILTIN_KINDS

    specs = [hal.registry.get_spec(kind) for kind in BUILTIN_KINDS]
    return sorted({s.vendor_package.replace("-", "_") for s in specs if s.vendor_package})


def run(rounds: int = 8, env: dict[str, str] | None = None) -> dict:
    """Median seconds of ``import torch`` and of the ``import hal`` that follows, over ``rounds`` interpreters.

    Returns:
        ``{"torch_s", "hal_s", "ratio", "rounds", "imports_vendor"}``; ratio = (torch_s + hal_s) / torch_s;
        imports_vendor is True if any round found a vendor package (:func:`vendor_modules`) imported by
        then. ``env``: the interpreters' environment (default: this process's).

    Raises:
        ValueError: ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    torch_s, hal_s, vendor = [], [], False
    command = [sys.executable, "-c", PROBE, *vendor_modules()]
    for _ in range(rounds):
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
        a, b, v = out.stdout.split()
        torch_s.append(float(a))
        hal_s.append(float(b))
        vendor |= v == "True"
    t, h = statistics.median(torch_s), statistics.median(hal_s)
    return {"torch_s": t, "hal_s": h, "ratio": (t + h) / t, "rounds": rounds, "imports_vendor": vendor}


def print_table(result: dict) -> None:
    """The figures of :func:`run`: both medians in ms, the ratio, and whether a vendor package was imported."""
    print(f"import torch              {result['torch_s'] * 1e3:8.1f} ms (median of {result['rounds']})")
    print(f"import hal after torch    {result['hal_s'] * 1e3:8.1f} ms")
    print(f"ratio (torch + hal)/torch {result['ratio']:8.3f}   vendor plugin imported: {result['imports_vendor']}")
