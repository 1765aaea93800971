"""The vendor CI matrix and the workflows generated from it."""

import pathlib
import shutil
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import generate  # noqa: E402  (ci/ is a scripts folder, not a package)


def test_committed_workflows_match_the_matrix():
    out = subprocess.run([sys.executable, str(ROOT / "ci" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_generator_is_deterministic():
    assert generate.generate() == generate.generate()


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


@pytest.fixture(scope="module")
def workflows():
    lanes = generate.load_matrix()
    docs = {lane["name"]: yaml.safe_load((ROOT / ".github" / "workflows" / f"hal-{lane['name']}.yml").read_text())
            for lane in lanes}
    return lanes, docs


def test_every_lane_names_runner_image_torch_build_and_tests(workflows):
    lanes, docs = workflows
    assert {lane["device"] for lane in lanes} == {"cpu", "npu-sim", "cuda", "npu"}
    for lane in lanes:
        job = docs[lane["name"]]["jobs"]["test"]
        assert job["runs-on"] == lane["runs_on"]
        assert job["strategy"]["matrix"]["torch"] == lane["torch"]
        assert job.get("container", {}).get("image") == lane["image"]
        runs = "\n".join(step.get("run", "") for step in job["steps"])
        assert f"torch_build" not in runs
        assert any(step.get("name", "").startswith(f"Install torch ({lane['torch_build']} build)")
                   for step in job["steps"])
        assert f"python -m pytest {lane['tests']}" in runs
        assert f"--hal-device {lane['device']}" in lane["tests"] and lane["sync"] in runs


def test_ascend_lane_installs_torch_npu_matching_torch_in_a_cann_image(workflows):
    lanes, docs = workflows
    job = docs["ascend"]["jobs"]["test"]
    assert "cann" in job["container"]["image"]
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert 'torch-npu==${{ matrix.torch }}' in runs
    assert "npu" in " ".join(job["runs-on"])


def test_malformed_matrix_is_refused(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("lanes:\n  - name: x\n    device: cpu\n")
    with pytest.raises(generate.MatrixError, match="lane 'x' lacks"):
        generate.load_matrix(bad)
