"""How the benchmarks start their ranks (the tests' harness, ``hal.apps.multiprocess.run_multiprocess``, spawning): each
rank's return value comes back by rank, a rank that raises or hangs fails the run naming it, and ``hal bench``
says so in one line."""

from __future__ import annotations

import time

import pytest

from hal.apps.benchmarks import bench_import
from ckpt.manager import join_engine
from hal.apps.benchmarks.ranks import launcher_store, run_ranks
from hal.apps.cli.bench import Bench, execute
from hal.apps.errors import WorkerFailedError
from hal.apps.multiprocess import MultiprocessError

pytestmark = pytest.mark.multiprocess


def echo(rank: int, world_size: int, word: str) -> tuple[int, int, str]:
    return rank, world_size, word


def fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def sleeps(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def test_each_rank_runs_once_and_its_value_comes_back_by_rank():
    assert run_ranks(echo, 2, "bench", timeout=60) == {0: (0, 2, "bench"), 1: (1, 2, "bench")}


def test_a_rank_that_raises_fails_the_run_and_hal_bench_names_it(monkeypatch):
    with pytest.raises(MultiprocessError) as info:
        run_ranks(fails_on_rank_1, 2, timeout=60)
    assert list(info.value.failures) == [1] and info.value.failures[1].startswith("ValueError: rank 1 refuses")

    def raises(rounds):
        raise info.value

    monkeypatch.setattr(bench_import, "run", raises)
    with pytest.raises(WorkerFailedError) as cli:
        execute(Bench(device="cpu", only=("import",)))
    assert str(cli.value) == "hal bench: the benchmark rank 1 failed: ValueError: rank 1 refuses"


def test_a_rank_past_its_deadline_fails_the_run_within_it():
    start = time.monotonic()
    with pytest.raises(MultiprocessError) as info:
        run_ranks(sleeps, 1, 300.0, timeout=5)
    assert info.value.failures == {0: "still running at the deadline of 5 s"}
    assert time.monotonic() - start < 60  # the deadline, plus starting an interpreter on a loaded machine


def one_update(rank: int, world_size: int) -> tuple[list[list[int]], list[int]]:
    """Two collective engines formed by verl's lifecycle over the launcher's store, one update through each."""
    import asyncio

    import torch

    import ckpt

    store = launcher_store()
    got, ports, engines = [], [], []
    for i in range(2):  # both open until the end: two live rendezvous, so their ports must differ
        engine = ckpt.get_checkpoint_engine("collective", is_master=rank == 0, master_addr="127.0.0.1",
                                            bucket_size=1 << 16, device="cpu", timeout=60)
        join_engine(engine, rank, world_size, store, f"e{i}")
        weights = [("w", torch.arange(10 * (i + 1), dtype=torch.int32))]

        async def go(engine=engine, weights=weights, step=i + 1):
            if rank == 0:
                await engine.send_weights(iter(weights), global_steps=step)
                return weights[0][1].tolist()
            return [t.tolist() async for _, t in engine.receive_weights(global_steps=step)][0]
        got.append(asyncio.run(go()))
        ports.append(engine.master_port)
        engine.finalize()
        engines.append(engine)
    for engine in engines:
        engine.close()
    return got, ports


def test_engines_form_by_verls_lifecycle_over_the_launchers_store_on_kernel_picked_ports():
    results = run_ranks(one_update, 2, timeout=120)
    assert results[0][0] == results[1][0] == [list(range(10)), list(range(20))]  # the bytes arrived, per engine
    assert results[0][1] == results[1][1] and results[0][1][0] != results[0][1][1]  # a port each, agreed on
