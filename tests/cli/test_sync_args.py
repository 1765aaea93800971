"""hal sync's argument checks, and the job options they become, without starting a rank."""

import pytest

from hal.apps.errors import UsageError, mib_to_bytes
from hal.apps.cli.sync import Sync, job_options, validate

def test_bucket_sizes_are_mib_with_fractions_and_refused_by_flag_when_not_positive():
    assert mib_to_bytes(256, "--bucket-mb") == 256 << 20 and mib_to_bytes(0.5, "--bucket-mb") == 1 << 19
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match=f"--bucket-mb must be positive, got {bad}"):
            mib_to_bytes(bad, "--bucket-mb")
    with pytest.raises(UsageError, match="--main-bucket-mb 1e-09 MiB is less than one byte"):
        mib_to_bytes(1e-9, "--main-bucket-mb")
    with pytest.raises(UsageError, match="--bucket-mb must be positive, got -2"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", bucket_mb=-2))


def test_a_preset_in_another_letter_case_is_that_preset(tmp_path, monkeypatch):
    validate(Sync(device="cpu", model="Qwen2.5-TINY", engine="colocated"))  # no missing-file error
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="presets: qwen2.5-0.5b, qwen2.5-tiny"):
        validate(Sync(device="cpu", model="Qwen2.5-huge", engine="colocated"))


def test_the_job_options_have_the_kind_resolved_the_preset_key_and_the_bucket_in_bytes(tmp_path):
    options = job_options(Sync(device="cpu", model="QWEN2.5-tiny", bucket_mb=0.5, engine="file", steps=7))
    assert (options.device, options.model, options.bucket_bytes, options.steps) == ("cpu", "qwen2.5-tiny", 1 << 19, 7)
    assert options.file_root is None and options.offload_flags == {}  # the launcher makes one and removes it
    given = job_options(Sync(device="cpu", model="qwen2.5-tiny", engine="file", file_root=str(tmp_path), offload="all"))
    assert given.file_root == str(tmp_path) and given.offload_flags == {"model": True, "optimizer": True, "grad": True}
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny")).file_root is None  # only the file engine needs one


