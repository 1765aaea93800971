"""The simulated npu's resident cache: free blocks keep at most ``HAL_SIM_CACHE_RESIDENT_MB`` of host pages,
the least recently freed give theirs back first, a request takes a resident block over a dropped one, and
device blocks are mapped on 2 MiB boundaries, with transparent huge pages asked for under HAL_SIM_HUGE_PAGES=1.

Each case runs in a fresh process, since the limit is read once per process and the counters of
``torch.npu.host_cache_stats`` add up over its life.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import hal

REPO = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20

pytestmark = [
    pytest.mark.skipif(not hal.availability("npu-sim"),
                       reason=f"npu-sim unavailable: {hal.availability('npu-sim').reason}"),
    pytest.mark.skipif(not pathlib.Path("/proc/self/statm").exists(), reason="needs Linux /proc"),
]

PRELUDE = """
import json, os, torch
npu = torch.npu
def rss(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def stats(): return npu.host_cache_stats()
MIB = 1 << 20
"""


def _run(code: str, **env: str) -> dict:
    """Run ``code`` (after :data:`PRELUDE`) with the sim active; it prints one JSON object, returned."""
    full = {**os.environ, "HAL_DEVICE": "npu-sim", **env}
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180, env=full, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_past_the_limit_the_least_recently_freed_blocks_give_their_pages_back():
    # A step's temporaries freed first, then an engine's tensors freed by its offload: the temporaries give
    # their pages back, the tensors' blocks stay resident, and asking for the same sizes again (the onload)
    # repopulates nothing and finds the bytes left there.
    out = _run("""
        stale = torch.ones(64 * MIB, dtype=torch.uint8, device="npu")
        del stale  # resident in the cache: it fills the 64 MiB limit alone
        blocks = [torch.full((16 * MIB,), i + 1, dtype=torch.uint8, device="npu") for i in range(4)]
        before = rss()
        del blocks  # 64 MiB more: the stale block, freed longest ago, gives its 64 MiB back
        freed, after_free = before - rss(), stats()
        again = [torch.empty(16 * MIB, dtype=torch.uint8, device="npu") for _ in range(4)]
        print(json.dumps({"freed": freed, "after_free": after_free, "after_again": stats(),
                          "values": sorted(int(t[::4096].max()) for t in again)}))
        """, HAL_SIM_CACHE_RESIDENT_MB="64")
    assert out["after_free"]["dropped_bytes"] == 64 * MIB  # the stale block, not one of the newer four
    assert out["after_free"]["resident_bytes"] == 64 * MIB  # the four newer blocks: exactly the limit
    assert 56 * MIB <= out["freed"] <= 72 * MIB  # the host got the stale block's pages back
    assert out["after_again"]["repopulated_bytes"] == 0 and out["after_again"]["resident_bytes"] == 0
    assert out["values"] == [1, 2, 3, 4]  # the same blocks, their bytes never dropped


def test_a_request_takes_a_resident_block_before_one_whose_pages_were_given_back():
    # Three equal blocks freed in order with room for two: the first gives its pages back. The first two
    # requests get the resident ones; only the third repopulates, and only its own 32 MiB.
    out = _run("""
        blocks = [torch.ones(32 * MIB, dtype=torch.uint8, device="npu") for _ in range(3)]
        del blocks
        seen = [stats()]
        kept = []
        for _ in range(3):
            kept.append(torch.empty(32 * MIB, dtype=torch.uint8, device="npu"))
            seen.append(stats())
        print(json.dumps({"seen": seen}))
        """, HAL_SIM_CACHE_RESIDENT_MB="64")
    seen = out["seen"]
    assert seen[0]["dropped_bytes"] == 32 * MIB and seen[0]["resident_bytes"] == 64 * MIB
    assert [s["repopulated_bytes"] for s in seen] == [0, 0, 0, 32 * MIB]
    assert [s["resident_bytes"] for s in seen] == [64 * MIB, 32 * MIB, 0, 0]


def test_the_limit_bounds_the_host_memory_free_blocks_keep_whatever_the_order_of_frees():
    # Blocks of several sizes freed in a shuffled order, some taken again and freed twice, through empty_cache:
    # the resident figure never passes the limit, and the process's resident memory falls back to within the
    # limit of where it started once every block is free.
    out = _run("""
        import random
        rng = random.Random(0)
        base = rss()
        worst, sizes = 0, [s * MIB for s in (2, 6, 10, 24, 40)] * 4
        live = [torch.ones(n, dtype=torch.uint8, device="npu") for n in sizes]
        for round in range(3):
            rng.shuffle(live)
            while live:
                live.pop()
                worst = max(worst, stats()["resident_bytes"])
            if round == 1:
                npu.empty_cache()
            live = [torch.ones(n, dtype=torch.uint8, device="npu") for n in rng.sample(sizes, len(sizes))]
        live.clear()
        worst = max(worst, stats()["resident_bytes"])
        print(json.dumps({"worst": worst, "grown": rss() - base, "end": stats()}))
        """, HAL_SIM_CACHE_RESIDENT_MB="48")
    assert out["worst"] <= 48 * MIB and out["end"]["resident_bytes"] <= 48 * MIB
    assert out["end"]["dropped_bytes"] > 0 and out["end"]["repopulated_bytes"] > 0  # the limit was exercised
    assert out["grown"] <= 48 * MIB + 8 * MIB  # the limit plus the runtime's own allocations


def _thp_mode() -> str | None:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


SMAPS_FLAGS = """
def vm_flags(address):
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []
t = torch.empty(6 * MIB, dtype=torch.uint8, device="npu")
print(json.dumps({"offset": t.data_ptr() % (2 * MIB), "flags": vm_flags(t.data_ptr())}))
"""


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="the host has no transparent huge pages to ask for")
def test_device_blocks_start_on_a_huge_page_boundary_and_ask_for_huge_pages():
    out = _run(SMAPS_FLAGS, HAL_SIM_HUGE_PAGES="1")
    assert out["offset"] == 0 and "hg" in out["flags"]  # hg: madvise(MADV_HUGEPAGE) on the block's mapping
    off = _run(SMAPS_FLAGS)  # the default: plain 4 KiB pages
    assert "hg" not in off["flags"]
