"""The prepared accelerator check: what to run, in one go, on a host lent with a GPU or an NPU (or cpu, npu-sim).

Steps ``info`` (environment, kind, engines), ``tests`` (the device lane: ``pytest --hal-device KIND``, only
tests parametrized over the kind), ``offload``, ``sync`` and ``ipc`` (hal.apps.benchmarks' ``bench_offload``,
``bench_sync``, ``bench_ipc``, each a key ratio), each in its own process with its own deadline within a budget
(480 s). Each ends ``pass``, ``fail``, ``timeout`` or ``skip`` (with the reason); the check passes (exit status
0) when none failed or timed out. Runs from a plain copy of the checkout too: the checkout goes first on
``sys.path``. Where ``$OUT`` is set, the JSON and the tests' log are written there too.

    python scripts/accel_check.py --device npu-sim --size-mb 8 --tests-k offload --json check.json

Also a pytest plugin (``-p accel_check``, this folder on ``sys.path``): it deselects tests not parametrized
over a kind ``--hal-device`` names.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

SCRIPTS = pathlib.Path(__file__).resolve().parent  # this folder: the steps' children import this module from it
ROOT = SCRIPTS.parent  # the checkout: the tests step runs from there
sys.path.insert(0, str(ROOT))

STEPS = ("info", "tests", "offload", "sync", "ipc")  # in the order they run
# each step's share of the budget among the steps still to run (time left unused goes to later ones)
WEIGHTS = {"info": 1.0, "tests": 8.0, "offload": 3.0, "sync": 4.0, "ipc": 4.0}
FLOOR_S = 30.0  # seconds, the least deadline a step gets
GRACE_S = 5.0  # seconds between SIGTERM and SIGKILL
TAIL_CHARS = 4000  # of a step's output
MODULE = "accel_check"  # run by the steps' children (python -m); a pytest plugin


@dataclasses.dataclass
class Options:
    """What to check and how long it may take."""

    device: str | None = None
    budget_s: float = 480.0  # each step gets a share of what is left
    size_mb: int | None = None  # None: 1024 on an accelerator, else 64
    rounds: int = 3
    rollouts: int = 1  # sync: one device each on an accelerator
    bucket_mb: float | None = None  # None: a quarter of the size, 1 to 256
    steps: tuple[str, ...] = STEPS  # info always runs
    tests: tuple[str, ...] = ("tests",)  # relative to the checkout
    tests_k: str | None = None
    workers: str = "auto"  # pytest-xdist's -n
    json_path: str | None = None  # also $OUT/accel_check.json


@dataclasses.dataclass
class StepResult:
    """How one step ended."""

    name: str
    status: str  # pass, fail, timeout or skip
    seconds: float  # 0 when it did not start
    deadline_s: float
    key: str = ""  # what ratio is, or the one-line outcome
    ratio: float | None = None  # above 1: faster than the reference
    note: str = ""  # further figures, or why it failed or was skipped
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)  # the benchmark's run result
    log_tail: str = ""  # kept when it did not pass


def default_size_mb(host_memory: bool, simulated: bool) -> int:
    """MiB a benchmark moves by default: 64 on a host-memory or simulated kind, 1024 on an accelerator."""
    return 64 if host_memory or simulated else 1024


def default_bucket_mb(size_mb: int) -> float:
    """The engines' bucket in MiB by default: a quarter of ``size_mb``, at least 1 and at most 256."""
    return float(min(256, max(1, size_mb // 4)))


def deadline_for(step: str, remaining_s: float, pending: list[str]) -> float:
    """The seconds ``step`` may run: its :data:`WEIGHTS` share of ``remaining_s`` among ``pending``, at least
    :data:`FLOOR_S`, at most ``remaining_s``."""
    if step not in pending:
        raise ValueError(f"step {step!r} is not among the pending steps {pending}")
    if remaining_s <= 0:
        return 0.0
    share = remaining_s * WEIGHTS[step] / sum(WEIGHTS[s] for s in pending)
    return min(remaining_s, max(share, FLOOR_S))


def skip_reason(step: str, facts: dict[str, Any], opts: Options) -> str | None:
    """Why ``step`` cannot measure anything on the kind ``facts`` describe (host memory, too few devices, no ipc
    engine), or ``None``."""
    if not facts:
        return None
    kind, count = facts["device"], facts["device_count"]
    if step == "offload" and facts["host_memory"]:
        return f"{kind} keeps tensors in host memory: nothing to offload"
    ranks = {"sync": 1 + opts.rollouts, "ipc": 3}.get(step)
    if ranks and not facts["host_memory"] and count < ranks:
        return (f"needs {ranks} {kind} devices (one per rank, as {facts['dist_backend']} requires), "
                f"{count} visible")
    if step == "ipc":
        ok, why = facts["ipc_engine"]
        if not ok:
            return f"ipc engine unavailable on {kind}: {why}"
    return None


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def summarize(step: str, figures: dict[str, Any]) -> tuple[str, str, float | None, str]:
    """``(status, key, ratio, note)`` of a benchmark step that returned ``figures``: ``fail`` when a promised
    figure is missing, not positive and finite, or the bytes were not byte-exact."""
    if step == "info":
        names = ", ".join(sorted(set(figures["names"]))) or "-"
        return ("pass", f"{figures['device_count']} x {names}",
                None, f"torch {figures['torch']}, python {figures['python']}, {figures['dist_backend']}, "
                f"ipc {figures['ipc_transport']}")
    if step == "offload":
        ratio = figures.get("warm_ratio")
        note = (f"warm {figures.get('warm_gbps', 0):.2f} GB/s, plain {figures.get('plain_gbps', 0):.2f} GB/s, "
                f"cold x{figures.get('cold_ratio', 0):.2f}, {figures.get('bytes', 0) / 2**20:.0f} MiB, "
                f"pinned={figures.get('pinned')}")
        key = "warm round trip / plain copy"
    elif step == "sync":
        run = (figures.get("runs") or [{}])[0]
        ratio = run.get("ratio_vs_raw")
        note = (f"{run.get('gbps', 0):.2f} GB/s vs raw {run.get('raw_gbps', 0):.2f}, "
                f"min x{run.get('ratio_vs_raw_min', 0):.2f}, {figures.get('bytes', 0) / 2**20:.0f} MiB to "
                f"{figures.get('rollouts')} rollout(s), memory within bounds: {run.get('memory_within')}")
        key = "raw broadcast / publish"
    elif step == "ipc":
        ratio = figures.get("ipc_vs_memcpy")
        note = (f"{figures.get('ipc_gbps', 0):.2f} GB/s ({figures.get('transport')}), memcpy "
                f"{figures.get('memcpy_gbps', 0):.2f}, x collective {figures.get('ipc_vs_collective', 0):.2f}, "
                f"byte-exact: {figures.get('verified')}")
        key = "ipc / memcpy"
    else:
        raise ValueError(f"no summary for step {step!r}")
    if not _finite_positive(ratio):
        return "fail", key, None, f"no positive finite ratio ({ratio!r}); " + note
    if step == "ipc" and not figures.get("verified"):
        return "fail", key, ratio, "not byte-exact; " + note
    return "pass", key, float(ratio), note


def _cpu_name() -> str:
    """The host processor's model name (Linux's ``/proc/cpuinfo``), else the machine type (``x86_64``)."""
    import platform

    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ipc_engine(kind: str) -> list[Any]:
    """``[ok, reason]`` of the ipc checkpoint engine on ``kind``."""
    import ckpt

    try:
        return list(ckpt.checkpoint_engine_availability("ipc", kind))
    except ckpt.UnknownCheckpointEngineError as exc:  # it failed to import: the reason is in the message
        return [False, str(exc)]


def _facts(device: str | None) -> dict[str, Any]:
    """The ``info`` step: what the check runs on, as plain data (resolves and probes the kind)."""
    import platform

    import torch

    import ckpt
    import hal

    spec = hal.resolve_device(device)
    described = hal.describe(spec.kind)
    count = described["device_count"] if described["device_count"] is not None else 0
    module = hal.get_torch_device(spec.kind)
    if spec.host_memory:
        names = [_cpu_name()]
    else:
        get_name = getattr(module, "get_device_name", None)
        names = [str(get_name(i)) if get_name else f"{spec.name}:{i}" for i in range(count)]
    env = spec.visible_devices_env
    return {"device": spec.kind, "device_name": spec.name, "dist_backend": spec.dist_backend,
            "host_memory": spec.host_memory, "simulated": spec.device_memory_in_host, "device_count": count,
            "names": names, "visible_devices_env": env, "visible_devices": os.environ.get(env) if env else None,
            "ipc_transport": spec.ipc_transport(),
            "ipc_engine": _ipc_engine(spec.kind),
            "torch": torch.__version__, "python": platform.python_version(),
            "checkpoint_engines": ckpt.checkpoint_engine_status(spec.kind),
            "kinds": [hal.describe(k) for k in hal.known_kinds()]}


def run_step(step: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run one benchmark step in this process; returns its figures. ``params``: ``device``, and for the
    benchmarks ``size_mb``, ``rounds``, ``rollouts``, ``bucket_mb`` (MiB), ``timeout_s``."""
    device = params.get("device")
    if step == "info":
        return _facts(device)
    if step == "offload":
        from hal.apps.benchmarks import bench_offload

        return bench_offload.run(params["size_mb"], device, params["rounds"])
    if step == "sync":
        from hal.apps.benchmarks import bench_sync

        return bench_sync.run(params["size_mb"], device, params["rollouts"], params["rounds"], params["bucket_mb"],
                              timeout=params["timeout_s"])
    if step == "ipc":
        from hal.apps.benchmarks import bench_ipc

        return bench_ipc.run(params["size_mb"], device, params["rounds"], params["bucket_mb"])
    raise ValueError(f"unknown step {step!r}; one of info, offload, sync, ipc")


def _child_env() -> dict[str, str]:
    """This environment, with the checkout and this folder first on ``PYTHONPATH`` (hal may not be installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SCRIPTS), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_process(argv: list[str], deadline_s: float, log: pathlib.Path) -> tuple[int | None, float]:
    """Run ``argv`` in a new process group, output to ``log``; ``(exit code, seconds)``, the code ``None`` when it
    passed ``deadline_s`` (then SIGTERM, SIGKILL :data:`GRACE_S` later)."""
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_child_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(deadline_s, 0.01))
        except subprocess.TimeoutExpired:
            rc = None
            _stop_group(proc)
        except BaseException:  # KeyboardInterrupt: take the step's processes down with the check
            _stop_group(proc)
            raise
    return rc, time.monotonic() - start


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (it leads one), SIGKILL after :data:`GRACE_S` if it still runs."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def _tail(log: pathlib.Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return text[-TAIL_CHARS:]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _bench_step(step: str, params: dict[str, Any], deadline_s: float, workdir: pathlib.Path) -> StepResult:
    """Run ``step`` in a child process under ``deadline_s``; its figures come back through a JSON file."""
    result_path, log = workdir / f"{step}.json", workdir / f"{step}.log"
    argv = [sys.executable, "-m", MODULE, step, json.dumps(params), str(result_path)]
    rc, seconds = _run_process(argv, deadline_s, log)
    res = StepResult(step, "fail", seconds, deadline_s)
    if rc is None:
        res.status, res.note, res.log_tail = "timeout", f"stopped after its {deadline_s:.0f} s", _tail(log)
        return res
    if rc != 0 or not result_path.exists():
        tail = _tail(log)
        res.note, res.log_tail = f"exit {rc}: {_last_line(tail)}", tail
        return res
    res.figures = json.loads(result_path.read_text())
    res.status, res.key, res.ratio, res.note = summarize(step, res.figures)
    if res.status != "pass":
        res.log_tail = _tail(log)
    return res


SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|rerun)")
PROGRESS = re.compile(r"^([.sFExXR]+)\s*(\[\s*(\d+)%\])?$")  # a -q progress line
PROGRESS_LETTERS = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed",
                    "R": "rerun"}


def count_results(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``output`` and ``percent``; without a summary (past the
    deadline), counted from ``-q``'s progress letters."""
    counts = dict.fromkeys(("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected", "rerun",
                            "percent"), 0)
    for line in reversed(output.splitlines()):
        found = SUMMARY.findall(line)
        if found and re.search(r"\bin [\d.]+s\b", line):
            for n, what in found:
                counts["error" if what.startswith("error") else what] += int(n)
            counts["percent"] = 100
            return counts
    for line in output.splitlines():
        match = PROGRESS.match(line.strip())
        if match:
            for letter in match.group(1):
                counts[PROGRESS_LETTERS[letter]] += 1
            if match.group(3):
                counts["percent"] = int(match.group(3))
    return counts


def lane_argv(kind: str, opts: Options) -> list[str]:
    """The ``tests`` step's command line: pytest on ``opts.tests`` with ``--hal-device kind`` and this plugin
    (``-raR`` where pytest-rerunfailures is missing)."""
    argv = [sys.executable, "-m", "pytest", *opts.tests, "--hal-device", kind, "-p", MODULE, "-q", "-rfE",
            "-p", "no:cacheprovider"]
    if opts.workers not in ("", "0") and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", opts.workers]
    if importlib.util.find_spec("pytest_rerunfailures") is None:
        argv += ["-o", "addopts=-raR"]
    if opts.tests_k:
        argv += ["-k", opts.tests_k]
    return argv


def _tests_step(kind: str, opts: Options, deadline_s: float, workdir: pathlib.Path) -> StepResult:
    log = workdir / "tests.log"
    argv = lane_argv(kind, opts)
    rc, seconds = _run_process(argv, deadline_s, log)
    output = log.read_text(errors="replace") if log.exists() else ""
    counts = count_results(output)
    ran = counts["passed"] + counts["failed"] + counts["error"]
    res = StepResult("tests", "fail", seconds, deadline_s, figures={"argv": argv[1:], "exit_code": rc, **counts})
    res.key = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
               f"{counts['skipped']} skipped")
    res.ratio = counts["passed"] / ran if ran else None
    if rc is None:
        res.status = "timeout"
        share = f" (about {counts['percent']}% of the lane)" if counts["percent"] else ""
        res.note = (f"stopped after its {deadline_s:.0f} s with {ran + counts['skipped']} tests done{share}; "
                    "its log holds what ran")
    elif rc == 0:
        res.status, res.note = "pass", f"pytest --hal-device {kind} (device lane only)"
    else:
        res.note = f"pytest exit {rc}: " + ("no test selected" if rc == 5 else _last_line(output))
    if res.status != "pass":
        res.log_tail = output[-TAIL_CHARS:]
    return res


def run_check(opts: Options, workdir: pathlib.Path | None = None) -> dict[str, Any]:
    """Run the check's steps within ``opts.budget_s``; returns ``{"ok", "device", ..., "steps": [...]}``. Logs go
    to ``workdir`` (a temporary folder when ``None``)."""
    unknown = sorted(set(opts.steps) - set(STEPS))
    if unknown or opts.budget_s <= 0 or min(opts.rounds, opts.rollouts) < 1 or (opts.size_mb or 1) < 1:
        raise ValueError(f"steps must be among {STEPS} (got {list(opts.steps)}), budget_s, rounds, rollouts and "
                         f"size_mb positive (got {opts.budget_s}, {opts.rounds}, {opts.rollouts}, {opts.size_mb})")
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="hal-accel-check-") as tmp:
            return run_check(opts, pathlib.Path(tmp))
    start = time.monotonic()
    pending = [s for s in STEPS if s == "info" or s in opts.steps]
    results: list[StepResult] = []
    facts: dict[str, Any] = {}
    kind = opts.device
    size = bucket = None
    while pending:
        step = pending[0]
        remaining = opts.budget_s - (time.monotonic() - start)
        reason = skip_reason(step, facts, opts)
        if reason is not None:
            results.append(StepResult(step, "skip", 0.0, 0.0, note=reason))
            pending.pop(0)
            continue
        pending.pop(0)  # the budget is shared among the steps that will run (a later skip takes nothing)
        deadline = deadline_for(step, remaining, [step, *(s for s in pending if skip_reason(s, facts, opts) is None)])
        if deadline <= 0:
            results.append(StepResult(step, "timeout", 0.0, 0.0, note="the budget was spent before it started"))
            continue
        if step == "tests":
            res = _tests_step(kind, opts, deadline, workdir) if kind else \
                StepResult(step, "fail", 0.0, deadline, note="no device kind: the info step failed")
        else:
            params: dict[str, Any] = {"device": kind}
            if step != "info":
                params.update(size_mb=size, rounds=opts.rounds, rollouts=opts.rollouts, bucket_mb=bucket,
                              timeout_s=deadline)
            res = _bench_step(step, params, deadline, workdir)
        results.append(res)
        if step == "info" and res.status == "pass":
            facts = res.figures
            kind = facts["device"]
        if step == "info":
            size = opts.size_mb or default_size_mb(facts.get("host_memory", True), facts.get("simulated", True))
            bucket = opts.bucket_mb or default_bucket_mb(size)
    ok = all(r.status in ("pass", "skip") for r in results)
    return {"ok": ok, "device": kind, "budget_s": opts.budget_s, "elapsed_s": time.monotonic() - start,
            "size_mb": size, "bucket_mb": bucket, "facts": facts, "steps": [dataclasses.asdict(r) for r in results]}


