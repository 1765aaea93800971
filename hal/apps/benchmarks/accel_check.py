"""The prepared accelerator check: what to run, in one go, on a host lent with a GPU or an NPU.

Five steps, each in its own process with its own deadline, so that a hung or crashed step is reported and the
check goes on; the whole fits a time budget (480 s by default, under the 8 minutes a lent host allows):

* ``info``: the environment (torch and Python versions, the resolved device kind, how many devices and their
  names, the checkpoint engines available on the kind);
* ``tests``: the device lane of the test suite: ``pytest --hal-device KIND -n auto``, keeping only the tests
  parametrized over the device kind (``hal_device``), the rest being the same on every host;
* ``offload``: offload + onload of a model against a plain pinned copy of its bytes (:mod:`.bench_offload`;
  key ratio: the warm round trip's bandwidth over the plain copy's);
* ``sync``: the main job's weight sync against a raw broadcast of the same bytes (:mod:`.bench_sync`; key
  ratio: raw time / publish time, median over the steps);
* ``ipc``: the same-host ipc checkpoint engine against one memcpy and the collective engine (:mod:`.bench_ipc`;
  key ratio: ipc throughput / memcpy throughput), where the kind's ipc engine is available.

Each step ends ``pass``, ``fail``, ``timeout`` or ``skip`` (with the reason: nothing moves on a host-memory kind,
too few devices for one rank per device, the ipc engine unavailable); the check passes when no step failed or
timed out. One table sums it up (:func:`print_table`); :func:`run_check` returns the same as plain data.

    python scripts/accel_check.py                          # the resolved kind, 480 s, 1 GiB on an accelerator
    python scripts/accel_check.py --device npu-sim --size-mb 8 --tests-k offload --json check.json

Sizes: 1024 MiB on an accelerator, 64 MiB on cpu and on a simulated device (``--size-mb`` overrides). Where
``$OUT`` is set (a lent host's results folder), the JSON and the tests' log are also written there.

This module is also a pytest plugin (``-p hal.apps.benchmarks.accel_check``, as the ``tests`` step loads it):
it deselects every test not parametrized over a kind named by ``--hal-device``.
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

STEPS = ("info", "tests", "offload", "sync", "ipc")
"""Every step, in the order they run."""
WEIGHTS = {"info": 1.0, "tests": 8.0, "offload": 3.0, "sync": 4.0, "ipc": 4.0}
"""Each step's share of the budget, relative to the steps still to run: time a step leaves unused goes to
the later ones."""
FLOOR_S = 30.0
"""The least deadline a step gets (seconds), budget permitting: a start-up costs seconds on a loaded host."""
GRACE_S = 5.0
"""Seconds a step past its deadline gets between SIGTERM and SIGKILL (to remove its shared memory)."""
ROOT = pathlib.Path(__file__).resolve().parents[3]
"""The checkout this module lives in (the ``tests`` step runs its suite from there)."""
TAIL_CHARS = 4000
"""How much of a step's output (stdout and stderr) the result keeps."""
MODULE = "hal.apps.benchmarks.accel_check"
"""This module's name: the steps' child processes run it, and pytest loads it as a plugin."""


@dataclasses.dataclass
class Options:
    """What to check and how long it may take."""

    device: str | None = None
    """Device kind; ``None``: ``$HAL_DEVICE``, else the first available (as ``hal`` resolves it)."""
    budget_s: float = 480.0
    """Seconds the whole check may take (each step gets a share of what is left; see :data:`WEIGHTS`)."""
    size_mb: int | None = None
    """MiB moved by each benchmark; ``None``: 1024 on an accelerator, 64 on cpu and on a simulated device."""
    rounds: int = 3
    """Timed repetitions per benchmark figure (medians are reported); sync: its timed steps."""
    rollouts: int = 1
    """sync: rollout processes (each needs its own device on an accelerator kind, as NCCL and HCCL require)."""
    bucket_mb: float | None = None
    """sync, ipc: the engines' bucket size in MiB; ``None``: a quarter of the size, between 1 and 256."""
    steps: tuple[str, ...] = STEPS
    """The steps to run (a subset of :data:`STEPS`, run in that order; ``info`` always runs)."""
    tests: tuple[str, ...] = ("tests",)
    """tests: pytest's paths, relative to the checkout."""
    tests_k: str | None = None
    """tests: a pytest ``-k`` expression narrowing the device lane."""
    workers: str = "auto"
    """tests: pytest-xdist's ``-n`` (``auto``: one worker more than the cores; ``0``: in one process)."""
    json_path: str | None = None
    """Where to write the result as JSON (also ``$OUT/accel_check.json`` where ``$OUT`` is set)."""


