"""The `hal` console script driven as a user drives it: in a subprocess, reading its output and exit status
(and, where a fresh process adds nothing, its `main()` in this process: the bad-input messages)."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

HAL = [sys.executable, "-m", "hal.apps.cli.main"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def hal_cmd(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    full_env.update(env or {})
    return subprocess.run([*HAL, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


@pytest.fixture(scope="module")
def info_json() -> dict:
    """``hal info --json`` as a user runs it, once for the tests that read it."""
    out = hal_cmd("info", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_info_json_reports_every_kind(info_json):
    info = info_json
    kinds = {k["kind"]: k for k in info["kinds"]}
    assert set(kinds) >= {"npu", "cuda", "npu-sim", "cpu"}
    assert kinds["npu"]["dist_backend"] == "hccl" and kinds["cuda"]["dist_backend"] == "nccl"
    assert kinds["cpu"]["available"] is True
    assert info["dist_backend"] == kinds[info["device"]]["dist_backend"]


def test_info_json_lists_checkpoint_engines_with_availability(info_json):
    import ckpt

    info = info_json
    engines = {e["name"]: e for e in info["checkpoint_engines"]}
    assert set(engines) >= {"collective", "colocated", "file", "nixl", "mooncake", "kimi"}
    assert engines["collective"] == {"name": "collective", "available": True, "reason": ""}
    for name in ("nixl", "mooncake", "kimi"):
        ok, _ = ckpt.checkpoint_engine_availability(name)
        assert engines[name]["available"] is ok
        assert ok or engines[name]["reason"]  # an unavailable engine always says why
    if not engines["kimi"]["available"]:
        assert "runs only on device kinds" in engines["kimi"]["reason"]


def test_info_shows_the_auto_order_and_which_kind_resolved(info_json):
    """The help says "else auto: the first available of npu, cuda, plugin kinds, cpu; npu-sim only when
    named": hal info shows that order and marks the simulated npu as used only when named."""
    import hal

    kinds = {k["kind"]: k for k in info_json["kinds"]}
    assert info_json["auto_order"][:2] == ["npu", "cuda"] and info_json["auto_order"][-1] == "cpu"
    assert "npu-sim" not in info_json["auto_order"] and kinds["npu-sim"]["auto_probe"] is False
    first_available = next(k for k in info_json["auto_order"] if kinds[k]["available"])
    assert info_json["device"] == first_available == hal.resolve_device().kind
    table = hal_cmd("info", env={"COLUMNS": "200"}).stdout
    assert re.search(r"npu-sim .*│ named ", table) and re.search(rf"{first_available} .*<- resolved", table)


