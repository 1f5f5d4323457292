"""metainfer/settings.py is the one place that reads the environment: no other module of the package reads
os.environ (it may pass the whole environment on to a child process), every METAINFER_* name the code
mentions is declared there, and there are at most 8 of them. Then the settings' parsing, override and
reload."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import metainfer
from metainfer import settings

ROOT = Path(metainfer.__file__).resolve().parent
SETTINGS = ROOT / "settings.py"
NAME = re.compile(r"METAINFER_[A-Z0-9_]*[A-Z0-9]")


def _sources(*suffixes: str) -> list[Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in suffixes and p.is_file())


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the environment: os.environ / os.getenv / os.putenv / environ from os, except
    `{**os.environ, ...}` (the whole environment passed on to a child process)."""
    passed_on = {id(v) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                 for k, v in zip(node.keys, node.values) if k is None}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "putenv"):
            if id(node) not in passed_on:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "environb", "getenv", "putenv"}:
                lines.append(node.lineno)
    return lines


def test_only_settings_reads_the_environment():
    reads = {str(p.relative_to(ROOT)): lines for p in _sources(".py") if p != SETTINGS
             for lines in [_environment_reads(ast.parse(p.read_text()))] if lines}
    assert not reads, f"read the environment through metainfer.settings, not os.environ: {reads}"


def test_the_check_sees_reads():
    for src in ('import os\nx = os.environ.get("A")', 'import os\nx = os.getenv("A")',
                "from os import environ", 'import os\nos.environ["A"] = "1"'):
        assert _environment_reads(ast.parse(src)), src
    assert not _environment_reads(ast.parse('import os\nenv = {**os.environ, "A": "1"}'))


def test_every_metainfer_name_is_declared():
    declared = {v for v in settings.ENV.values() if v.startswith("METAINFER_")}
    undeclared = {}
    for p in _sources(".py", ".cu", ".cuh"):
        names = set(NAME.findall(p.read_text())) - declared
        if names:
            undeclared[str(p.relative_to(ROOT))] = sorted(names)
    assert not undeclared, f"declare these in metainfer/settings.py (or delete them): {undeclared}"


def test_at_most_eight_variables():
    ours = [v for v in settings.ENV.values() if v.startswith("METAINFER_")]
    assert len(ours) == len(set(ours)) <= 8, ours
    assert set(settings.ENV.values()) - set(ours) <= {"TRITON_INTERPRET", "GIT_COMMIT"}


def test_every_field_documented():
    src = SETTINGS.read_text()
    for field, var in settings.ENV.items():
        doc = re.search(rf"\n    {field}: [^\n]+\n    \"\"\"{var}: ", src)
        assert doc, f"Settings.{field}: a docstring starting with its variable {var}"


def test_read_parses_and_defaults():
    s = settings.read({"METAINFER_PDL": "0", "METAINFER_CACHE": "/tmp/c", "METAINFER_API_KEY": "k",
                       "METAINFER_FP8_TUNED": "", "TRITON_INTERPRET": "1"})
    assert s.pdl is False and s.cache_dir == Path("/tmp/c") and s.api_key == "k"
    assert s.fp8_tuned is None and s.moe_tuned is None and s.triton_interpret is True  # empty: unset
    assert settings.read({}) == settings.Settings()
    with pytest.raises(ValueError, match="METAINFER_PDL"):
        settings.read({"METAINFER_PDL": "maybe"})


def test_override_and_reload(monkeypatch):
    before = settings.settings()
    with settings.override(pdl=not before.pdl) as s:
        assert settings.settings() is s and s.pdl is not before.pdl
    assert settings.settings() is before
    with pytest.raises(TypeError):
        with settings.override(no_such_field=1):
            pass
    monkeypatch.setenv("METAINFER_API_KEY", "from-env")
    try:
        assert settings.reload().api_key == "from-env"
    finally:
        monkeypatch.delenv("METAINFER_API_KEY")
        settings.reload()
    assert settings.settings() == before
