"""``hal soak``: the weight-sync job for many updates while a seeded fault injector kills, stops, corrupts,
cuts and fills at random moments, and a checker reads the whole history afterwards.

* :mod:`.faults`: the fault kinds, their moments, which an engine and a machine can produce, the seeded plan;
* :mod:`.strike`: inside a worker, the engine that strikes at the moment and the host that reports what the
  worker published, served and holds;
* :mod:`.procs` and :mod:`.child`: one process per worker, killed, stopped and restarted by the driver;
* :mod:`.sandbox`: the run's scratch directory, private ``/dev/shm`` and disk, emulated network;
* :mod:`.options` and :mod:`.run`: a run's options (:class:`~hal.apps.soak.options.SoakOptions`) and its driver
  (:func:`~hal.apps.soak.run.soak`);
* :mod:`.checker`: the rules every run is judged by, and the replay command of a failure.

Submodules are imported on use: ``import hal.apps.soak`` imports neither torch nor ckpt.
"""

from __future__ import annotations


def __getattr__(name: str):
    """``soak`` and ``SoakOptions``, from :mod:`.run` on first use."""
    if name in ("soak", "SoakOptions"):
        from hal.apps.soak import run

        return getattr(run, name)
    raise AttributeError(f"module 'hal.apps.soak' has no attribute {name!r}")


__all__ = ["SoakOptions", "soak"]
