"""``hal soak``: the weight-sync job for many updates while a seeded fault injector kills, stops, corrupts,
cuts and fills at random moments, and a checker reads the whole history afterwards.

:mod:`.faults` (kinds and the seeded plan), :mod:`.strike` (inside a worker), :mod:`.procs` and :mod:`.child`
(a process per worker), :mod:`.sandbox` (namespaces), :mod:`.options` and :mod:`.run` (the driver),
:mod:`.checker` (the rules). Submodules are imported on use.
"""

from __future__ import annotations


def __getattr__(name: str):
    """``soak`` and ``SoakOptions``, from :mod:`.run` on first use."""
    if name in ("soak", "SoakOptions"):
        from hal.apps.soak import run

        return getattr(run, name)
    raise AttributeError(f"module 'hal.apps.soak' has no attribute {name!r}")


__all__ = ["SoakOptions", "soak"]