@dataclasses.dataclass
class StepResult:
    """How one step ended."""

    name: str
    status: str
    """``pass``, ``fail``, ``timeout`` or ``skip``."""
    seconds: float
    """Wall seconds the step ran (0 when it did not start)."""
    deadline_s: float
    """Seconds it was given."""
    key: str = ""
    """What :attr:`ratio` is (``warm / plain copy``), or the step's one-line outcome."""
    ratio: float | None = None
    """The step's key ratio (above 1: faster than the reference), where it has one."""
    note: str = ""
    """Further figures, or why it failed or was skipped."""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Everything the step measured (its benchmark's ``run`` result)."""
    log_tail: str = ""
    """The end of its output, kept when it did not pass."""


def default_size_mb(host_memory: bool, simulated: bool) -> int:
    """MiB a benchmark moves by default: 64 on a host-memory or simulated kind, 1024 on an accelerator."""
    return 64 if host_memory or simulated else 1024


def default_bucket_mb(size_mb: int) -> float:
    """The engines' bucket in MiB by default: a quarter of ``size_mb``, at least 1 and at most 256."""
    return float(min(256, max(1, size_mb // 4)))


def deadline_for(step: str, remaining_s: float, pending: list[str]) -> float:
    """The seconds ``step`` may run: its :data:`WEIGHTS` share of ``remaining_s`` among the ``pending`` steps
    (``step`` among them), at least :data:`FLOOR_S` and at most ``remaining_s`` (0 when nothing is left).

    Raises:
        ValueError: ``step`` is not in ``pending``.
    """
    if step not in pending:
        raise ValueError(f"step {step!r} is not among the pending steps {pending}")
    if remaining_s <= 0:
        return 0.0
    share = remaining_s * WEIGHTS[step] / sum(WEIGHTS[s] for s in pending)
    return min(remaining_s, max(share, FLOOR_S))


def skip_reason(step: str, facts: dict[str, Any], opts: Options) -> str | None:
    """Why ``step`` cannot measure anything on the kind ``facts`` (the ``info`` step's figures) describe, or
    ``None``: nothing moves on a host-memory kind (offload), one rank per device is more than the kind has
    (sync: 1 + ``rollouts`` ranks, ipc: 3), the kind's ipc engine is unavailable. Without facts (``info``
    failed), ``None``: the step runs and reports for itself."""
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
    """``(status, key, ratio, note)`` of a benchmark step that returned ``figures`` (its ``run``'s dict):
    ``fail`` when a figure it promises is missing, not a positive finite number, or the bytes did not arrive
    byte-exact (ipc's ``verified``); else ``pass``.

    Raises:
        ValueError: ``step`` is not ``info``, ``offload``, ``sync`` or ``ipc``.
    """
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
    """``[ok, reason]`` of the ipc checkpoint engine on ``kind``; ``[False, why]`` where it is not registered."""
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
    """Run one benchmark step in this process; returns its figures (see each benchmark's ``run``).

    Args:
        step: ``info``, ``offload``, ``sync`` or ``ipc``.
        params: ``device`` (a kind), and for the benchmarks ``size_mb``, ``rounds``, ``rollouts``, ``bucket_mb``
            (MiB) and ``timeout_s`` (seconds a rendezvous or transfer may take).

    Raises:
        ValueError: an unknown step; whatever the benchmark raises.
    """
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
    """This environment, with the checkout first on ``PYTHONPATH`` (a lent host may not have it installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_process(argv: list[str], deadline_s: float, log: pathlib.Path) -> tuple[int | None, float]:
    """Run ``argv`` from the checkout in a new process group, output to ``log``; ``(exit code, seconds)``, the
    code ``None`` when it passed ``deadline_s``: then its group got SIGTERM, and SIGKILL :data:`GRACE_S` later."""
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
PROGRESS = re.compile(r"^([.sFExXR]+)\s*(\[\s*(\d+)%\])?$")
"""A line of ``pytest -q``'s progress: one letter per test, then the share of the run done."""
PROGRESS_LETTERS = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed",
                    "R": "rerun"}


def count_results(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``output`` (``{"passed": 3, "skipped": 1, "error": 0, ...}``;
    ``errors`` counted as ``error``) and ``percent`` (100). A run stopped before its summary (past its
    deadline) is counted from ``-q``'s progress letters instead, ``percent`` being the last share shown."""
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
    """The command line of the ``tests`` step: pytest on ``opts.tests`` with ``--hal-device kind`` and this
    module as a plugin (only tests parametrized over the kind), ``-n opts.workers`` where pytest-xdist is
    installed, ``-k opts.tests_k`` if given. Where pytest-rerunfailures is missing (the project's ``addopts``
    need it) its options are replaced by ``-raR``."""
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
    """Run the check's steps within ``opts.budget_s``; returns ``{"ok", "device", "budget_s", "elapsed_s",
    "size_mb", "bucket_mb", "steps": [StepResult as a dict, ...]}`` (``ok``: no step failed or timed out).

    Args:
        workdir: where each step's log and figures go (a temporary folder, removed after, when ``None``).

    Raises:
        ValueError: an unknown step in ``opts.steps``, or a budget, size, round or rollout count below 1.
    """
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
    """Print :func:`run_check`'s result as one table: each step's status, seconds (of its deadline), key
    figure and note, then PASS or FAIL."""
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
    """The script's command line as :class:`Options` (argparse: the check runs where the CLI's extras may not).

    Raises:
        SystemExit: a malformed command line (argparse's usage message, exit status 2) or ``--help``.
    """
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
    """``scripts/accel_check.py``: run the check, print its table, write its JSON; exit status 0 when every step
    passed or was skipped with its reason, 1 otherwise, 2 for a malformed command line."""
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
    """As a pytest plugin: keep only the tests parametrized (``hal_device``) over a kind ``--hal-device`` names;
    the others are deselected (they run the same on every host)."""
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
    """``python -m hal.apps.benchmarks.accel_check STEP PARAMS_JSON RESULT_PATH``: one step, run by
    :func:`run_check` in its own process; the figures go to ``RESULT_PATH`` as JSON."""
    step, params, path = argv
    figures = run_step(step, json.loads(params))
    pathlib.Path(path).write_text(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
