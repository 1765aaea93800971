"""``hal bench --only lora`` (issue 48): one LoRA training published as the adapter alone and as merged weights,
bytes and time per update side by side, with ``adapter_bytes_fraction`` and ``adapter_vs_merged_time``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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
    assert [u["global_steps"] for u in r["runs"]["merged"]["updates"]] == [1, 2, 3]  # 1: the warm-up
    for mode in ("adapter", "merged"):  # medians of the updates after the warm-up
        after = [u["publish_s"] for u in r["runs"][mode]["updates"][1:]]
        assert r[f"{mode}_publish_s"] == pytest.approx(sum(after) / 2)
    bench_lora.print_table(r)
    out = capsys.readouterr().out
    assert "an update after the first: adapter 0.07 MB = 4.18% of merged 1.79 MB" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # two hal sync jobs of three processes each
def test_hal_bench_only_lora_json_has_both_ratios():
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "bench", "--quick", "--only", "lora", "--device",
                          "cpu", "--json", "--main-bucket-mb", "1"], capture_output=True, text=True, timeout=290,
                         env=env, cwd=pathlib.Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [(key, r)] = json.loads(out.stdout[: out.stdout.rindex("}") + 1]).items()
    assert key == "lora" and (r["model"], r["rank"], r["rollouts"], r["engine"]) == ("qwen2.5-tiny", 8, 2, "collective")
    assert (r["adapter_bytes"], r["merged_bytes"]) == (74_752, 1_788_160)
    assert r["adapter_bytes_fraction"] == pytest.approx(74_752 / 1_788_160)
    assert r["adapter_vs_merged_time"] == pytest.approx(r["adapter_publish_s"] / r["merged_publish_s"])
    assert r["adapter_publish_s"] > 0 and r["merged_publish_s"] > 0
    assert [u["global_steps"] for u in r["runs"]["adapter"]["updates"]] == [1, 2, 3]  # --quick: 2 rounds + warm-up
