"""Rank functions for the ipc engine's multi-process tests (run by ``hal.apps.multiprocess.run_multiprocess``).

Rank 0 is the trainer, ranks 1.. the rollouts, each its own process on one host, as verl's hybrid engine runs
them. They meet on the harness's store (``port``): the trainer posts its endpoint, everyone its pid.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import random
import time

import torch

import ckpt
import hal
from ckpt.ipc import default_endpoint
from ckpt.testing import sample_weights


def digest(weights) -> list[tuple[str, str, str, list[int]]]:
    """``(name, sha256 of the bytes, dtype, shape)`` per tensor: what two processes compare."""
    out = []
    for name, t in weights:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append((name, hashlib.sha256(raw).hexdigest(), str(t.dtype), list(t.shape)))
    return out


_STORES: list = []


def meet(rank: int, world_size: int) -> tuple[str, list[int]]:
    """The trainer's endpoint and every rank's pid, through the harness's store (kept for the process's life:
    the trainer hosts it, and the others may still read it)."""
    store = hal.launcher_store(timeout=60)
    _STORES.append(store)
    store.set(f"pid/{rank}", str(os.getpid()))
    if rank == 0:
        store.set("endpoint", default_endpoint())
    endpoint = store.get("endpoint").decode()
    return endpoint, [int(store.get(f"pid/{r}")) for r in range(world_size)]


def trainer_done(rank: int) -> None:
    """The trainer says it is done; a rollout waits for that before it returns (a process that exits right after
    its last reply may take the reply with it: verl's receiver replies last, in its clean-up, and its ZMQ
    context is never terminated, so nothing flushes it)."""
    store = _STORES[-1]
    if rank == 0:
        store.set("trainer-done", "1")
        store.wait(["rollout-done"])  # the trainer hosts the store: it stays until the rollout has read the key
    else:
        store.wait(["trainer-done"])
        store.set("rollout-done", "1")


def engine(rank: int, world_size: int, endpoint: str, pids: list[int], device: str, bucket_size: int,
           timeout: float = 30.0, **extra):
    return ckpt.get_checkpoint_engine("ipc", rank=rank, world_size=world_size, endpoint=endpoint, device=device,
                                      bucket_size=bucket_size, timeout=timeout,
                                      peer_pids=pids[1:] if rank == 0 else [pids[0]], **extra)


def segment_exists(name: str | None) -> bool:
    return name is not None and pathlib.Path("/dev/shm", name).exists()


async def receive_all(eng, step):
    return [(n, t.clone()) async for n, t in eng.receive_weights(step)]


async def exchange(eng, rank: int, steps: int) -> list:
    """Steps 1..``steps``: the trainer's sent digests, or a rollout's received digests, steps and devices."""
    out = []
    for step in range(1, steps + 1):
        if rank == 0:
            weights = sample_weights(step)
            await eng.send_weights(weights, step)
            out.append(digest(weights))
        else:
            got = await receive_all(eng, step)
            out.append({"digest": digest(got), "step": eng.received_global_steps,
                        "devices": sorted({str(t.device) for _, t in got})})
    return out


def updates(rank, world_size, device, steps, bucket_size, transport=None):
    """``steps`` updates of the contract's sample weights (every dtype, one tensor above the bucket); returns the
    trainer's sent digests per step, or a rollout's received digests, steps and device per step, and whether the
    trainer's segment is gone after ``close()``."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, bucket_size, transport=transport)

    result = asyncio.run(exchange(eng, rank, steps))
    segment = eng.segment_name if rank == 0 else None
    eng.close()
    return {"result": result, "transport": eng.transport, "segment": segment,
            "segment_left": segment_exists(segment)}


