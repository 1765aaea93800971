"""The import-cost benchmark measures, and import hal brings in no vendor package."""

from hal.benchmarks.bench_import import run


def test_import_benchmark_reports_a_ratio_and_no_vendor_import():
    result = run(rounds=1)
    assert result["torch_s"] > 0 and result["hal_s"] > 0
    assert result["ratio"] == (result["torch_s"] + result["hal_s"]) / result["torch_s"]
    assert result["imports_vendor"] is False
