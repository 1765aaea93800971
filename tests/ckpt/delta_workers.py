"""Helpers and process bodies of the delta weight-sync tests (module level, so spawned ranks import them).

A small bf16-published model trained by AdamW, with NaN and -0.0 planted in what is published, a rollout
that applies delta flushes, and a trainer that can flip one byte of a flush in transit.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import hal
from ckpt.testing import standalone_engine
from ckpt.delta import DeltaReceiver, DeltaRefusedError, DeltaSender, delta_send, receive_delta, wire_tensors

STEPS = 20
CORRUPT_STEP = 8   # a byte of this step's first flush is flipped in transit
RESTART_STEP = 14  # the rollout restarts (fresh weights, fresh receiver) before this step


def make_trainer(seed: int = 0, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 master weights of three Linear layers (about 33k parameters) and their AdamW (lr 1e-5: about 5%
    of the bf16 values change per step)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One AdamW step on a fixed regression batch of ``step``'s seed."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=gen).to(next(model.parameters()).device)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def published(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """The bf16 tensors published at ``step``, with NaN, -0.0 and +0.0 planted at fixed places from step 3
    (their bits change from step to step: a NaN appears, a -0.0 turns into +0.0 and back)."""
    out = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    if step >= 3:
        w = out["0.weight"].view(-1)
        w[11] = float("nan")
        w[12] = -0.0 if step % 2 else 0.0
        out["2.bias"].view(-1)[5] = float("nan") if step % 3 == 0 else -0.0
    return out


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 of each tensor's raw bytes (host copy), by name."""
    return {n: zlib.crc32(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for n, t in sorted(tensors.items())}


def fresh_rollout(device: torch.device | str, seed: int = 99) -> dict[str, torch.Tensor]:
    """A rollout's own bf16 weights before any update (random: not the trainer's)."""
    model, _ = make_trainer(seed, device)
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}