def rollout_dies(rank, world_size, device):
    """Update 1 whole; in update 2 rollout rank 1 takes one tensor and dies abruptly. The trainer returns
    the error its send raised, the seconds it took, and whether its segment is left in /dev/shm."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, 4096, timeout=60)

    async def go():
        if rank == 0:
            await eng.send_weights(sample_weights(1), 1)
            segment = eng.segment_name
            start = time.monotonic()
            try:
                await eng.send_weights(sample_weights(2), 2)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                        "segment_left": segment_exists(segment), "segment_was": segment is not None}
            return {"error": None}
        await receive_all(eng, 1)
        async for _ in eng.receive_weights(2):
            if rank == 1:
                os._exit(0)  # abrupt, no clean-up (as SIGKILL); exit code 0: the harness waits for the others
        return {"served": eng.received_global_steps}
    return asyncio.run(go())


def trainer_dies(rank, world_size, device):
    """Update 1 whole; in update 2 the trainer dies abruptly after its first buckets went out. The rollout
    applies updates all-or-nothing into its served weights (a staging copy, switched when whole) and returns
    the error, the seconds to it, the step it serves and its weights' digest, and whether the trainer's segment
    is gone from /dev/shm within 10 s."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, 4096, timeout=60)

    def dying():
        for i, item in enumerate(sample_weights(2)):
            if i == 6:
                os._exit(0)  # abrupt, no clean-up (as SIGKILL); exit code 0: the harness waits for the others
            yield item

    async def go():
        if rank == 0:
            await eng.send_weights(sample_weights(1), 1)
            await eng.send_weights(dying(), 2)
            return None
        served = dict(await receive_all(eng, 1))
        served_step = eng.received_global_steps
        segment = eng.segment_name
        start = time.monotonic()
        try:
            staging = dict(await receive_all(eng, 2))
            served, served_step = staging, 2
            error = None
        except Exception as exc:  # noqa: BLE001 - the test reads it
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
        deadline = time.monotonic() + 10
        while segment_exists(segment) and time.monotonic() < deadline:  # the trainer's resource tracker unlinks it
            time.sleep(0.1)
        return {"error": error, "seconds": seconds, "served_step": served_step, "served": digest(served.items()),
                "segment_left": segment_exists(segment)}
    return asyncio.run(go())


