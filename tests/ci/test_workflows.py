"""The vendor CI matrix and the workflows generated from it, judged by the field's tools and by what a
vendor runner needs.

* actionlint and the GitHub workflow JSON schema (check-jsonschema's bundled copy, no network) accept every
  committed workflow, and reject a broken one (so the checks do check).
* Each job could run where it claims to: Python exists before the first ``python`` (the image brings it,
  or a step installs it; nvidia/cuda images have none), the cuda container gets the GPUs, the Ascend
  container gets the device nodes and driver files Ascend documents for containers, and shared memory for
  multi-process tests.
* Each lane names its kind with ``--hal-device``, so an unavailable kind fails the run (the plugin raises a
  usage error; tests/hal/test_pytest_plugin.py proves that part) instead of skipping every test.
* The torch and Python ranges pyproject.toml declares start at the oldest versions the matrix tests.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
sys.path.insert(0, str(ROOT / "ci"))
import generate  # noqa: E402  (ci/ is a scripts folder, not a package)

BIN = pathlib.Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; it comes with the test extra (pip install -e '.[test]')")
    return path


def _workflow_files() -> list[pathlib.Path]:
    files = sorted(WORKFLOWS.glob("hal-*.yml"))
    assert len(files) == len(generate.load_matrix()), files
    return files


def _actionlint(*paths: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("actionlint"), "-no-color", "-config-file", str(ROOT / ".github" / "actionlint.yaml"),
                           *map(str, paths)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _schema(*paths: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                           *map(str, paths)], capture_output=True, text=True, timeout=120, cwd=ROOT)


# -- the generator and the committed files ------------------------------------------------------------------

def test_committed_workflows_match_the_matrix():
    out = subprocess.run([sys.executable, str(ROOT / "ci" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_fails_when_a_workflow_is_stale(tmp_path):
    # A copy of the tree whose matrix changed but whose workflows did not.
    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "generate.py", tmp_path / "ci")
    shutil.copytree(ROOT / ".github", tmp_path / ".github")
    matrix = (ROOT / "ci" / "matrix.yaml").read_text().replace('"3.10", "3.11", "3.12"', '"3.11", "3.12"')
    (tmp_path / "ci" / "matrix.yaml").write_text(matrix)
    out = subprocess.run([sys.executable, str(tmp_path / "ci" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "hal-cpu.yml" in out.stdout


def test_malformed_matrix_is_refused(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("lanes:\n  - name: x\n    device: cpu\n")
    with pytest.raises(generate.MatrixError, match="lane 'x' lacks"):
        generate.load_matrix(bad)


def test_an_image_python_that_disagrees_with_the_python_axis_is_refused(tmp_path):
    text = (ROOT / "ci" / "matrix.yaml").read_text()
    bad = tmp_path / "matrix.yaml"
    bad.write_text(text.replace('image_python: "3.11"', 'image_python: "3.10"'))
    with pytest.raises(generate.MatrixError, match="brings Python 3.10"):
        generate.load_matrix(bad)


# -- the field's validators ---------------------------------------------------------------------------------

def test_actionlint_accepts_every_generated_workflow():
    out = _actionlint(*_workflow_files())
    assert out.returncode == 0, out.stdout + out.stderr


def test_github_workflow_schema_accepts_every_generated_workflow():
    out = _schema(*_workflow_files())
    assert out.returncode == 0, out.stdout + out.stderr


def _broken_copy(tmp_path: pathlib.Path, old: str, new: str) -> pathlib.Path:
    text = (WORKFLOWS / "hal-cuda.yml").read_text()
    assert old in text, old
    path = tmp_path / ".github" / "workflows" / "hal-cuda.yml"
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(old, new))
    return path


def test_actionlint_rejects_a_typo_in_an_expression_and_an_unknown_runner_label(tmp_path):
    path = _broken_copy(tmp_path, "${{ matrix.torch }}\" ${{ vars", "${{ matrix.troch }}\" ${{ vars")
    out = _actionlint(path)
    assert out.returncode == 1 and "troch" in out.stdout, out.stdout
    path.write_text(path.read_text().replace("${{ matrix.troch }}", "${{ matrix.torch }}")
                    .replace("- gpu-nvidia", "- gpu-nvidea"))
    out = _actionlint(path)
    assert out.returncode == 1 and "gpu-nvidea" in out.stdout, out.stdout


def test_the_schema_rejects_a_misspelled_job_key(tmp_path):
    out = _schema(_broken_copy(tmp_path, "timeout-minutes: 60", "timeout-minutes: sixty"))
    assert out.returncode == 1, out.stdout


# -- what a vendor runner needs -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[dict, dict]]:
    """``{lane name: (lane, job)}`` from the committed workflow files."""
    out = {}
    for lane in generate.load_matrix():
        doc = yaml.safe_load((WORKFLOWS / f"hal-{lane['name']}.yml").read_text())
        out[lane["name"]] = (lane, doc["jobs"]["test"])
    return out


def _runs(step: dict) -> str:
    return step.get("run", "")


def _calls_python(step: dict) -> bool:
    return bool(re.search(r"(^|\s|\n)(python3?|pip3?|hal)\s", _runs(step) + " "))


def _installs_python(step: dict) -> bool:
    uses = step.get("uses", "")
    return uses.startswith("actions/setup-python@") or bool(re.search(r"\buv venv\b.*--python", _runs(step)))


IMAGES_WITHOUT_PYTHON = ("nvidia/cuda:",)  # NVIDIA's CUDA base/runtime/devel images ship no Python


def test_python_exists_before_the_first_python_command(jobs):
    for name, (lane, job) in jobs.items():
        steps = job["steps"]
        first = next(i for i, s in enumerate(steps) if _calls_python(s))
        installed = any(_installs_python(s) for s in steps[:first])
        image = job.get("container", {}).get("image")
        if image is None or image.startswith(IMAGES_WITHOUT_PYTHON):
            assert installed, f"{name}: step {first} runs Python, which nothing installed before it"
        else:
            # an image that brings Python says which in its tag (ascendai/cann: -py3.11), and that is the one tested
            brought = lane["image_python"]
            assert installed or (brought and f"py{brought}" in image and job["strategy"]["matrix"]["python"] == [brought]), name
        if installed and image is not None:
            # a Python installed inside a container must come first on PATH for the later steps
            assert any("GITHUB_PATH" in _runs(s) for s in steps[:first]), name


def _options(job: dict) -> list[str]:
    return shlex.split(job.get("container", {}).get("options", ""))


def _mounts(job: dict) -> set[tuple[str, str]]:
    pairs = set()
    for volume in job.get("container", {}).get("volumes", []):
        host, _, rest = volume.partition(":")
        pairs.add((host, rest.split(":")[0]))
    return pairs


def _devices(options: list[str]) -> set[str]:
    found = set()
    for i, opt in enumerate(options):
        if opt.startswith("--device="):
            found.add(opt.split("=", 1)[1].split(":")[0])
        elif opt == "--device" and i + 1 < len(options):
            found.add(options[i + 1].split(":")[0])
    return found


def test_the_cuda_container_gets_the_gpus(jobs):
    cuda = [(lane, job) for lane, job in jobs.values() if lane["device"] == "cuda"]
    assert cuda
    for _lane, job in cuda:
        options = _options(job)
        assert "--gpus=all" in options or ("--gpus" in options and options[options.index("--gpus") + 1] == "all"), options
        assert any("nvidia-smi" in _runs(s) for s in job["steps"])


ASCEND_NODES = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
ASCEND_FILES = ("/usr/local/Ascend/driver", "/usr/local/bin/npu-smi", "/etc/ascend_install.info",
                "/usr/local/Ascend/driver/version.info")


def test_the_ascend_container_gets_device_nodes_and_driver_files(jobs):
    npu = [(lane, job) for lane, job in jobs.values() if lane["device"] == "npu"]
    assert npu
    for _lane, job in npu:
        devices = _devices(_options(job))
        assert ASCEND_NODES <= devices, devices
        assert any(re.fullmatch(r"/dev/davinci\d+", d) for d in devices), devices
        mounts = _mounts(job)
        for path in ASCEND_FILES:  # mounted at the same path (the driver directory or its lib64)
            assert any(host == target and (host == path or host.startswith(path + "/")) for host, target in mounts), path
        assert any("npu-smi" in _runs(s) for s in job["steps"])
        runs = "\n".join(map(_runs, job["steps"]))
        assert 'torch-npu==${{ matrix.torch }}' in runs  # the plugin matches the torch under test


def test_containers_give_multiprocess_tests_shared_memory(jobs):
    # docker's default /dev/shm is 64 MiB; torch.multiprocessing passes tensors through it
    for name, (_lane, job) in jobs.items():
        if "container" in job:
            options = _options(job)
            assert "--ipc=host" in options or any(o.startswith("--shm-size") for o in options), name


def test_every_lane_names_its_kind_so_an_unavailable_one_fails_the_run(jobs):
    for name, (lane, job) in jobs.items():
        pytest_runs = [_runs(s) for s in job["steps"] if "python -m pytest" in _runs(s)]
        assert len(pytest_runs) == 1, name
        kinds = re.search(r"--hal-device[ =](\S+)", pytest_runs[0])
        assert kinds and lane["device"] in kinds.group(1).split(","), (name, pytest_runs)
        assert f"--device {lane['device']}" in "\n".join(map(_runs, job["steps"]))  # hal info / sync too


# -- declared ranges = tested ranges ------------------------------------------------------------------------

def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _lower_bound(spec: SpecifierSet) -> Version:
    bounds = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert len(bounds) == 1, f"expected one lower bound in {spec}"
    return bounds[0]


def test_the_declared_torch_range_starts_at_the_oldest_tested_torch():
    torch_req = next(Requirement(r) for r in _project()["dependencies"] if Requirement(r).name == "torch")
    tested = sorted({Version(v) for lane in generate.load_matrix() for v in lane["torch"]})
    assert _lower_bound(torch_req.specifier) == tested[0], (str(torch_req.specifier), tested)
    assert all(torch_req.specifier.contains(v) for v in tested)


def test_the_declared_python_range_starts_at_the_oldest_tested_python():
    declared = SpecifierSet(_project()["requires-python"])
    tested = sorted({Version(v) for lane in generate.load_matrix() for v in lane["python"]})
    assert _lower_bound(declared) == tested[0], (str(declared), tested)
