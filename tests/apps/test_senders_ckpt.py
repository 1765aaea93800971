"""The collective engine's multi-sender path plugged into bench_senders (issue 22): the benchmark's own byte
check passes on every rollout, and 2 senders deliver the update faster than 1 over emulated links."""

import pytest

from hal.apps import links
from hal.apps.benchmarks.bench_senders import CKPT_PATH, bench_senders


@pytest.fixture
def needs_links():
    ok, reason = links.links_available()
    if not ok:
        pytest.skip(f"emulated links unavailable: {reason}")


@pytest.mark.usefixtures("needs_links")
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_engines_multi_sender_path_scales_and_delivers_every_byte():
    result = bench_senders(size_mb=4, rate_mbit=50, rollout_factor=4, rollouts=2, senders=(1, 2), rounds=1,
                           rollout_limited=False, path=CKPT_PATH)
    rows = {row["senders"]: row for row in result["rows"]}
    assert result["path"] == CKPT_PATH and rows[1]["bytes"] == rows[2]["bytes"] > 4_000_000
    assert rows[1]["gbps"] * 1e9 <= 1.1 * 50e6 / 8 / 2  # one sender's link carries the update twice
    assert rows[2]["ratio"] > 1.5, result
