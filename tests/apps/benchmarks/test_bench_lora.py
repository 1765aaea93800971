"""``hal bench --only lora`` (issue 48): one LoRA training published as the adapter alone and as merged weights,
bytes and time per update side by side, with ``adapter_bytes_fraction`` and ``adapter_vs_merged_time``."""

from __future__ import annotations

import pytest
import tyro

from hal.apps.benchmarks import bench_lora
from hal.apps.cli.bench import Bench, selection

pytest.importorskip("peft")
pytest.importorskip("transformers")


def test_lora_runs_only_when_named():
    assert "lora" not in selection(tyro.cli(Bench, args=[]))
    assert selection(tyro.cli(Bench, args=["--only", "lora", "--quick"])) == ["lora"]


def test_the_adapter_against_merged_publishes_of_one_training(capsys):
    r = bench_lora.run("qwen2.5-tiny", "cpu", rollouts=1, steps=2, bucket_mb=1.0, engine="colocated", timeout=60.0)
    assert (r["adapter_bytes"], r["merged_bytes"]) == (74_752, 1_788_160)  # rank 8 on the tiny preset, bf16
    assert r["adapter_bytes_fraction"] == pytest.approx(74_752 / 1_788_160)
    assert r["adapter_vs_merged_time"] == pytest.approx(r["adapter_publish_s"] / r["merged_publish_s"])
    assert r["runs"]["adapter"]["first"]["bytes"] == 74_752 + 1_788_160  # the base and the adapter, once
    assert [u["global_steps"] for u in r["runs"]["merged"]["updates"]] == [1, 2]
    bench_lora.print_table(r)
    out = capsys.readouterr().out
    assert "an update after the first: adapter 0.07 MB = 4.18% of merged 1.79 MB" in out