def test_vllm_rollouts_take_full_updates_only():
    with pytest.raises(UsageError, match="--rollout vllm takes --wire-format full, got --wire-format delta"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", wire_format="delta"))


@pytest.mark.parametrize("given, message", [
    (dict(address="auto"), "--address has no effect without --launcher ray (got --launcher torchrun)"),
    (dict(placement="SPREAD"), "--placement has no effect without --launcher ray (got --launcher torchrun)"),
    (dict(compare_full=True), "--compare-full has no effect without --wire-format delta (got --wire-format full)"),
    (dict(file_root="somewhere"), "--file-root has no effect without --engine file (got --engine collective)"),
    (dict(compare_hal=False), "--no-compare-hal has no effect without --rollout vllm (got --rollout hal)"),
    (dict(lora_alpha=32), "--lora-alpha has no effect without --lora-rank R (got --lora-rank 0)"),
    (dict(lora_targets=("q_proj",)), "--lora-targets has no effect without --lora-rank R (got --lora-rank 0)"),
    (dict(lora_publish="merged"), "--lora-publish has no effect without --lora-rank R (got --lora-rank 0)"),
])
def test_a_flag_without_effect_is_refused_naming_the_flag_it_needs(given, message):
    with pytest.raises(UsageError) as info:
        validate(Sync(device="cpu", model="qwen2.5-tiny", **given))
    assert str(info.value) == message


@pytest.mark.parametrize("given, message", [
    (dict(trainer_ranks=2, engine="collective"), "--lora-rank 8 runs with --trainer-ranks 1 (the adapter is trained "
                                                 "and published by one rank), got --trainer-ranks 2"),
    (dict(wire_format="delta"), "--lora-rank 8 runs with --wire-format full (an adapter update is whole tensors, "
                                "already small), got --wire-format delta"),
    (dict(rollout_tp=2, rollouts=2, engine="collective"), "--lora-rank 8 runs with --rollout-tp 1 (adapters are not "
                                                          "resharded across tensor-parallel ranks), got --rollout-tp 2"),
    (dict(lora_rank=-1), "--lora-rank and --lora-alpha must be positive, got -1 and 16"),
])
def test_lora_is_refused_where_it_does_not_run_naming_the_flag(given, message):
    with pytest.raises(UsageError) as info:
        validate(Sync(**{"device": "cpu", "model": "qwen2.5-tiny", "engine": "colocated", "lora_rank": 8, **given}))
    assert str(info.value) == message


def test_lora_flags_become_the_jobs_options():
    options = job_options(Sync(device="cpu", model="qwen2.5-tiny", lora_rank=4, lora_alpha=8,
                               lora_targets=("q_proj", "v_proj"), lora_publish="merged"))
    assert (options.lora_rank, options.lora_alpha, options.lora_targets, options.lora_publish) == \
        (4, 8, ("q_proj", "v_proj"), "merged")
    assert options.lora and not options.lora_adapters
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny", lora_rank=8)).lora_adapters


def test_a_file_root_that_is_a_file_is_refused_before_the_job_starts(tmp_path):
    # it failed 40 s into the job, after two launcher tracebacks, with "FileExistsError: ... File exists"
    afile = tmp_path / "not-a-directory"
    afile.write_text("x")
    with pytest.raises(UsageError) as info:
        validate(Sync(device="cpu", model="qwen2.5-tiny", engine="file", file_root=str(afile)))
    assert str(info.value) == (f"--file-root {afile} is not a directory (give a directory, new or existing, for the "
                               "file engine's steps)")
    validate(Sync(device="cpu", model="qwen2.5-tiny", engine="file", file_root=str(tmp_path / "new")))


@pytest.mark.parametrize("given, message", [
    (dict(device="cpu", engine="ipc"), "--hybrid puts every rank on one device; the cpu kind has none"),
    (dict(engine="collective"), "--hybrid needs an engine whose trainer and rollouts may share a device (file, ipc), "
                                "got --engine collective"),
    (dict(engine="ipc", offload="model"), "--hybrid offloads the model, gradients and optimizer states (--offload "
                                          "all), got --offload model"),
    (dict(engine="ipc", launcher="ray"), "--hybrid runs with --launcher torchrun, got --launcher ray"),
    (dict(engine="file", trainer_ranks=2), "--trainer-ranks 2 needs an engine whose every trainer rank sends"),
])
def test_hybrid_is_refused_where_ranks_cannot_share_a_device_naming_the_flag(given, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(Sync(**{"device": "npu-sim", "model": "qwen2.5-tiny", "hybrid": True, **given}))


def test_hybrid_binds_every_rank_to_device_0_and_offloads_everything():
    options = job_options(Sync(device="npu-sim", model="qwen2.5-tiny", engine="ipc", hybrid=True))
    assert options.hybrid and options.rank_device == "npu-sim:0" and options.offload == "all"
    assert job_options(Sync(device="npu-sim", model="qwen2.5-tiny", engine="ipc")).rank_device == "npu-sim"
    validate(Sync(device="npu-sim", model="qwen2.5-tiny", engine="ipc", hybrid=True, rollouts=7))  # one device


def test_publish_dtype_applies_to_presets_and_auto_resolves_per_rollout(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    with pytest.raises(UsageError, match="--publish-dtype applies to a preset --model"):
        validate(Sync(device="cpu", model=str(path), publish_dtype="float32"))
    validate(Sync(device="cpu", model=str(path)))  # auto: no complaint
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny")).published_dtype == "bfloat16"
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny", publish_dtype="float32")).published_dtype == "float32"
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny")).placement == "PACK"
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny", launcher="ray", placement="SPREAD")).placement == "SPREAD"


@pytest.mark.slow
def test_help_shows_no_parser_artefacts():
    """Optional values show a metavar and their default in words, not tyro's {None}|STR / (default: None)."""
    import subprocess
    import sys

    for command in ("sync", "info", "bench", "launch"):
        out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", command, "--help"], capture_output=True,
                             text=True, env={**__import__("os").environ, "COLUMNS": "200"}, check=True).stdout
        assert "{None}" not in out and "(default: None)" not in out and "'None'" not in out, (command, out)
        assert "--device KIND" in out
    bad = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--publish-dtype", "fp8"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "'None'" not in bad.stderr and "'float32'" in bad.stderr


def test_the_delta_summary_says_slower_or_faster():
    from hal.apps.cli.sync import delta_versus_full

    assert delta_versus_full(5.48) == "delta publish 5.48x slower than a full publish of the same weights"
    assert delta_versus_full(0.25) == "delta publish 4.00x faster than a full publish of the same weights"


@pytest.mark.parametrize("given, message", [
    (dict(link_gbit=0.0), "--link-gbit takes a rate in Gbit/s in (0, 400], got 0.0"),
    (dict(link_gbit=float("nan")), "--link-gbit takes a rate in Gbit/s in (0, 400], got nan"),
    (dict(link_gbit=1.0, engine="file"), "--link-gbit emulates the network between processes, which --engine "
                                         "collective crosses; got --engine file"),
    (dict(link_gbit=1.0, launcher="ray"), "--link-gbit runs with --launcher torchrun, got --launcher ray"),
    (dict(link_gbit=1.0, trainer_ranks=2), "--link-gbit runs with --trainer-ranks 1, got --trainer-ranks 2"),
])
def test_link_gbit_is_refused_where_it_cannot_emulate_the_link_naming_the_flag(given, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        validate(Sync(**{"device": "cpu", "model": "qwen2.5-tiny", **given}))


def test_link_gbit_becomes_the_jobs_link_rate():
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny", link_gbit=0.5)).link_gbit == 0.5
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny")).link_gbit is None


def test_the_step_table_prints_a_decode_of_four_tokens_on_one_line(capsys):
    # the default job's decode (4 tokens of up to 6 digits) wrapped onto a second line in the 140 columns a
    # piped table was held to; a new user read it as two rows
    from hal.apps.cli.sync import print_table

    tokens = [128179, 45288, 105000, 493700]
    row = {"global_steps": 1, "loss": 12.3549, "bytes": 988_000_000, "tensors": 290, "publish_s": 0.47, "gbps": 2.09,
           "ratio_vs_raw": 1.05, "offload_s": 0.0, "onload_s": 0.0, "peak_host_bytes": 8.33e9,
           "memory_bound_bytes": 9.52e9, "tokens": tokens,
           "rollouts": [{"served_step": 1, "error": None, "peak_host_bytes": 2.35e9, "memory_bound_bytes": 3.32e9}]}
    print_table({"rows": [row], "model": "qwen2.5-0.5b", "device": "cpu", "engine": "collective",
                 "offload": "none", "rollout_apply": "atomic", "errors": [], "verified": True, "wall_s": 35.8})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert len(lines) == 1 and " ".join(map(str, tokens)) in lines[0] and lines[0].split("│")[-2].strip() == "yes", out


def test_a_table_keeps_a_terminals_width_only_where_it_fits_in_it(monkeypatch):
    # an 80-column terminal showed the step table's losses as "12…": rich cuts what it cannot wrap
    from rich.console import Console
    from rich.table import Table

    from hal.apps.cli.tables import console_for

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))  # a terminal 60 columns wide
    monkeypatch.setenv("COLUMNS", "60")
    narrow, wide = Table("a", "b"), Table("a", "b")
    narrow.add_row("x" * 10, "y" * 10)
    wide.add_row("x" * 50, "y" * 50)
    assert console_for(narrow).width == 60
    assert console_for(wide).width == Console(width=1 << 12).measure(wide).maximum > 100
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: False))  # piped: as wide as the rows
    assert console_for(narrow, 140).width == 140 and console_for(wide).width > 100


def test_check_every_is_a_count_of_steps_for_hals_rollouts():
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny", check_every=3)).check_every == 3
    with pytest.raises(UsageError, match="--check-every must be >= 0 \\(0: never\\), got -1"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", check_every=-1))
    with pytest.raises(UsageError, match="--check-every checks hal's rollouts"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", check_every=1, rollout="vllm"))
    with pytest.raises(UsageError, match="--check-every checks whole-model rollouts"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", check_every=1, rollout_tp=2, rollouts=2))