def flip_one_byte(pairs: Iterable[tuple[str, torch.Tensor]], key: str = "__values__",
                  flush: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass wire tensors through, flipping all bits of the middle byte of flush ``flush``'s ``key``."""
    for name, tensor in pairs:
        if name == f"__delta_flush__/{flush}/{key}":
            raw = tensor.clone().view(torch.uint8)
            raw[raw.numel() // 2] ^= 0xFF
            tensor = raw.view(tensor.dtype)
        yield name, tensor


async def send_corrupted(engine: Any, weights: dict[str, torch.Tensor], step: int, sender: DeltaSender):
    """:func:`delta_send` with one byte of the first flush's values flipped on its way to the engine."""
    await engine.send_weights(flip_one_byte(wire_tensors(sender.flushes(weights.items(), step))), global_steps=step)
    return sender.commit()


def collective_engine(rank: int, world_size: int, device: str) -> Any:
    """The collective engine of one rank of a local group, meeting on the harness's store."""
    return standalone_engine("collective", rank, world_size, hal.launcher_store(timeout=60), device=device,
                             timeout=60, bucket_size=64 << 10)


def trainer_steps(engine: Any, device: torch.device, kind: str = "cpu", steps: int = STEPS,
                  flush_bytes: int = 32 << 10,
                  corrupt_step: int | None = CORRUPT_STEP, restart_step: int | None = RESTART_STEP):
    """The trainer's loop (a coroutine) on device kind ``kind``: train, publish as a delta, report per step.

    It plays the job's part on a rollout's failure: after the corrupted step and at the restart it
    ``reseed()``s. Returns ``[(step, seed, changed_fraction, sent_bytes, dense_bytes, digest)]`` and
    the snapshot's bytes.
    """
    async def run():
        model, opt = make_trainer(0, device)
        sender = DeltaSender(flush_bytes=flush_bytes, device=kind)
        if device.type != "cpu" and not sender.pin:
            raise AssertionError(f"the snapshot of a {kind} sender is not pinned")
        rows = []
        for step in range(1, steps + 1):
            if step > 1:
                train_step(model, opt, step)
            weights = published(model, step)
            if step == restart_step:
                sender.reseed("rollout restarted")
            if step == corrupt_step:
                stats = await send_corrupted(engine, weights, step, sender)
                sender.reseed(f"the rollout refused step {step}")  # what the rollout's report makes the job do
            else:
                stats = await delta_send(engine, weights.items(), step, sender)
            rows.append((step, stats.seed, stats.changed_fraction, stats.sent_bytes, stats.dense_bytes,
                         digest(weights)))
        return rows, sender.snapshot_bytes
    return run()


def rollout_steps(engine: Any, device: torch.device, atomic: bool, steps: int = STEPS,
                  restart_step: int | None = RESTART_STEP):
    """The rollout's loop (a coroutine): apply each update, report ``(step, served, refusal, degraded,
    digest)``; at ``restart_step`` it starts over with fresh weights and a fresh receiver."""
    async def run():
        params = fresh_rollout(device)
        receiver = DeltaReceiver(params, atomic=atomic)
        rows = []
        for step in range(1, steps + 1):
            if step == restart_step:
                params = fresh_rollout(device, seed=7)
                receiver = DeltaReceiver(params, atomic=atomic)
            refusal = None
            try:
                await receive_delta(engine, receiver, step)
            except DeltaRefusedError as exc:
                refusal = f"{type(exc).__name__}: {exc}"
            rows.append((step, receiver.served_step, refusal, receiver.degraded, digest(params)))
        return rows
    return run()


def collective_run(rank: int, world_size: int, device: str, atomic: bool) -> Any:
    """Rank 0 trains and publishes 20 steps as deltas through the collective engine; rank 1 applies them."""
    engine = collective_engine(rank, world_size, device)
    dev = hal.get_device(device)
    try:
        if rank == 0:
            return asyncio.run(trainer_steps(engine, dev, device))
        return asyncio.run(rollout_steps(engine, dev, atomic))
    finally:
        engine.close()


def check_run(trainer: tuple[list, int], rollout: list, atomic: bool, steps: int = STEPS,
              corrupt_step: int | None = CORRUPT_STEP, restart_step: int | None = RESTART_STEP) -> list[float]:
    """Assert a :func:`trainer_steps` / :func:`rollout_steps` pair: every step served bit-exact (the
    published bf16 bytes, by CRC-32), except the corrupted one: refused, the previous step still served
    (atomic; in place too when the corrupted flush was the first, else the rollout is degraded); seeds
    exactly at step 1, after the refusal and at the restart, deltas otherwise. Returns the changed fraction of each delta step."""
    rows, snapshot_bytes = trainer
    assert len(rows) == len(rollout) == steps
    assert snapshot_bytes == rows[0][4]  # the snapshot holds the published bf16 bytes
    seeds = {1} | ({corrupt_step + 1} if corrupt_step else set()) | ({restart_step} if restart_step else set())
    fractions = []
    for (step, seed, fraction, sent, dense, want), (rstep, served, refusal, degraded, got) in zip(rows, rollout):
        assert step == rstep
        assert seed == (step in seeds), (step, seed)
        if step == corrupt_step:
            assert refusal is not None and "DeltaChecksumError" in refusal, refusal
            assert served == step - 1
            previous = rows[step - 2][5]
            if atomic:
                assert not degraded and got == previous, "the previous step is no longer served"
            else:  # in place: degraded exactly when a flush before the corrupted one was written
                assert degraded == (got != previous), (degraded, got == previous)
            continue
        assert refusal is None, (step, refusal)
        assert served == step and not degraded
        assert got == want, f"step {step}: tensors differ: {[n for n in want if want[n] != got.get(n)]}"
        if not seed:
            fractions.append(fraction)
            assert 0 < fraction < 0.9 and sent < dense, (step, fraction, sent, dense)
    return fractions