def proc_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def many_updates(rank, world_size, device, updates, bucket_size):
    """``updates`` consecutive updates of a small model; samples of open fds, resident bytes and whether the
    trainer's segment name stayed the same after update 10 and at the end."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, bucket_size)
    weights = [(f"w{i}", torch.full((1000 + 37 * i,), float(i), dtype=torch.bfloat16)) for i in range(40)]
    samples = {}

    async def go():
        for step in range(1, updates + 1):
            if rank == 0:
                await eng.send_weights(weights, step)
            else:
                n = 0
                async for _, t in eng.receive_weights(step):
                    n += t.numel() > 0
                if n != len(weights) or eng.received_global_steps != step:
                    raise RuntimeError(f"update {step}: {n} tensors, step {eng.received_global_steps}")
            if step in (10, updates):
                samples[step] = {"fds": proc_fds(), "rss": rss_bytes(), "threads": len(os.listdir("/proc/self/task")),
                                 "segment": eng.segment_name}
    asyncio.run(go())
    segment = eng.segment_name
    eng.close()
    if rank == 0:
        left = segment_exists(segment)
        trainer_done(rank)
    else:
        trainer_done(rank)  # the trainer has closed: its segment must be gone
        left = segment_exists(segment)
    return {"samples": samples, "segment_left": left}


many_updates.start_method = "spawn"  # it measures its own resident memory (see hal.apps.multiprocess.run_multiprocess)


def staged(eng, weights, device) -> list[tuple[str, torch.Tensor]]:
    """``weights`` copied into views of the engine's publish buffer (64-byte aligned, back to back), as a trainer
    that casts its weights straight into it holds them."""
    from ckpt.layout import byte_view
    from ckpt.layout import align

    offsets, end = [], 0
    for _, t in weights:
        offsets.append(align(end))
        end = offsets[-1] + t.numel() * t.element_size()
    buffer = eng.publish_buffer(max(end, 1), hal.get_device(device))
    out = []
    for (name, t), offset in zip(weights, offsets):
        view = byte_view(buffer, offset, t.dtype, t.shape)
        view.copy_(t)
        out.append((name, view))
    return out


def in_place_updates(rank, world_size, device, steps, bucket_size, transient, blocks=0):
    """``steps`` updates staged in the trainer's publish buffer (the contract's sample weights, plus ``blocks``
    tensors of 512 KiB; ``transient``: the engine's ``release_at_finalize``, a new buffer every update); then one
    update with a tensor outside it after the first (refused, the rollouts aborted), then a normal one through
    the buckets. The trainer returns its sent digests, errors, the publish segments it used, and whether the last
    is gone once released; a rollout its received digests (taken as each tensor arrives, nothing kept) and steps,
    and its resident-memory growth over each in-place update (VmHWM, bytes)."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, bucket_size, release_at_finalize=transient)
    dev = hal.get_device(device)

    def weights_of(step):
        g = torch.Generator().manual_seed(step)
        return sample_weights(step) + [(f"block{i}", torch.randint(0, 255, (512 << 10,), dtype=torch.uint8, generator=g))
                                       for i in range(blocks)]

    async def receive_digests(step):
        return [digest([(n, t)])[0] async for n, t in eng.receive_weights(step)]

    async def go():
        out = {"digests": [], "steps": [], "growth": [], "errors": []}
        for step in range(1, steps + 1):
            if rank == 0:
                weights = staged(eng, weights_of(step), device)
                out.setdefault("segments", []).append(eng._publish.segment)
                await eng.send_weights(weights, step)
                out["digests"].append(digest(weights))
                out["bucket_buffer"] = eng._buffer is not None  # an in-place update never allocates it
                eng.finalize()
            else:
                pathlib.Path("/proc/self/clear_refs").write_text("5")
                before = rss_bytes()
                out["digests"].append(await receive_digests(step))
                out["growth"].append(peak_rss_bytes() - before)
                out["steps"].append(eng.received_global_steps)
        # a stray tensor after an in-place first one: refused by the trainer, aborted on the rollouts
        if rank == 0:
            first = staged(eng, weights_of(steps + 1), device)[0]
            try:
                await eng.send_weights([first, ("stray", torch.ones(3, device=dev))], steps + 1)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out["errors"].append(f"{type(exc).__name__}: {exc}")
            weights = sample_weights(steps + 2)
            await eng.send_weights(weights, steps + 2)
            out["digests"].append(digest(weights))
            eng.release_publish_buffer()
            out["segment_left"] = segment_exists(out["segments"][-1])
        else:
            try:
                await receive_digests(steps + 1)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out["errors"].append(f"{type(exc).__name__}: {exc}")
            out["digests"].append(await receive_digests(steps + 2))
            out["steps"].append(eng.received_global_steps)
        return out
    result = asyncio.run(go())
    trainer_done(rank)
    eng.close()
    return result


in_place_updates.start_method = "spawn"  # it measures its own resident memory


