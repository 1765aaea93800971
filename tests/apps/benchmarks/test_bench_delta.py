"""``hal bench --only delta --link-gbit R`` (issue 31): full and delta updates of the same tensors between a
trainer and a rollout in network namespaces joined by rate-limited links, at several changed fractions in one
run, reporting ``delta_vs_full`` and ``wire_fraction`` per fraction; a bad rate is refused naming the flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
import tyro

from hal.apps.links import links_available
from hal.apps.cli.bench import Bench, execute, print_tables, selection
from hal.apps.errors import UsageError


def parse(*argv: str) -> Bench:
    return tyro.cli(Bench, args=list(argv))


@pytest.mark.parametrize("rate, message", [("0", r"--link-gbit takes a rate in Gbit/s in \(0, 400\], got 0.0"),
                                           ("-1", "--link-gbit takes a rate"), ("nan", "--link-gbit takes a rate"),
                                           ("inf", "--link-gbit takes a rate"), ("401", "got 401.0")])
def test_a_bad_link_rate_is_refused_naming_the_flag_before_anything_runs(rate, message):
    with pytest.raises(UsageError, match=message):
        selection(parse("--only", "delta", "--link-gbit", rate))


def test_a_link_rate_without_the_delta_benchmark_is_refused():
    with pytest.raises(UsageError, match="--link-gbit has no effect without --only delta or m2n"):
        selection(parse("--only", "sync", "--link-gbit", "1"))
    assert selection(parse("--only", "delta", "--link-gbit", "0.5")) == ["delta"]


def test_without_namespaces_the_link_run_is_skipped_with_the_reason(monkeypatch, capsys):
    from hal.apps import links
    from hal.apps.benchmarks import bench_delta

    monkeypatch.setattr(links, "links_available", lambda: (False, "emulated links need root"))
    monkeypatch.setattr(bench_delta, "run", lambda *a, **k: pytest.fail("the benchmark ran without links"))
    out = execute(dataclasses.replace(parse("--only", "delta", "--link-gbit", "1", "--quick"), device="cpu"))
    assert out == {"delta": {"skipped": "emulated links need root"}}
    print_tables(out)
    assert "delta: skipped: emulated links need root" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_link_run_reports_delta_vs_full_and_the_wire_fraction_per_fraction(capsys):
    ok, reason = links_available()
    if not ok:
        pytest.skip(f"emulated links unavailable here: {reason}")
    from hal.apps.cli.bench import run

    assert run(parse("--only", "delta", "--link-gbit", "0.5", "--size-mb", "8", "--quick", "--rounds", "1",
                     "--device", "cpu", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)["delta"]
    assert [r["fraction"] for r in rows] == [0.005, 0.02, 0.1, 0.5]
    assert all(r["link_gbit"] == 0.5 and r["backend"] == "gloo" for r in rows)
    for r in rows:
        assert r["changed"] == pytest.approx(r["fraction"], rel=0.1)
        assert r["wire_fraction"] == pytest.approx(r["sent_bytes"] / r["dense_bytes"])
        assert r["delta_vs_full"] > 0 and r["full_s"] > 0 and r["diff_vs_memcpy"] > 0
    assert rows[1]["wire_fraction"] == pytest.approx(0.06, abs=0.01)  # 6 bytes per changed bf16 value
    assert 0.99 < rows[3]["wire_fraction"] <= 1.05  # half changed: dense
