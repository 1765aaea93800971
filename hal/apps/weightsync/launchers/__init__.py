"""Launchers of the weight-sync job: each starts the workers and carries the job's calls to them
(:class:`ckpt.manager.WorkerGroup`): torchrun (one process per worker, the default), colocated (this process),
Ray (actors placed by the kind's Ray resource). The step loop is the same."""

from __future__ import annotations

from typing import Sequence

from hal.apps.weightsync.loop import JobResult, StepHook
from hal.apps.weightsync.options import JobOptions


def launch(options: JobOptions, hooks: Sequence[StepHook] = ()) -> JobResult:
    """Run the job with the launcher ``options`` asks for (Ray, this process for the colocated engine, else
    torchrun); ``hooks`` run around each publish."""
    import ckpt

    if options.rollout == "vllm" and (options.launcher != "torchrun"
                                      or not ckpt.checkpoint_engine_says(options.engine, "receives_inside_vllm")):
        raise ValueError(f"the vLLM rollout runs under the torchrun launcher with an engine that receives inside "
                         f"vLLM ({', '.join(ckpt.checkpoint_engines_where('receives_inside_vllm'))}), got launcher "
                         f"{options.launcher!r}, engine {options.engine!r}")
    if options.launcher == "ray":
        from hal.apps.weightsync.launchers import ray

        return ray.launch(options, hooks)
    if options.colocated:
        from hal.apps.weightsync.launchers import colocated

        return colocated.launch(options, hooks)
    from hal.apps.weightsync.launchers import torchrun

    return torchrun.launch(options, hooks)


__all__ = ["launch"]