def peak_rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def back_to_back(rank, world_size, device, transport, updates, timeout=10.0):
    """``updates`` updates in a row with ``release_at_finalize=True`` (as the job builds every worker), each side
    calling ``finalize()`` after each; returns the errors per update on this side, the updates it verified and
    its seconds. A rollout checks every update's step and values (each tensor filled with the step), then works
    on it for 0 to 10 ms (as a rollout applies and checks an update) before its ``finalize()``."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, device, 8192, timeout=timeout, transport=transport,
                 release_at_finalize=True)
    dev = hal.get_device(device)
    shapes = [(5, 7), (1000,), (3000,), (13,)]  # 12 kB of float32 over buckets of 8 kB: a tensor in slices
    errors, good = [], 0

    async def go():
        nonlocal good
        for step in range(1, updates + 1):
            try:
                if rank == 0:
                    await eng.send_weights([(f"w{i}", torch.full(s, float(step), device=dev))
                                            for i, s in enumerate(shapes)], step)
                    good += 1
                else:
                    got = [(n, t.clone()) async for n, t in eng.receive_weights(step)]
                    if [n for n, _ in got] != [f"w{i}" for i in range(len(shapes))] or not all(
                            bool((t == step).all()) and tuple(t.shape) == s for (_, t), s in zip(got, shapes)):
                        raise RuntimeError(f"update {step} arrived wrong")
                    good += 1
                    time.sleep(random.random() / 100)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"update {step}: {type(exc).__name__}: {exc}")
            finally:
                eng.finalize()
    start = time.monotonic()
    asyncio.run(go())
    seconds = time.monotonic() - start
    trainer_done(rank)
    eng.close()
    return {"errors": errors, "good": good, "seconds": seconds}


def two_jobs(rank, world_size, how, tries, timeout):
    """Two jobs on one explicit endpoint: ranks 0 (trainer) and 1 (rollout) are job A, ranks 2 and 3 job B, which
    starts once A has sent an update. ``how``: ``"lifecycle"`` (verl's prepare / build_topology /
    init_process_group, the master given the endpoint) or ``"job"`` (standalone, each engine given its job's name).
    Each trainer sends ``tries`` updates, its tensor filled with its job's number, A's paced so that B's workers
    run meanwhile; a rollout tries as many (fewer once A is done). Every worker returns its errors (and the seconds
    each took), a rollout the updates it received from each job."""
    from ckpt.manager import join_engine

    store = hal.launcher_store(timeout=120)
    _STORES.append(store)
    job, role = "AB"[rank // 2], rank % 2  # role 0: the trainer
    if rank == 0:
        store.set("endpoint", default_endpoint())
    endpoint = store.get("endpoint").decode()
    if job == "B":
        store.wait(["A-started"])  # A holds the endpoint first
    common = dict(device="cpu", bucket_size=8192, timeout=timeout, release_at_finalize=True)
    if how == "lifecycle":
        eng = ckpt.get_checkpoint_engine("ipc", is_master=role == 0, endpoint=endpoint if role == 0 else None,
                                         **common)
        join_engine(eng, role, 2, store, f"{job}/group")
    else:
        eng = ckpt.get_checkpoint_engine("ipc", rank=role, world_size=2, endpoint=endpoint, job=job, **common)
    out = {"errors": [], "seconds": [], "received": {"A": 0, "B": 0}, "sent": 0}

    async def go():
        for step in range(1, tries + 1):
            start = time.monotonic()
            try:
                if role == 0:
                    await eng.send_weights([("w", torch.full((100,), float("AB".index(job))))], step)
                    out["sent"] += 1
                else:
                    got = [t.clone() async for _, t in eng.receive_weights(None)]
                    out["received"]["AB"[int(got[0][0])]] += 1
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                out["seconds"].append(time.monotonic() - start)
                if role == 1 and store.check(["A-done"]):
                    break  # nothing more comes
            finally:
                eng.finalize()
            if rank == 0 and step == 1:
                store.set("A-started", "1")
                store.wait(["B-ready"])
            if rank == 0:
                await asyncio.sleep(0.05)  # B's workers try meanwhile
    if rank == 2:
        store.set("B-ready", "1")
    asyncio.run(go())
    if rank == 0:
        store.set("A-done", "1")
        store.wait(["B-done"])  # A holds the endpoint while B tries
    elif rank == 2:
        store.wait(["A-done"])  # B's rollout stays exposed to A's trainer until A is done
        store.set("B-done", "1")
    eng.close()
    return out


def mixed_kinds(rank, world_size, devices, steps):
    """``steps`` updates from a trainer on ``devices[0]`` to rollouts on ``devices[1:]``; the trainer returns its
    sent digests, the transport each rollout was served on and its segments; a rollout its received digests and
    devices, and the privateuse1 backend of its process (``"npu"`` once the simulated npu is registered)."""
    endpoint, pids = meet(rank, world_size)
    eng = engine(rank, world_size, endpoint, pids, devices[rank], 8192)

    result = asyncio.run(exchange(eng, rank, steps))
    if rank == 0:
        served = [peer.transport or eng.transport for peer in eng._peers]
        segments = [s.segment for s in (eng._buffer, eng._mirror) if s is not None]
        eng.close()
        trainer_done(rank)
        return {"sent": result, "served": served, "transport": eng.transport, "segments": segments,
                "segments_left": [s for s in segments if segment_exists(s)]}
    trainer_done(rank)
    eng.close()
    return {"received": result, "backend": torch._C._get_privateuse1_backend_name()}
