"""An engine resolves its device once, not on every update (issue 30): one update of collective made about 38
registry lookups per process, because ckpt handed kind strings to ``hal.set_device`` and
``hal.synchronize`` on every bucket and thread. The engines keep a :class:`hal.LocalDevice` instead."""

from __future__ import annotations

import asyncio
import collections

import pytest

import ckpt
import hal
from ckpt.testing import finalize_both, same_bytes, sample_weights, transfer, verl_lifecycle
from hal import device as hal_device
from hal import registry

MOST_PER_UPDATE = 2
"""Device resolutions (registry lookups plus ``resolve_device`` calls) allowed per update per process."""


class Resolutions:
    """Counts :func:`hal.registry.get_spec` and :func:`hal.resolve_device` calls while ``counting``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.calls: collections.Counter[str] = collections.Counter()
        for module, name in ((registry, "get_spec"), (hal_device, "resolve_device"), (hal, "resolve_device")):
            monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))

    def _counted(self, name, function):
        def counted(*args, **kwargs):
            if self.counting:
                self.calls[name] += 1
            return function(*args, **kwargs)
        return counted


def _pair(name: str, kind: str, tmp_path):
    """A trainer's and a rollout's engine in this process, each on its own device (index 0 and 1)."""
    if ckpt.checkpoint_engine_says(name, "one_process"):
        engine = ckpt.get_checkpoint_engine(name, timeout=30)
        return engine, engine
    devices = [kind, kind] if hal.resolve_device(kind).host_memory else [f"{kind}:0", f"{kind}:1"]
    built = []
    for is_master, device in zip((True, False), devices):
        kwargs = {"device": device, "timeout": 30}
        if ckpt.checkpoint_engine_says(name, "bucketed"):
            kwargs.update(bucket_size=64 << 10, is_master=is_master)
        if ckpt.checkpoint_engine_says(name, "hosts_rendezvous"):
            kwargs.update(master_addr="127.0.0.1" if is_master else None)
        if ckpt.checkpoint_engine_says(name, "publishes_to_files"):
            kwargs.update(root=tmp_path / "steps")
        built.append(ckpt.get_checkpoint_engine(name, **kwargs))
    return tuple(built)


CASES = [("cpu", "collective"), ("cpu", "ipc"), ("cpu", "file"), ("cpu", "colocated"), ("cpu", "nixl"),
         ("cpu", "mooncake"), ("npu-sim", "collective"), ("npu-sim", "ipc"), ("npu-sim", "file")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_an_update_resolves_the_device_at_most_twice_per_process(kind, name, tmp_path, monkeypatch):
    state = hal.availability(kind)
    if not state:
        pytest.skip(f"{kind}: {state.reason}")
    ok, reason = ckpt.checkpoint_engine_availability(name, kind)
    if not ok:
        pytest.skip(f"{name} on {kind}: {reason}")
    counter = Resolutions(monkeypatch)
    sender, receiver = _pair(name, kind, tmp_path)
    weights = [(n, t.to(hal.get_device(f"{kind}:0" if not hal.resolve_device(kind).host_memory else kind)))
               for n, t in sample_weights(1)]

    async def updates() -> list:
        received = []
        for step in (1, 2, 3):  # the first two set up groups, buffers and connections; the third is counted
            counter.counting = step == 3
            await verl_lifecycle(sender, receiver)
            received = await transfer(sender, receiver, weights, step, step)
            await finalize_both(sender, receiver)
        counter.counting = False
        return received

    try:
        received = asyncio.run(updates())
    finally:
        for engine in {id(sender): sender, id(receiver): receiver}.values():
            getattr(engine, "close", lambda: None)()
    assert [n for n, _ in received] == [n for n, _ in weights]
    assert all(same_bytes(a.cpu(), b.cpu()) for (_, a), (_, b) in zip(weights, received))
    processes = 1 if sender is receiver else 2  # both engines live in this one process: their calls add up
    assert sum(counter.calls.values()) <= MOST_PER_UPDATE * processes, dict(counter.calls)
