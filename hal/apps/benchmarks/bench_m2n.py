"""Resharding over emulated links: 2 trainer ranks to tensor-parallel rollouts of 2 and 4 ranks, each rank receiving
only its slices (the collective engine's point-to-point pieces), against the whole update delivered to every rank
(the same engine's multi-sender broadcast), same links, one run.

The model is a Qwen2 of ``size_mb`` MiB in bf16 whose 16 heads and 8 key-value heads allow TP 2 and 4; trainer
ranks hold FSDP2's dim-0 rows, rollout ranks the slices the model's tensor-parallel plan gives
(:mod:`hal.apps.weightsync.tp`). Every rank runs in a network namespace with a link of ``R`` each way
(:mod:`hal.apps.links`); a rank checks every byte it received. Time: barrier to barrier, median of ``rounds``.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

import torch

STORE_PORT = 29571  # on trainer rank 0's emulated address; each configuration's engines take the next ports
TRAINERS = 2
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
             vocab_size=32768, tie_word_embeddings=True, max_position_embeddings=2048)
BUCKET = 64 << 20


def model_shapes(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen2 of :data:`MODEL` with enough layers for ``size_bytes`` in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ckpt.layout import named_weights

    def shapes(layers: int) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            module = Qwen2ForCausalLM(Qwen2Config(**MODEL, num_hidden_layers=layers))
        return {n: tuple(t.shape) for n, t in named_weights(module)}

    one, two = (sum(2 * math.prod(s) for s in shapes(n).values()) for n in (1, 2))
    return shapes(max(1, math.ceil((size_bytes - (2 * one - two)) / (two - one))))


def fill(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor ``name``'s bf16 values, the same on every rank (a hash of the name and the index, no randn)."""
    numel = math.prod(shape)
    seed = sum(ord(c) * 31 ** i for i, c in enumerate(name)) % 65521
    bits = ((torch.arange(numel, dtype=torch.int32) % 16381) * 3 + seed) & 0x3F7F  # finite bf16 bit patterns
    return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)


