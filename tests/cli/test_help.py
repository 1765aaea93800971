"""``hal <command> --help`` as a user reads it: every help text flows as sentences, and launch shows its script."""

import docstring_parser
import pytest
import tyro

from hal.apps.cli.main import SUBCOMMANDS


def render_help(capsys, monkeypatch, command: str, columns: int = 1000) -> list[str]:
    """The lines of ``hal <command> --help`` on a terminal ``columns`` wide (tyro reads $COLUMNS)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as exit_info:
        tyro.extras.subcommand_cli_from_dict(SUBCOMMANDS, args=[command, "--help"], prog="hal")
    assert exit_info.value.code == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_help_text_is_one_line_on_a_wide_terminal(command, capsys, monkeypatch):
    lines = render_help(capsys, monkeypatch, command)
    cls = SUBCOMMANDS[command]
    # the source's docstrings, read as tyro reads them (wrapped, indented), each joined into one sentence run
    fields = {p.arg_name: " ".join(p.description.split())
              for p in docstring_parser.parse_from_object(cls).params if p.description}
    assert len(fields) >= 2
    for name, text in fields.items():
        assert any(text in line for line in lines), f"hal {command} --{name.replace('_', '-')}: help broken: {text!r}"
    description = " ".join(cls.__doc__.split())
    assert description in lines, f"hal {command}: description broken: {description!r}"


def test_a_multi_line_field_docstring_reaches_tyro_as_one_paragraph():
    from hal.apps.cli.sync import Sync

    raw = {p.arg_name: p.description for p in docstring_parser.parse_from_object(Sync).params}
    assert raw["rollout_apply"].count("\n") >= 2  # wrapped in the source: the case tyro 1.0 breaks
    [marker] = [m for m in Sync.__annotations__["rollout_apply"].__metadata__ if hasattr(m, "help")]
    assert marker.help == " ".join(raw["rollout_apply"].split())


def test_launch_usage_and_help_show_the_script_after_a_double_dash(capsys, monkeypatch):
    lines = render_help(capsys, monkeypatch, "launch", columns=120)
    assert lines[0].startswith("usage: hal launch ") and lines[0].endswith(" -- SCRIPT [ARGS...]")
    assert any("-- SCRIPT [ARGS...]" in line and "usage" not in line for line in lines[1:])  # its own entry


def test_a_script_before_the_double_dash_comes_first(monkeypatch):
    from hal.apps.cli import main as m

    seen = []
    monkeypatch.setitem(m.RUNNERS, m.Launch, lambda args: seen.append(args.script) or 0)
    assert m.main(["launch", "--nproc-per-node", "2", "--", "train.py", "--lr", "1", "--", "x"]) == 0
    assert m.main(["launch", "train.py", "--", "--lr", "1"]) == 0
    assert seen == [("train.py", "--lr", "1", "--", "x"), ("train.py", "--lr", "1")]


def test_help_into_a_closed_pipe_ends_quietly():
    """``hal sync --help | head`` printed a tyro traceback ending in BrokenPipeError and exited 1; now it stops
    quietly with 141 (128 + SIGPIPE), as a shell tool does."""
    import subprocess
    import sys

    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before hal writes, as head is after its lines
    proc = subprocess.Popen([sys.executable, "-m", "hal.apps.cli.main", "sync", "--help"], stdout=write_end,
                            stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "100"})
    os.close(write_end)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err
