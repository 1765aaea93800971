"""What every process of the job hosts: one role (trainer or rollout) with its checkpoint engine, reached
through :meth:`Worker.invoke`, the one entry point every launcher calls."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ckpt.manager import LIFECYCLE_METHODS, ManagedWorker
from hal.apps.weightsync.options import JobOptions

if TYPE_CHECKING:
    from hal.apps.weightsync.messages import Checked, Reference

@dataclasses.dataclass
class Where:
    """Where a worker runs: its index (0: the trainer; 1..R: rollout rank), node, process and device."""

    index: int
    node_ip: str
    pid: int
    device: str
    resource: str | None = None
    device_id: str | None = None


def describe_worker(index: int, where: Where | None, trainers: int = 1) -> str:
    """A worker in words (``"trainer rank 1"``, ``"rollout rank 2"``), then where it runs when known."""
    role = ("trainer" if trainers == 1 else f"trainer rank {index}") if index < trainers else f"rollout rank {index}"
    if where is None:
        return role
    device = f"{where.resource} {where.device_id}" if where.resource else where.device
    return f"{role} on node {where.node_ip}, {device}, pid {where.pid}"


def make_engine(options: JobOptions, index: int, node_ip: str) -> Any:
    """Worker ``index``'s checkpoint engine, built as verl's registry builds one, with the keywords its class's
    facts call for (bucket, master, multi_sender, file root, device)."""
    import ckpt

    def says(fact: str) -> bool:
        return ckpt.checkpoint_engine_says(options.engine, fact)

    if says("one_process"):
        return ckpt.get_checkpoint_engine(options.engine, timeout=options.timeout)
    kwargs: dict[str, Any] = {"timeout": options.timeout, "device": options.device_of(index)}
    if says("bucketed"):
        kwargs.update(bucket_size=options.bucket_bytes, is_master=index == 0)
    if says("hosts_rendezvous"):
        kwargs.update(master_addr=node_ip if index == 0 else None)
    every_rank_sends = says("supports_multi_sender") or (options.resharded and says("supports_reshard"))
    if every_rank_sends and options.sharded and index < options.trainer_ranks:
        kwargs.update(multi_sender=True)
    if says("stages_in_shared_memory"):
        kwargs.update(release_at_finalize=True)
    if says("publishes_to_files"):
        if options.file_root is None:
            raise ValueError(f"the {options.engine} engine publishes to files and needs options.file_root (a "
                             f"directory), got None")
        kwargs.update(root=options.file_root, keep_last=2)
    return ckpt.get_checkpoint_engine(options.engine, **kwargs)


class Worker(ManagedWorker):
    """One role (index 0 the trainer, else the rollout's rank) and its checkpoint engine."""

    def __init__(self, options: JobOptions, index: int, engine: Any, where: Where | None = None) -> None:
        self.options, self.index, self.engine = options, index, engine
        self.kind = options.device_of(index)  # a kind, or with --hybrid the device this rank shares
        self.whereabouts = where or Where(index, "127.0.0.1", os.getpid(), options.device)
        self.addons: dict[type, Any] = {}

    def where(self) -> Where:
        """Where this worker runs."""
        return self.whereabouts

    def execute_checkpoint_engine(self, method: str, **kwargs: Any) -> Any:
        """Call one of the engine's synchronous lifecycle methods (verl's worker method of the same name)."""
        if method not in LIFECYCLE_METHODS:
            raise ValueError(f"method must be a lifecycle method of the checkpoint engine {LIFECYCLE_METHODS}, "
                             f"got {method!r}")
        if method == "close" and not hasattr(self.engine, "close"):
            return None
        return getattr(self.engine, method)(**kwargs)

    def attach(self, addon_cls: type, *args: Any) -> None:
        """Attach an add-on (``addon_cls(self, *args)``), whose methods :meth:`invoke` then runs."""
        self.addons[addon_cls] = addon_cls(self, *args)

    def invoke_targets(self) -> list[Any]:
        """This worker, then its add-ons: :meth:`invoke` runs a method of any of them."""
        return [self, *self.addons.values()]

    def raw_buffer(self) -> Any:
        """A device buffer of the published bytes' size that a raw broadcast may overwrite or read."""
        raise NotImplementedError


class RolloutRole(Worker):
    """A rollout rank: its update (:meth:`update_weights`) and the proof of what it serves (:meth:`check`)."""

    def check(self, global_steps: int, reference: Reference) -> Checked:
        """What this rollout proves after receiving ``global_steps``, against the trainer's ``reference``."""
        raise NotImplementedError


__all__ = ["RolloutRole", "Where", "Worker", "describe_worker", "make_engine"]
