"""Weights published as safetensors files, one directory per ``global_steps``, by atomic rename."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, check_seconds, named_tensors
from ckpt.errors import CheckpointConfigError, TransferError, TransferTimeoutError, VersionMismatchError
from ckpt.outcome import DirectoryBoard, Reports, ReportsOnBoard

_STEP_DIR = re.compile(r"^step-(\d+)$")
INDEX = "index.json"
REPORTS = ".reports"  # The folder under root where rollouts promise and give their word on each step.


def step_dir_name(step: int) -> str:
    """Return a step's directory name, zero padded so a plain listing sorts by step (``step-00000007``)."""
    return f"step-{step:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileCheckpointEngine(ReportsOnBoard, CheckpointEngine):
    """Publishes each update as ``<root>/step-<global_steps>/``: safetensors shards and ``index.json``.

    A step is written under a hidden name and renamed into place (atomic), then all but the newest
    ``keep_last`` are pruned; a reader opens every shard before yielding, so pruning does not disturb it.
    Order and ownership: tensors arrive in send order; each yielded tensor is freshly loaded and the receiver's.
    ``send_weights`` copies tensors to the host, at most ``shard_size`` bytes before writing. ``device``: where
    received tensors go (``None``: host memory). ``timeout``: seconds a receive waits for its step (0: do not
    wait); ``poll_interval``: seconds between listings."""

    send_buffer_words = "the update's host copies (one shard, at most the update)"
    ranks_may_share_a_device = True  # files: no communicator between the processes
    publishes_to_files = True

    @classmethod
    def send_buffer_bytes(cls, bucket_size: int, published_bytes: int) -> dict[str, int]:
        return {"host_copies_bytes": published_bytes}

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, device=None, shard_size: int = 1 << 30,
                 timeout: float = 60.0, poll_interval: float = 0.05, bucket_size: int | None = None,
                 is_master: bool = False) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointConfigError(f"keep_last must be an int >= 1, got {keep_last!r}")
        if not isinstance(shard_size, int) or shard_size < 1:
            raise CheckpointConfigError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
        self.root = Path(root)
        self.keep_last, self.shard_size = keep_last, shard_size
        self.timeout = check_seconds(timeout, "timeout", allow_zero=True)
        self.poll_interval = check_seconds(poll_interval, "poll_interval")
        self._device = device
        self._local = None
        self.bucket_size, self.is_master = bucket_size, bool(is_master)
        self.reporter = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"  # names this rollout in its reports
        self._board = DirectoryBoard(self.root / REPORTS, poll_interval, label=lambda who: f"rollout {who}")
        self._reports = Reports(self._board.label, "the trainer")
        self._reports.bind(self._board, self.reporter)

    def published_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))

    def _target_device(self) -> torch.device:
        if self._device is None:
            return torch.device("cpu")
        if self._local is None:  # resolved on the first receive (a sender never needs it), then kept
            import hal

            self._local = hal.resolve_local_device(self._device)
        return self._local.bind()

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None, *,
                           check: Any = False) -> None:
        """Write ``weights`` as step ``global_steps`` (``None``: newest published + 1, or 0), publish, prune, then
        wait ``timeout`` for the word of every rollout that promised one (:mod:`ckpt.outcome`, ``check``).

        Published steps only grow: a step at or below the newest is refused (:class:`CheckpointConfigError` naming
        the newer directories) before anything is written. A failed write publishes nothing."""
        global_steps = check_global_steps(global_steps)
        self.root.mkdir(parents=True, exist_ok=True)
        steps = self.published_steps()
        if global_steps is None:
            global_steps = steps[-1] + 1 if steps else 0
        final = self.root / step_dir_name(global_steps)
        if final.exists():
            raise CheckpointConfigError(f"global_steps={global_steps} is already published at {final}")
        if steps and global_steps < steps[-1]:
            newer = [step_dir_name(s) for s in steps if s > global_steps]
            raise CheckpointConfigError(
                f"global_steps={global_steps} is below the newest step published in {self.root}, "
                f"global_steps={steps[-1]}; published steps only grow (readers of step {global_steps} would be "
                f"told {steps[-1]} is on offer, and pruning would delete it at once). To republish from an "
                f"older checkpoint, publish into a fresh root or remove {', '.join(newer)} from {self.root} first")
        tmp = self.root / f".tmp-{step_dir_name(global_steps)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        reporting = bool(self._board.list("report/promise"))  # some reader reports: who reads this step, below
        pending = self._reports.begin(None if reporting else [], global_steps, check, n=global_steps)
        try:
            order: list[tuple[str, str]] = []
            shard: dict[str, torch.Tensor] = {}
            shard_index = size = 0
            for name, tensor in pending.watch(named_tensors(weights, unique=True)):
                # a private contiguous host copy: safetensors refuses shared or strided storage
                shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
                order.append((name, self._shard_name(shard_index)))
                size += shard[name].numel() * shard[name].element_size()
                if size >= self.shard_size:
                    await self._write_shard(tmp / self._shard_name(shard_index), shard, global_steps)
                    shard, size, shard_index = {}, 0, shard_index + 1
            if shard:
                await self._write_shard(tmp / self._shard_name(shard_index), shard, global_steps)
            (tmp / INDEX).write_text(json.dumps({"global_steps": global_steps, "tensors": order}))
            await asyncio.to_thread(self._publish, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        if reporting:
            pending.waiting = self._readers(global_steps)
        try:
            self.outcomes = await pending.collect(self.timeout)
        finally:
            self._board.tidy()

    def _readers(self, step: int) -> list[str]:
        """The reporting readers that read ``step``: those reading now for it (or the newest), those that reported it."""
        readers = []
        for who in self._board.list("report/reading"):
            asked = self._board.get(f"report/reading/{who}")
            if asked is not None and json.loads(asked) in (None, step):
                readers.append(who)
        posted = [w for w in self._board.list(f"report/{step}") if w not in ("update", "expect", "count")]
        return sorted(set(readers) | set(posted))

    # ---- the rollouts' words on each step (ckpt.outcome): files under root/.reports -----------------
    def report_outcome(self, error: BaseException | None = None, live: Any = None) -> None:
        super().report_outcome(error, live)
        self._board.delete(f"report/reading/{self.reporter}")

    def close(self) -> None:
        """Withdraw this rollout's promise to report (a sender stops waiting for it)."""
        self._reports.withdraw()
        self._board.tidy()

    @staticmethod
    def _shard_name(index: int) -> str:
        return f"shard-{index:05d}.safetensors"

    @staticmethod
    async def _write_shard(path: Path, shard: dict[str, torch.Tensor], step: int) -> None:
        await asyncio.to_thread(save_file, shard, str(path), {"global_steps": str(step)})

    @staticmethod
    def _publish(tmp: Path, final: Path) -> None:
        for p in tmp.iterdir():
            _fsync(p)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(final.parent)

    def _prune(self) -> None:
        for step in self.published_steps()[:-self.keep_last]:
            path = self.root / step_dir_name(step)
            trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, trash)
            except FileNotFoundError:  # another writer pruned it first
                continue
            shutil.rmtree(trash, ignore_errors=True)
            shutil.rmtree(self.root / REPORTS / "report" / str(step), ignore_errors=True)  # words nobody collected

    async def _choose(self, global_steps: int | None) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            steps = self.published_steps()
            if global_steps is not None:
                if global_steps in steps:
                    return global_steps
                if steps and steps[-1] > global_steps:  # steps only grow: N will never appear
                    raise VersionMismatchError(global_steps, steps[-1], f"{self.root} (published: {steps})")
            else:
                newer = [s for s in steps if self.received_global_steps is None or s > self.received_global_steps]
                if newer:
                    return newer[-1]
            if time.monotonic() >= deadline:
                if global_steps is not None:
                    raise TransferTimeoutError(
                        f"step global_steps={global_steps} was not published in {self.root} within the timeout "
                        f"of {self.timeout:g} s (published: {steps}); is the trainer sending it?")
                raise TransferTimeoutError(
                    f"no step newer than {self.received_global_steps} was published in {self.root} "
                    f"within {self.timeout:g} s (published: {steps})")
            await asyncio.sleep(self.poll_interval)

    async def receive_weights(self, global_steps: int | None = None, *,
                              placement: Any = None) -> AsyncIterator[NamedTensor]:
        """Yield step ``global_steps`` (``None``: the newest newer than the last received), waiting up to ``timeout``.

        The step counts as received once its first tensor is yielded, unless the stream is closed early.
        ``placement`` is ignored. A newer step published raises :class:`VersionMismatchError` at once."""
        global_steps = check_global_steps(global_steps)
        if self._reports.armed():  # a reporting reader: a sender publishing the step it waits for waits for its word
            self._board.put(f"report/reading/{self.reporter}", json.dumps(global_steps).encode())
        for _attempt in range(3):  # the chosen step may be pruned between listing and opening
            step = await self._choose(global_steps)
            path = self.root / step_dir_name(step)
            try:
                index = json.loads((path / INDEX).read_text())
                files = {f: safe_open(str(path / f), framework="pt") for f in sorted({f for _, f in index["tensors"]})}
                break
            except FileNotFoundError:
                continue
        else:
            raise TransferError(f"step {step} in {self.root} disappeared three times while being opened")
        for f, handle in files.items():
            tagged = (handle.metadata() or {}).get("global_steps")
            if index.get("global_steps") != step or tagged != str(step):
                raise TransferError(f"{path / f} is tagged global_steps={tagged}, index={index.get('global_steps')}, "
                                    f"expected {step}")
        before, self.received_global_steps = self.received_global_steps, step
        self._reports.take(step, n=step)
        device = self._target_device()
        finished = False
        try:
            for name, f in index["tensors"]:
                tensor = files[f].get_tensor(name)
                yield name, tensor.to(device)  # the tensor itself when already there
            finished = True
        finally:
            if not finished and self.received_global_steps == step:
                self.received_global_steps = before  # closed early: not received
