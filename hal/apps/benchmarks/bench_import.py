"""How much ``import hal`` adds to ``import torch``: each round a fresh interpreter times both in-process;
the figure is the ratio of the medians, (torch + hal) / torch.

    hal bench --only import --rounds 10
"""

from __future__ import annotations

import statistics
import subprocess
import sys

# python -c PROBE VENDOR_MODULE...: prints torch seconds, hal seconds, whether a vendor module got imported
PROBE = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import hal; "
         "t2 = time.perf_counter(); import sys; print(t1 - t0, t2 - t1, any(m in sys.modules for m in sys.argv[1:]))")


def vendor_modules() -> list[str]:
    """Import names of the vendor packages behind the built-in kinds (their distribution names with ``_``)."""
    import hal
    from devices import BUILTIN_KINDS

    specs = [hal.registry.get_spec(kind) for kind in BUILTIN_KINDS]
    return sorted({s.vendor_package.replace("-", "_") for s in specs if s.vendor_package})


def run(rounds: int = 8, env: dict[str, str] | None = None) -> dict:
    """Median seconds of ``import torch`` and the ``import hal`` after it over ``rounds`` interpreters:
    ``{"torch_s", "hal_s", "ratio", "rounds", "imports_vendor"}``."""
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
