"""`metainfer generate`'s user-facing errors: one `error:` line, exit code 2, no traceback, before any
model is loaded where the arguments alone say it."""

from __future__ import annotations

import io
import json

import pytest

from metainfer.cli import main


def _run(argv, capsys, monkeypatch, stdin: str | None = None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--model", "/nonexistent/model", "hi"], "model directory not found"),
        (["--max-tokens", "-1", "hi"], "max_tokens must be at least 1"),
        (["--device", "cuda", "hi"], "no CUDA GPU"),
    ],
)
def test_one_error_line_exit_2(argv, says, capsys, monkeypatch):
    monkeypatch.setattr("metainfer.generate_cli._cuda_available", lambda: False)
    rc, _, err = _run(argv, capsys, monkeypatch)
    assert rc == 2
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_config_json_is_one_error_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{not json")
    rc, _, err = _run(["--model", f"dummy:{tmp_path / 'config.json'}", "hi"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err


def test_no_prompt_on_a_terminal_is_an_error(capsys, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Tty(""))
    rc, _, err = _run([], capsys, monkeypatch)
    assert rc == 2 and err.startswith("error: no prompt")


def test_prompt_read_from_standard_input(capsys, monkeypatch):
    rc, out, _ = _run(["--max-tokens", "2", "--json", "--device", "cpu"], capsys, monkeypatch,
                      stdin="def add(a, b):")
    assert rc == 0
    line = json.loads(out.strip().splitlines()[-1])
    assert len(line["token_ids"]) == 2 and line["prompt_token_ids"]
