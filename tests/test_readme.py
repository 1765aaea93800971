"""The README's code blocks, run as written (issue: a README example that crashed for a new user).

Every ``python``, ``bash`` and ``yaml`` block carries an HTML comment on the line above it saying how CI runs it
(invisible on the rendered page):

* ``<!-- readme-test: run -->``: executed as written, in a fresh folder outside the clone (the README tells users
  to run their scripts there), with ``.venv`` and ``scripts`` reachable as in the clone and ``$TMPDIR`` a fresh
  folder that must be empty afterwards (nothing left behind);
* ``<!-- readme-test: file NAME -->`` (python): written to ``NAME`` in that folder, for a later ``run`` block;
* ``<!-- readme-test: check -->`` (bash): too big for a test run (gigabytes, minutes); every ``hal`` command in it
  is parsed and checked as the command checks its arguments before any work (``tests/readme_commands.py``), and
  ``scripts/setup*.sh`` is left to ``.ci/run``, which runs it;
* ``<!-- readme-test: skip: REASON -->``: needs what a test cannot have (a Ray cluster of nodes); REASON says so;
* ``<!-- readme-test: synopsis -->`` (text): every flag of every ``hal`` command appears in it;
* ``<!-- readme-test: verl-config -->`` (yaml): verl's config block; its backend is registered by the plugin.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- readme-test: (.+?) -->\s*$")


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    how: str  # the annotation, "" when there is none
    body: str

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def blocks() -> list[Block]:
    """Every fenced block of the README with the annotation on the line above it."""
    lines = README.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.match(lines[i - 1]) if i else None
            found.append(Block(i + 1, opened.group(1), mark.group(1) if mark else "", "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return found


BLOCKS = blocks()
EXECUTABLE = ("python", "bash", "yaml")


def test_every_runnable_block_says_how_ci_runs_it():
    allowed = {"python": ("run", "file "), "bash": ("run", "check", "skip: "), "yaml": ("verl-config",)}
    bad = [f"line {b.line} ({b.lang}): {b.how or 'no readme-test comment'}" for b in BLOCKS if b.lang in EXECUTABLE
           and not any(b.how == a or (a.endswith(" ") and b.how.startswith(a) and b.how[len(a):].strip())
                       for a in allowed[b.lang])]
    assert not bad, "README blocks without a valid <!-- readme-test: ... --> line above them: " + "; ".join(bad)
    assert sum(b.how == "run" for b in BLOCKS) >= 3  # the API example, its launch and the cheat sheet at least


def workdir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A folder outside the clone with the clone's environments and scripts linked in, and the environment a
    block runs with: the venv's bin first on PATH, ``$TMPDIR`` a fresh empty folder, no ``HAL_DEVICE``."""
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", ".venv-vllm", "scripts"):
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE" and not k.startswith("PYTEST")}
    env.update(PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(temp))
    return work, env


def leftovers(env: dict[str, str]) -> list[str]:
    """What a block left in its ``$TMPDIR``, but torch's own compile cache (``torchinductor_<user>``: one folder
    per user, reused by every later run; plain torch makes it at a first AdamW step)."""
    return sorted(p.name for p in pathlib.Path(env["TMPDIR"]).iterdir() if not p.name.startswith("torchinductor_"))


def run_block(block: Block, work: pathlib.Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    if block.lang == "python":
        command = [sys.executable, "-c", block.body]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.body]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.how == "run"], ids=lambda b: b.id)
def test_a_run_block_runs_as_written_and_leaves_nothing_behind(block, tmp_path):
    work, env = workdir(tmp_path)
    for earlier in BLOCKS:  # the files the README asked to save before this block
        if earlier.how.startswith("file ") and earlier.line < block.line:
            (work / earlier.how.split()[1]).write_text(earlier.body)
    out = run_block(block, work, env, timeout=360)
    assert out.returncode == 0, f"README line {block.line} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    assert leftovers(env) == [], f"README line {block.line} left {leftovers(env)} in $TMPDIR"


CHECK_PRELUDE = """
hal() { python -m tests.readme_commands "$@"; }
"""


def as_checked(body: str) -> str:
    """The block with every ``hal`` pointed at the checker and the setup scripts left to .ci/run."""
    body = re.sub(r"\.venv(-vllm)?/bin/hal\b", "hal", body)
    return re.sub(r"bash scripts/setup(_vllm)?\.sh", "true", body)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.how == "check"], ids=lambda b: b.id)
def test_a_check_block_has_only_valid_hal_commands(block, tmp_path):
    work, env = workdir(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    body = as_checked(block.body)
    assert "hal " in body
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", CHECK_PRELUDE + body], cwd=work, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"README line {block.line}:\n{out.stdout}\n{out.stderr}"
    commands = [line for line in body.splitlines() if re.search(r"(^|&& |\s)hal ", line.split("#")[0])]
    assert out.stdout.count("checked: hal ") == len(commands), out.stdout


def flags_of(command: type) -> set[str]:
    """The flags of a subcommand dataclass as a user types them (``--no-x`` for a flag that defaults on)."""
    flags = set()
    for field in dataclasses.fields(command):
        if field.name == "script":
            continue
        name = field.name.replace("_", "-")
        flags.add(f"--no-{name}" if field.default is True else f"--{name}")
    return flags


def test_the_synopsis_names_every_flag_of_every_command():
    from hal.apps.cli.main import SUBCOMMANDS

    synopsis = [b for b in BLOCKS if b.how == "synopsis"]
    assert len(synopsis) == 1
    text = synopsis[0].body
    for name, command in SUBCOMMANDS.items():
        lines = " ".join(line for line in re.split(r"\n(?=hal )", text) if line.startswith(f"hal {name}"))
        missing = sorted(f for f in flags_of(command) if not re.search(re.escape(f) + r"\b", lines))
        assert not missing, f"hal {name}'s synopsis in the README lacks {missing}"


def test_the_verl_config_block_names_a_backend_the_plugin_registers():
    import yaml

    blocks_ = [b for b in BLOCKS if b.how == "verl-config"]
    assert blocks_
    for block in blocks_:
        config = yaml.safe_load(block.body)["actor_rollout_ref"]["rollout"]["checkpoint_engine"]
        assert config["custom_backend_module"] == "ckpt.verl_plugin"
        pytest.importorskip("verl")
        import importlib

        plugin = importlib.import_module(config["custom_backend_module"])
        assert config["backend"] in plugin.REGISTERED
        assert set(config.get("engine_kwargs", {})) <= set(plugin.REGISTERED)