def print_table(result: dict[str, Any], console: Any = None) -> None:
    """Print :func:`run_check`'s result as one table, then PASS or FAIL."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    facts = result.get("facts") or {}
    verdict = "PASS" if result["ok"] else "FAIL"
    title = (f"accelerator check on {result['device'] or '?'} ({facts.get('device_count', '?')} device(s)), "
             f"{result['size_mb']} MiB, {result['elapsed_s']:.0f} of {result['budget_s']:.0f} s: {verdict}")
    table = Table(title=title, caption="seconds: taken / given; ratio: above 1 is faster than the "
                  "reference (tests: passed / run)")
    for col, justify in (("step", "left"), ("status", "left"), ("seconds", "right"), ("ratio", "right"),
                         ("key", "left"), ("note", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    colour = {"pass": "green", "fail": "red", "timeout": "red", "skip": "yellow"}
    for s in result["steps"]:
        table.add_row(s["name"], f"[{colour[s['status']]}]{s['status']}[/]",
                      f"{s['seconds']:.1f}/{s['deadline_s']:.0f}", "" if s["ratio"] is None else f"{s['ratio']:.2f}",
                      s["key"], s["note"])
    console.print(table)
    for s in result["steps"]:
        if s["status"] in ("fail", "timeout") and s["log_tail"]:
            console.print(f"--- {s['name']}: end of its output ---", markup=False)
            console.print(s["log_tail"][-1500:], markup=False, highlight=False)
    console.print(f"accelerator check: {verdict}", markup=False)


def parse_args(argv: list[str] | None = None) -> Options:
    """The script's command line as :class:`Options` (argparse: the check runs where the CLI's extras may not)."""
    p = argparse.ArgumentParser(prog="accel_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="device kind (default: $HAL_DEVICE, else the first available)")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole check (default 480)")
    p.add_argument("--size-mb", type=int, help="MiB per benchmark (default 1024 on an accelerator, else 64)")
    p.add_argument("--rounds", type=int, default=3, help="timed repetitions per figure (default 3)")
    p.add_argument("--rollouts", type=int, default=1, help="sync: rollout processes (default 1)")
    p.add_argument("--bucket-mb", type=float, help="sync, ipc: bucket MiB (default size/4, 1 to 256)")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS, help="steps to run (default all)")
    p.add_argument("--tests", nargs="+", default=["tests"], help="tests: pytest paths (default tests)")
    p.add_argument("--tests-k", help="tests: a pytest -k expression narrowing the device lane")
    p.add_argument("--workers", default="auto", help="tests: pytest -n (default auto; 0: one process)")
    p.add_argument("--json", dest="json_path", help="also write the result as JSON to this file")
    a = p.parse_args(argv)
    return Options(device=a.device, budget_s=a.budget_s, size_mb=a.size_mb, rounds=a.rounds, rollouts=a.rollouts,
                   bucket_mb=a.bucket_mb, steps=tuple(a.steps), tests=tuple(a.tests), tests_k=a.tests_k,
                   workers=a.workers, json_path=a.json_path)


def main(argv: list[str] | None = None) -> int:
    """Run the check: exit status 0 when every step passed or was skipped, 1 otherwise, 2 for a bad command line."""
    opts = parse_args(argv)
    out = os.environ.get("OUT")
    out = pathlib.Path(out) if out and os.path.isdir(out) else None
    with tempfile.TemporaryDirectory(prefix="hal-accel-check-") as tmp:
        try:
            result = run_check(opts, pathlib.Path(tmp))
        except ValueError as exc:
            print(f"accel_check.py: {exc}", file=sys.stderr)
            return 2
        log = pathlib.Path(tmp) / "tests.log"
        if out is not None and log.exists():  # the whole log, for a host whose folders do not outlive the run
            shutil.copyfile(log, out / "accel_check_tests.log")
    print_table(result)
    paths = [pathlib.Path(opts.json_path)] if opts.json_path else []
    if out is not None:
        paths.append(out / "accel_check.json")
    for path in paths:
        path.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """As a pytest plugin: keep only the tests parametrized over a kind ``--hal-device`` names."""
    from hal.pytest_plugin import requested_kinds

    kinds = set(requested_kinds(config)[0])
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        (keep if callspec is not None and callspec.params.get("hal_device") in kinds else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _child(argv: list[str]) -> int:
    """``python -m accel_check STEP PARAMS_JSON RESULT_PATH``: one step, figures to ``RESULT_PATH``."""
    step, params, path = argv
    figures = run_step(step, json.loads(params))
    pathlib.Path(path).write_text(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":  # as a script, the check; with python -m (no __spec__ otherwise), one step's child
    sys.exit(main() if __spec__ is None else _child(sys.argv[1:]))