def test_info_with_an_unusable_kind_still_shows_every_kind_and_the_reason():
    """HAL_DEVICE=npu where the Ascend plugin is missing: the table, then one error line, exit 2."""
    import hal

    if hal.availability("npu"):
        pytest.skip("npu is usable here")
    out = hal_cmd("info", env={"HAL_DEVICE": "npu", "COLUMNS": "200"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("hal: error: device kind 'npu' is unavailable: ")
    assert "device none: device kind 'npu' is unavailable" in out.stdout and "npu-sim" in out.stdout
    as_json = hal_cmd("info", "--json", env={"HAL_DEVICE": "npu"})
    info = json.loads(as_json.stdout)
    assert as_json.returncode == 2 and info["device"] is None and "torch_npu" in info["device_error"]
    assert {k["kind"] for k in info["kinds"]} >= {"npu", "cuda", "npu-sim", "cpu"}


@pytest.mark.hal_device("npu-sim")
def test_info_on_the_simulated_npu_reports_npu_hccl_ascend_env(hal_device):
    out = hal_cmd("info", "--json", env={"HAL_DEVICE": "npu-sim"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["device"], info["device_name"], info["dist_backend"], info["visible_devices_env"]) == \
        ("npu-sim", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")


def hal_main(capsys, *args: str) -> tuple[int, str]:
    """``hal ARGS`` in this process (``main``, as the console script calls it): its exit status and stderr."""
    from hal.apps.cli import main as m

    try:
        code = m.main(list(args))
    except SystemExit as exc:  # tyro's own usage errors
        code = exc.code
    return code, capsys.readouterr().err


def test_bad_input_from_the_console_script_gives_exit_status_2_and_no_traceback():
    # in a fresh process: nothing registered yet (in this one the simulated npu may be, answering for npu)
    import hal

    if hal.availability("npu"):
        pytest.skip("a real Ascend NPU is present")
    out = hal_cmd("info", "--device", "npu", timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'npu' is unavailable" in out.stderr and "Traceback" not in out.stderr


# The same checks in this process (the console script is main() plus sys.exit, checked once above): each
# message, status 2, and no traceback printed (an exception escaping main() would fail the test itself).
@pytest.mark.parametrize("args,message", [
    (("sync", "--device", "tpu"), "unknown device kind 'tpu'"),
    (("sync", "--model", "/no/such/model.safetensors"), "no such safetensors file"),
    (("sync", "--bucket-mb", "0"), "--bucket-mb must be positive, got 0"),
    (("sync", "--steps", "-1"), "--steps must be positive"),
    (("launch", "--device", "cpu"), "needs a script after '--'"),
    (("launch", "--device", "cpu", "--", "/no/such/job.py"), "does not exist"),
    (("sync", "--model", __file__), "is not a safetensors file"),
])
def test_bad_input_gives_a_clear_message_and_no_traceback(args, message, capsys):
    code, err = hal_main(capsys, *args)
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.hal_device("npu-sim")
def test_launch_refuses_more_ranks_than_visible_devices_before_starting(hal_device, tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    out = hal_cmd("launch", "--device", "npu-sim", "--nproc-per-node", "2", "--", str(script), timeout=120,
                  env={"ASCEND_RT_VISIBLE_DEVICES": "3"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "ASCEND_RT_VISIBLE_DEVICES='3'" in out.stderr and "1 device(s)" in out.stderr, out.stderr
    assert "--nproc-per-node 2" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()


def test_an_internal_bug_keeps_its_traceback_and_is_not_a_usage_error():
    code = textwrap.dedent('''
        import sys
        from hal.apps.cli import main as m

        def broken(args):
            raise ValueError("internal bug: a list index went wrong")

        m.RUNNERS[m.Info] = broken
        sys.exit(m.main(["info"]))
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" in out.stderr and "ValueError: internal bug" in out.stderr
    assert "hal: error:" not in out.stderr


def test_hal_errors_from_the_engines_are_usage_errors(monkeypatch, capsys):
    from engines import OffloadError
    from hal.apps.cli import main as m

    def refuse(args):
        raise OffloadError("to(device='npu:1'): this engine lives on npu:0")

    monkeypatch.setitem(m.RUNNERS, m.Info, refuse)
    assert m.main(["info"]) == 2
    assert "hal: error: to(device='npu:1')" in capsys.readouterr().err


def test_the_cli_and_the_job_use_no_test_helper():
    import ast

    paths = [*(ROOT / "hal" / "apps" / "cli").glob("*.py"), *(ROOT / "hal" / "apps" / "weightsync").rglob("*.py")]
    assert len(paths) > 10
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n == "tests" or n.startswith("tests.") for n in names), path


SCRIPT = textwrap.dedent('''
    import os, torch, torch.distributed as dist, hal
    hal.init_process_group(timeout=60)
    t = torch.full((2,), float(dist.get_rank() + 1), device=hal.get_device())
    dist.all_reduce(t)
    print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} device={os.environ['HAL_DEVICE']} "
          f"sum={t.cpu().tolist()} arg={os.sys.argv[1]}", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.multiprocess
def test_launch_runs_a_two_process_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = hal_cmd("launch", "--device", "cpu", "--nproc-per-node", "2", "--", str(script), "--flag-for-script",
                  timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # the two ranks share one stdout pipe, so their lines may interleave: find the records, not lines
    lines = sorted(re.findall(r"RESULT rank=\d .*?arg=--flag-for-script", out.stdout))
    assert lines == [f"RESULT rank={r} world=2 device=cpu sum=[3.0, 3.0] arg=--flag-for-script" for r in (0, 1)]


@pytest.mark.multiprocess
def test_launch_reports_a_failing_script(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    out = hal_cmd("launch", "--device", "cpu", "--nproc-per-node", "2", "--", str(script), timeout=180)
    assert out.returncode == 3, out.stdout + out.stderr  # the script's own exit code
    assert "hal launch: the rank " in out.stderr and "exited with code 3" in out.stderr


@pytest.mark.multiprocess
def test_bench_quick_prints_ratios(tmp_path):
    plot = tmp_path / "bench.png"
    want_plot = importlib.util.find_spec("matplotlib") is not None
    args = ["bench", "--quick", "--device", "npu-sim", "--json", "--only", "offload", "sync"] + (
        ["--plot", str(plot)] if want_plot else [])
    out = hal_cmd(*args, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    offload, sync = result["offload"], result["sync"]
    assert offload["moves"] is True and offload["bytes"] >= 60 << 20
    assert 0 < offload["warm_ratio"] and offload["plain_gbps"] > 0
    assert [b["bucket_bytes"] for b in sync["buckets"] if b["layout"] == sync["buckets"][0]["layout"]] == \
        [4 << 20, 16 << 20]
    assert all(b["ratio_vs_single"] > 0 for b in sync["buckets"])
    import ckpt

    from hal.apps.benchmarks import bench_p2p

    engines = [e for e in bench_p2p.transfer_library_engines() if ckpt.checkpoint_engine_availability(e, "npu-sim")[0]]
    rows = result["sync_p2p"]["engines"] if engines else []
    assert [r["engine"] for r in rows] == engines
    from hal.apps.benchmarks.bench_ckpt import tensor_sizes
    from tests.ckpt.mp_workers import FIRST_UPDATE_SLACK

    # the receiver also holds a buffer for tensors larger than a bucket (handed over whole); when a bigger one
    # arrives the buffer grows, and the previous one may still be referenced by the view last yielded (or
    # kept by the C allocator), so two of the largest size
    largest = 2 * max(tensor_sizes(64 << 20))
    for r in rows:  # each engine next to its own library's raw write; memory: two slots of 4 MiB a side
        assert r["raw_gbps"] > 0 and r["ratio_vs_raw"] > 0.05
        if r["engine"] == "kimi":  # checkpoint-engine's design: the trainer pins the whole update in host memory,
            # a rollout pulls buckets never smaller than the largest tensor into two device slots
            assert r["send_peak_bytes"] <= result["sync_p2p"]["size_bytes"] + FIRST_UPDATE_SLACK
            assert r["recv_peak_bytes"] <= \
                2 * max(4 << 20, max(tensor_sizes(64 << 20))) + FIRST_UPDATE_SLACK + 2 * (2 << 20)
            continue
        # the two slots and a first update's own growth, well below the 64 MiB sent (with 4 MiB buckets that
        # growth is larger than a bucket: tests/ckpt's memory tests count the slots with 32 MiB buckets)
        assert r["send_peak_bytes"] <= 2 * (4 << 20) + FIRST_UPDATE_SLACK
        # on npu-sim the rollout receives into device memory (host memory underneath, so it is counted), whose
        # allocator rounds each block up to 2 MiB as CUDA's does: the slots and the two large-tensor buffers
        assert r["recv_peak_bytes"] <= 2 * (4 << 20) + largest + FIRST_UPDATE_SLACK + 3 * (2 << 20)
    if want_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # three processes, as hal sync's tests
def test_bench_main_job_quick_reports_each_step_against_a_raw_broadcast():
    # --quick's steps, on an 8 MiB model in 1 MiB buckets (--quick's own sizes, 64 and 4, are checked in
    # tests/cli/test_bench_args.py; the bytes moved change nothing of what is reported)
    out = hal_cmd("bench", "--quick", "--only", "main", "--device", "cpu", "--json", "--size-mb", "8",
                  "--main-bucket-mb", "1", timeout=290)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert sorted(result) == ["main"]
    main = result["main"]  # hal sync itself: 1 trainer, 2 rollouts applying into their models
    assert main["rollouts"] == 2 and main["bytes"] >= 8 << 20 and main["bucket_bytes"] == 1 << 20
    [run] = main["runs"]
    assert run["rollout_apply"] == "atomic" and [s["global_steps"] for s in run["steps"]] == [1, 2]
    for s in run["steps"]:  # each step next to a raw broadcast of the same bytes, measured in the same run
        assert s["raw_gbps"] > 0 and s["raw_s"] > 0 and s["ratio_vs_raw"] > 0
    assert run["warmup"]["publish_s"] > 0 and run["memory_within"] is True
    assert sorted(run["rollout_memory"]) == ["1", "2"]
