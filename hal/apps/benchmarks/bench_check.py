"""The weight checker's cost (:mod:`ckpt.checker`): digesting a model's parameters where they live, as a ratio of
one copy of the model (every parameter copied into a buffer of its own), medians measured side by side.

    hal bench --only check --device npu-sim --quick
"""

from __future__ import annotations

import statistics
import time

import torch

import hal

GOAL = 1.5  # check_vs_memcpy at most this: a checked update costs at most one and a half copies of the model


def model_parameters(size_mb: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bf16 parameters of ``bench_offload``'s transformer-like model of about ``size_mb`` MiB, on ``device``."""
    from hal.apps.benchmarks.bench_offload import make_model

    model = make_model(2 * size_mb)  # fp32 of 2x the size: bf16 of the size
    g = torch.Generator().manual_seed(0)
    return [(n, torch.randn(p.shape, generator=g).to(device=device, dtype=torch.bfloat16))
            for n, p in model.named_parameters()]


def run(size_mb: int, device: str, rounds: int = 3) -> dict:
    """Median seconds of one model copy and of :func:`ckpt.checker.digests` over ``rounds`` each, alternated:
    ``{"device", "bytes", "tensors", "memcpy_s", "check_s", "check_vs_memcpy", "goal", "rounds"}``."""
    from ckpt.checker import digests

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = hal.get_device(device)
    params = model_parameters(size_mb, dev)
    copies = [torch.empty_like(t) for _, t in params]

    def memcpy() -> None:
        for (_, t), c in zip(params, copies):
            c.copy_(t)

    def check() -> None:
        digests(params)  # read back: the digests are on the host once it returns

    timed: dict[str, list[float]] = {"memcpy": [], "check": []}
    for fn in (memcpy, check):  # a warm-up of each
        fn()
    hal.synchronize(device)
    for _ in range(rounds):
        for name, fn in (("memcpy", memcpy), ("check", check)):
            start = time.perf_counter()
            fn()
            hal.synchronize(device)
            timed[name].append(time.perf_counter() - start)
    memcpy_s, check_s = statistics.median(timed["memcpy"]), statistics.median(timed["check"])
    return {"device": str(dev), "bytes": sum(t.numel() * t.element_size() for _, t in params), "tensors": len(params),
            "memcpy_s": memcpy_s, "check_s": check_s, "check_vs_memcpy": check_s / memcpy_s, "goal": GOAL,
            "rounds": rounds}


def print_table(result: dict) -> None:
    """The figures of :func:`run`: both medians, their ratio against the goal."""
    mb = result["bytes"] / 1e6
    print(f"weight check on {result['device']}: {result['tensors']} tensors, {mb:.0f} MB (median of {result['rounds']})")
    print(f"one copy of the model     {result['memcpy_s'] * 1e3:8.1f} ms")
    print(f"digests of the model      {result['check_s'] * 1e3:8.1f} ms")
    verdict = "within" if result["check_vs_memcpy"] <= result["goal"] else "ABOVE"
    print(f"check_vs_memcpy           {result['check_vs_memcpy']:8.2f}   ({verdict} the goal of {result['goal']:g})")
