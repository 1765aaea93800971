"""hal bench's selection and size flags, checked before any benchmark starts."""

import dataclasses

import pytest
import tyro

from hal.apps.cli.bench import Bench, execute, selection
from hal.apps.errors import UsageError


def parse(*argv: str) -> Bench:
    return tyro.cli(Bench, args=list(argv))


def test_a_plain_bench_leaves_the_main_job_out_and_only_main_runs_it():
    assert selection(parse()) == ["offload", "sync"]
    assert selection(parse("--only", "main")) == ["main"]
    assert selection(parse("--only", "main", "offload")) == ["offload", "main"]  # always in the same order


def test_bucket_flags_are_fractional_mib_like_hal_sync():
    args = parse("--bucket-mb", "0.5", "4", "--main-bucket-mb", "1.5")
    assert args.bucket_mb == (0.5, 4.0) and args.main_bucket_mb == 1.5
    assert selection(args) == ["offload", "sync"]


@pytest.mark.parametrize("argv,message", [
    (("--bucket-mb", "64", "0"), "--bucket-mb must be positive, got 0.0"),
    (("--bucket-mb", "-4"), "--bucket-mb must be positive, got -4.0"),
    (("--main-bucket-mb", "0"), "--main-bucket-mb must be positive, got 0.0"),
    (("--only", "mian"), "--only takes offload, sync, ipc, delta, main, ray, import, senders, m2n, check, lora "
                         "(default: offload sync), "
                          "got ['mian']"),
    (("--rounds", "0"), "--rounds must be >= 1, got 0"),
    (("--apply", "both"), "--apply takes atomic and/or in-place, got ['both']"),
])
def test_bad_values_are_refused_naming_the_flag_before_anything_runs(argv, message, monkeypatch):
    import hal

    monkeypatch.setattr(hal, "resolve_device", lambda *a: pytest.fail("a benchmark was about to start"))
    with pytest.raises(UsageError) as info:
        execute(parse(*argv))
    assert message in str(info.value)


def test_the_main_job_gets_the_bucket_size_in_mib(monkeypatch):
    from hal.apps.benchmarks import bench_sync

    calls = []
    monkeypatch.setattr(bench_sync, "run", lambda *a, **k: calls.append(a) or {})
    execute(dataclasses.replace(parse("--only", "main", "--main-bucket-mb", "0.25"), device="cpu"))
    size, kind, rollouts, steps, bucket, applies, model = calls[0]
    assert (size, kind, bucket, applies) == (1024, "cpu", 0.25, ("atomic",))


@pytest.mark.parametrize("argv,expected", [
    ((), (1024, [64.0, 256.0, 1024.0], 3, 256.0)),
    (("--quick",), (64, [4.0, 16.0], 2, 4.0)),
    (("--quick", "--size-mb", "8", "--bucket-mb", "0.5", "--rounds", "5", "--main-bucket-mb", "1"),
     (8, [0.5], 5, 1.0)),  # explicit flags win over --quick's defaults
    (("--quick", "--rounds", "1"), (64, [4.0, 16.0], 1, 4.0)),
])
def test_quick_changes_only_the_defaults_of_flags_not_given(argv, expected, monkeypatch):
    from hal.apps.benchmarks import bench_ckpt, bench_offload, bench_p2p, bench_sync

    seen = {}
    monkeypatch.setattr(bench_offload, "run", lambda size, kind, rounds: seen.update(offload=(size, rounds)))
    monkeypatch.setattr(bench_ckpt, "run", lambda size, buckets, kind, rounds: seen.update(
        sync=(size, buckets, rounds)))
    monkeypatch.setattr(bench_p2p, "transfer_library_engines", lambda: [])
    monkeypatch.setattr(bench_sync, "run", lambda size, kind, rollouts, steps, bucket, *a: seen.update(
        main=(size, steps, bucket)))
    execute(dataclasses.replace(parse("--only", "offload", "sync", "main", *argv), device="cpu"))
    size, buckets, rounds, main_bucket = expected
    assert seen == {"offload": (size, rounds), "sync": (size, buckets, rounds), "main": (size, rounds, main_bucket)}


def test_delta_runs_only_when_named_with_the_smallest_bucket(monkeypatch):
    from hal.apps.benchmarks import bench_delta

    calls = []
    monkeypatch.setattr(bench_delta, "run", lambda *a, **k: calls.append(a) or [])
    assert "delta" not in selection(parse())
    out = execute(dataclasses.replace(parse("--only", "delta", "--quick"), device="cpu"))
    assert calls == [(64, "cpu", 2, 4.0)] and out == {"delta": []}


def test_senders_without_emulated_links_is_skipped_with_the_reason(monkeypatch, capsys):
    from hal.apps import links
    from hal.apps.cli.bench import print_tables

    monkeypatch.setattr(links, "links_available", lambda: (False, "emulated links need root"))
    assert "senders" not in selection(parse())
    out = execute(dataclasses.replace(parse("--only", "senders"), device="cpu"))
    assert out == {"senders": {"skipped": "emulated links need root"}}
    print_tables(out)
    assert "senders: skipped: emulated links need root" in capsys.readouterr().out


def test_plot_without_matplotlib_is_refused_before_any_benchmark_with_a_pip_line(monkeypatch, tmp_path):
    """Found only after every benchmark had run, with a hint ('.[plot]') that reinstalls hal over an editable
    install: now checked first, naming the package itself."""
    import importlib.util

    import hal
    from hal.apps.errors import MissingExtraError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(hal, "resolve_device", lambda *a: pytest.fail("a benchmark was about to start"))
    with pytest.raises(MissingExtraError) as info:
        execute(parse("--plot", str(tmp_path / "b.png")))
    assert str(info.value) == ("--plot needs matplotlib, which is not installed here: pip install matplotlib "
                               "(hal's 'plot' extra)")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    with pytest.raises(UsageError, match="--plot .*: the folder .* does not exist"):
        selection(parse("--plot", str(tmp_path / "missing" / "b.png")))


def test_the_plot_says_why_a_panel_is_empty(tmp_path):
    """On cpu offload moves nothing; a benchmark left out by --only is named, not an empty frame."""
    pytest.importorskip("matplotlib")
    from hal.apps.cli import bench

    texts = []
    import matplotlib.axes

    real_text = matplotlib.axes.Axes.text

    def text(self, x, y, s, *a, **k):
        texts.append(s)
        return real_text(self, x, y, s, *a, **k)

    import unittest.mock

    offload = {"device": "cpu", "moves": False, "plain_gbps": 1.0, "cold_gbps": 0.0, "warm_gbps": 0.0, "bytes": 1 << 20}
    with unittest.mock.patch.object(matplotlib.axes.Axes, "text", text):
        bench.plot({"offload": offload}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert texts == ["offload moves nothing on cpu\n(tensors already live in host memory):\nuse --device npu-sim "
                     "or an accelerator", "sync not run (--only)"]
