"""How much ``import hal`` adds to ``import torch``.

Each round runs two fresh interpreters back to back, ``import torch`` and ``import torch, hal``, in
alternating order so drift in machine load hits both; the ratio of the medians is the figure to report.

    python -m benchmarks.bench_import --rounds 10
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time

import tyro


@dataclasses.dataclass
class Args:
    rounds: int = 8
    """Interpreter launches per variant."""
    json: bool = False
    """Print the result as JSON."""


def _time(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def run(rounds: int = 8) -> dict:
    """Median wall seconds of ``import torch`` and ``import torch, hal`` over ``rounds`` launches each.

    Returns:
        ``{"torch_s", "torch_hal_s", "hal_extra_s", "ratio"}``; ratio = torch_hal_s / torch_s.

    Raises:
        ValueError: ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    base, with_hal = [], []
    _time("import torch")  # warm the page cache once
    for i in range(rounds):
        pair = [("import torch", base), ("import torch, hal", with_hal)]
        for code, sink in (pair if i % 2 == 0 else pair[::-1]):
            sink.append(_time(code))
    t, h = statistics.median(base), statistics.median(with_hal)
    return {"torch_s": t, "torch_hal_s": h, "hal_extra_s": h - t, "ratio": h / t, "rounds": rounds}


def main() -> None:
    args = tyro.cli(Args)
    result = run(args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"import torch        {result['torch_s'] * 1e3:8.1f} ms (median of {args.rounds})")
        print(f"import torch, hal   {result['torch_hal_s'] * 1e3:8.1f} ms")
        print(f"hal adds            {result['hal_extra_s'] * 1e3:8.1f} ms  ratio {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