def layouts(shapes: dict[str, tuple[int, ...]], tp: int) -> list[Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hal.apps.weightsync.tp import tp_layout, tp_plan

    plan = tp_plan(Qwen2Config(**MODEL), Qwen2ForCausalLM)
    dtypes = dict.fromkeys(shapes, torch.bfloat16)
    return [tp_layout(shapes, dtypes, plan, r, tp) for r in range(tp)]


class _Targets:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        t = self.tensors.get(name)
        return t if t is not None and t.dtype == dtype and t.shape == shape else None


async def _receive(engine: Any, step: int, targets: dict[str, torch.Tensor]) -> int:
    got = 0
    async for name, tensor in engine.receive_weights(step, placement=_Targets(targets)):
        if tensor.data_ptr() != targets[name].data_ptr():
            targets[name].copy_(tensor)
        got += tensor.numel() * tensor.element_size()
    return got


def _rank(rank: int, world_size: int, net: Any, endpoints: list[str], plan: dict) -> dict:
    import hal
    from ckpt.collective import CollectiveCheckpointEngine
    from ckpt.manager import rank_kwargs
    from ckpt.shards import RowShard, dim0_rows

    net.enter(endpoints[rank])
    addr, timeout = net.address(endpoints[0]), plan["timeout_s"]
    store = hal.connect_store(addr, STORE_PORT, rank, world_size, timeout=timeout)
    group = hal.new_group_from_store(store, rank, world_size, device="cpu", timeout=timeout, prefix="m2n")
    shapes = {n: tuple(s) for n, s in plan["shapes"].items()}
    index = rank - TRAINERS  # a rollout rank's index
    mine = {tp: layouts(shapes, tp)[index] for tp in plan["tps"] if 0 <= index < tp}
    engines: dict[tuple[int, str], Any] = {}
    for i, (tp, mode) in enumerate(plan["configs"]):
        if index < tp:
            engines[(tp, mode)] = CollectiveCheckpointEngine(
                is_master=rank == 0, master_addr=addr, master_port=STORE_PORT + 1 + i, device="cpu", timeout=timeout,
                bucket_size=BUCKET, multi_sender=True, rollout_layout=mine.get(tp) if mode == "m2n" else None)
    if rank == 0:
        for engine in engines.values():  # host every configuration's store before anyone dials it
            engine.prepare()
    for i, (tp, mode) in enumerate(plan["configs"]):
        if (tp, mode) not in engines:
            continue
        master = {"is_master": True, "master_addr": addr, "master_port": STORE_PORT + 1 + i, "generation": 0,
                  "joined": None, "multi_sender": True}
        rollout_md = [{"rollout_layout": lay.to_dict()} if mode == "m2n" else {} for lay in layouts(shapes, tp)]
        per_rank = rank_kwargs(CollectiveCheckpointEngine, TRAINERS, tp, [master, {}] + rollout_md)
        engines[(tp, mode)].init_process_group(**per_rank[rank])
    parts = []
    if rank < TRAINERS:
        for name, shape in shapes.items():
            a, b = dim0_rows(shape[0], TRAINERS, rank)
            parts.append((name, RowShard(fill(name, shape)[a:b].clone(), a, shape)))
    times: dict[str, list[float]] = {}
    received: dict[int, int] = {}
    bad = torch.zeros(1)
    for step, (tp, mode) in enumerate(plan["phases"], 1):
        engine = engines.get((tp, mode))
        if engine is not None and rank >= TRAINERS:
            lay = mine[tp] if mode == "m2n" else None
            targets = ({t: torch.zeros(s, dtype=d) for t, (s, d) in lay.targets.items()} if lay else
                       {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()})
        group.barrier()
        t0 = time.perf_counter()
        if engine is not None and rank < TRAINERS:
            asyncio.run(engine.send_weights(parts, step))
        elif engine is not None:
            nbytes = asyncio.run(_receive(engine, step, targets))
        group.barrier()
        times.setdefault(f"{mode} {tp}", []).append(time.perf_counter() - t0)
        if engine is not None and rank >= TRAINERS:
            if mode == "m2n":
                received[tp] = nbytes
                want = {s.target: torch.zeros(s.target_shape, dtype=s.dtype) for s in lay.slices}
                for s in lay.slices:
                    want[s.target][s.dest.index()] = fill(s.name, shapes[s.name])[s.region.index()]
            else:
                want = {n: fill(n, s) for n, s in shapes.items()}
            if any(not torch.equal(targets[n].view(torch.int16), w.view(torch.int16)) for n, w in want.items()):
                bad[0] = 1
                print(f"rollout rank {index}: wrong bytes after {mode} TP {tp}", flush=True)
        group.all_reduce(bad)
        if bad.item():
            raise RuntimeError(f"a rollout rank received wrong bytes in {mode} TP {tp} (see its line above)")
    for engine in engines.values():
        engine.close()
    group.close()
    return {"times": times, "received": received}


def run(size_mb: int = 256, link_gbit: float | None = 1.0, rounds: int = 2, tps: tuple[int, ...] = (2, 4)) -> dict:
    """Measure each TP's resharded update against the whole model to every rank, over links of ``link_gbit``
    Gbit/s (``None``: loopback). Returns ``{"bytes", "link_gbit", "tp": {T: {"received_fraction",
    "m2n_vs_full", "m2n_s", "full_s"}}}``: ``received_fraction`` the largest rank's bytes over the model's,
    ``m2n_vs_full`` the median of each round's resharded time over its full one (below 1: faster)."""
    import contextlib

    from hal.apps.links import emulated_network
    from hal.apps.multiprocess import run_multiprocess

    shapes = model_shapes(size_mb << 20)
    nbytes = sum(2 * math.prod(s) for s in shapes.values())
    configs = [(tp, mode) for tp in tps for mode in ("m2n", "full")]
    phases = [c for r in range(rounds) for c in (configs if r % 2 == 0 else configs[::-1])]
    rate = (link_gbit or 10.0) * 1e9
    expect = sum(nbytes * 8 * (tp if mode == "full" else 1) / rate for tp, mode in phases)
    plan = {"shapes": shapes, "tps": list(tps), "configs": configs, "phases": phases,
            "timeout_s": max(60.0, 4 * expect / len(phases))}
    endpoints = [f"t{i}" for i in range(TRAINERS)] + [f"r{i}" for i in range(max(tps))]
    network = emulated_network(dict.fromkeys(endpoints, rate)) if link_gbit else contextlib.nullcontext(_Loopback())
    with network as net:
        results = run_multiprocess(_rank, len(endpoints), net, endpoints, plan, timeout=300 + 3 * expect)
    times = results[0]["times"]
    out = {}
    for tp in tps:
        m2n, full = times[f"m2n {tp}"], times[f"full {tp}"]
        got = max(results[TRAINERS + r]["received"][tp] for r in range(tp))
        out[tp] = {"received_fraction": got / nbytes, "m2n_vs_full": statistics.median(a / b for a, b in zip(m2n, full)),
                   "m2n_s": statistics.median(m2n), "full_s": statistics.median(full)}
    return {"bytes": nbytes, "link_gbit": link_gbit, "trainer_ranks": TRAINERS, "rounds": rounds, "tp": out}


class _Loopback:
    """An emulated network's calls where every rank stays on the host's loopback."""

    def enter(self, endpoint: str) -> str:
        return "127.0.0.1"

    def address(self, endpoint: str) -> str:
        return "127.0.0.1"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    link = f"{result['link_gbit']:g} Gbit/s links" if result["link_gbit"] else "loopback"
    table = Table(title=f"resharding: {result['bytes'] / (1 << 20):.0f} MiB bf16 from {result['trainer_ranks']} trainer "
                        f"ranks to a tensor-parallel rollout, {link}",
                  caption="m2n: each rank its slices (point-to-point); full: the whole update to every rank "
                          "(multi-sender broadcast); median of rounds")
    for col in ("TP", "received / model", "m2n s", "full s", "m2n / full"):
        table.add_column(col, justify="right")
    for tp, row in result["tp"].items():
        table.add_row(str(tp), f"{row['received_fraction']:.3f}", f"{row['m2n_s']:.2f}", f"{row['full_s']:.2f}",
                      f"{row['m2n_vs_full']:.2f}")
    Console(width=120).print(table)


__all__ = ["model_shapes", "print_table", "run"]
