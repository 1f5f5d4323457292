"""The loop's pure parts: the verdict rule, the tamper rules, loop.toml, and the CLI's usage errors."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from metainfer.cli import main
from metainfer.loop import ab, tamper
from metainfer.loop.config import DEFAULT_PROTECTED, ConfigError, Metric, parse
from metainfer.loop.template import defaults, render

ROOT = str(Path(__file__).resolve().parents[2])
HI = Metric("tok_s", "w", "metrics.tok_s", "higher", None, 0.05)
LO = Metric("ttft_ms", "w", "metrics.ttft_ms", "lower", None, 0.10)


def test_accept_needs_a_gain_beyond_the_noise_band():
    fast = ab.compare(HI, [100, 101, 99], [120, 121, 119], min_gain=0.03)
    assert fast.change == pytest.approx(0.20) and fast.band == pytest.approx(0.03)
    assert ab.decide([fast], "tok_s").accepted
    # the same gain, but the base's rounds spread over 30%: indistinguishable from a rerun
    noisy = ab.compare(HI, [90, 120, 100], [120, 121, 119], min_gain=0.03)
    assert noisy.band == pytest.approx(0.30)
    d = ab.decide([noisy], "tok_s")
    assert not d.accepted and d.category == "noise"
    # beyond the band on the medians, but one round lost: a drifting load, not the change
    drift = ab.compare(HI, [100, 100, 100], [140, 99, 140], min_gain=0.03)
    assert drift.rounds_won == 2 and drift.change == pytest.approx(0.40)
    d = ab.decide([dataclasses.replace(drift, band=0.1)], "tok_s")
    assert not d.accepted and d.category == "noise" and "2 of 3 rounds" in d.reason
    # within min_gain even when the rounds agree
    small = ab.compare(HI, [100, 100], [102, 102], min_gain=0.03)
    assert ab.decide([small], "tok_s").category == "noise"


def test_lower_is_better_and_regression_beyond_tolerance():
    faster = ab.compare(HI, [100, 100], [150, 150], 0.03)
    ttft = ab.compare(LO, [10.0, 10.0], [10.5, 10.5], 0.03)  # 5% worse: inside its 10%
    assert ttft.change == pytest.approx(-0.05)
    assert ab.decide([faster, ttft], "tok_s").accepted
    worse = ab.compare(LO, [10.0, 10.0], [12.0, 12.0], 0.03)  # 20% worse
    d = ab.decide([faster, worse], "tok_s")
    assert not d.accepted and d.category == "regression" and "ttft_ms" in d.reason


def test_round_order_alternates_and_lookup_finds_dotted_keys():
    assert ab.round_order(0) == ("base", "candidate") and ab.round_order(1) == ("candidate", "base")
    doc = {"metrics": {"decode_tok_s": 12.5, "runs": [1, 2]}, "flag": True}
    assert ab.lookup(doc, "metrics.decode_tok_s") == 12.5 and ab.lookup(doc, "metrics.runs.1") == 2
    with pytest.raises(KeyError):
        ab.lookup(doc, "metrics.nope")
    with pytest.raises(ValueError):
        ab.lookup(doc, "flag")


def test_protected_patterns():
    pats = DEFAULT_PROTECTED
    for path in (
        "metainfer/oracle/compare.py",
        "metainfer/bench/offline.py",
        "metainfer/loop/judge.py",
        "tests/engine/test_spec.py",
        "loop.toml",
        "tests/conftest.py",
        "sub/conftest.py",
        "benchmarks/ab_inproc.py",
        "metainfer/kb/records/KB-0001-x.json",
        "pyproject.toml",
        "metainfer/assets/stdlib/model-00001-of-00002.safetensors",
        "metainfer/configs/qwen3.6-35b-a3b.json",
    ):
        assert tamper.protected(path, pats), path
    for path in (
        "metainfer/engine/engine.py",
        "metainfer/kernels/moe.py",
        "benchmarks/decode_bench.py",
        "metainfer/oracle_notes.md",
        "docs/loop.toml.md",
    ):
        assert not tamper.protected(path, pats), path


def test_added_lines_that_reach_into_the_judge():
    diff = "\n".join(
        [
            "diff --git a/metainfer/engine/engine.py b/metainfer/engine/engine.py",
            "--- a/metainfer/engine/engine.py",
            "+++ b/metainfer/engine/engine.py",
            "@@ -1,2 +1,3 @@",
            " import time",
            "+import metainfer.oracle.compare as c",
            "-import os",
        ]
    )
    found = tamper.check_added_lines(diff)
    assert len(found) == 1 and found[0].path == "metainfer/engine/engine.py" and "judge" in found[0].why
    for line in (
        "from metainfer import oracle",
        "import transformers",
        "sys.modules['x'] = y",
        "os._exit(0)",
        "if 'PYTEST_CURRENT_TEST' in env:",
    ):
        assert tamper.check_added_lines(f"+++ b/x.py\n+{line}\n"), line
    assert not tamper.check_added_lines("+++ b/x.py\n+y = torch.zeros(3)  # the model's buffers\n")
    assert tamper.check_added_lines("+++ b/x.py\n+FAST = 1\n", extra=[r"\bFAST\b"])


def test_command_files_protect_what_the_judge_runs():
    files = {"benchmarks/decode_bench.py", "tests/test_a.py", "tests/sub/test_b.py", "metainfer/x.py"}
    cmds = [
        ["{python}", "benchmarks/decode_bench.py", "--out", "{out}"],
        ["pytest", "tests/test_a.py::test_1"],
        ["pytest", "tests/sub"],
    ]
    assert tamper.command_files(cmds, files) == [
        "benchmarks/decode_bench.py",
        "tests/sub/**",
        "tests/test_a.py",
    ]


@pytest.mark.parametrize("target,device", [("qwen", "cpu"), ("qwen", "cuda"), ("sam", "cuda")])
def test_init_defaults_round_trip(target, device):
    text = render(defaults(target, device, None, None, None))
    cfg = parse(tomllib.loads(text))
    assert cfg.boundary.target == target and cfg.boundary.device == device
    assert any("{out}" in a for a in cfg.oracle.command)
    assert cfg.primary == cfg.metrics[0].name and "loop.toml" in cfg.protected


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t["goal"].update(primary="nope"), "goal.primary"),
        (lambda t: t["goal"]["metrics"][0].update(workload="nope"), "workload"),
        (lambda t: t["goal"]["metrics"][0].update(better="up"), "better"),
        (lambda t: t["bench"].update(rounds=0), "rounds"),
        (lambda t: t["boundary"].update(target="llama"), "boundary.target"),
        (lambda t: t["oracle"].update(command="verify"), "oracle.command"),
        (lambda t: t["oracle"].update(command=["verify"]), "{out}"),
        (lambda t: t.update(extra={}), "unknown key"),
        (lambda t: t["budget"].update(iterations=0), "budget"),
    ],
)
def test_bad_config_names_the_field(mutate, message):
    t = defaults("qwen", "cpu", None, None, None)
    mutate(t)
    with pytest.raises(ConfigError, match=message):
        parse(t)


def test_cli_usage_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["loop", "init", "--out", str(tmp_path / "loop.toml")]) == 0
    assert main(["loop", "init", "--out", str(tmp_path / "loop.toml")]) == 2  # exists
    (tmp_path / "bad.toml").write_text("[goal\n")
    cases = [
        [
            "loop",
            "judge",
            "--base",
            "HEAD",
            "--candidate",
            "HEAD",
            "--repo",
            str(tmp_path),
        ],  # not a repository
        ["loop", "judge", "--base", "nope", "--candidate", "HEAD", "--repo", str(tmp_path / "..")],
        ["loop", "run", "--repo", str(tmp_path), "--agent", "true"],
        ["loop", "tune", "--kernel", "nope"],
        ["tune", "--kernel", "fp8_skinny", "--tokens", "x"],
        ["loop", "init", "--out", "/proc/no/such/loop.toml"],
        # a folder as loop.toml, in a real repository (read only)
        ["loop", "judge", "--base", "HEAD", "--candidate", "HEAD", "--config", str(tmp_path), "--repo", ROOT],
    ]
    for argv in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)


def test_cli_config_errors_and_no_agent(tmp_path, capsys):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "bad.toml").write_text("[goal\n")
    assert (
        main(
            [
                "loop",
                "judge",
                "--base",
                "HEAD",
                "--candidate",
                "HEAD",
                "--repo",
                str(tmp_path),
                "--config",
                str(tmp_path / "bad.toml"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["loop", "run", "--repo", str(tmp_path)]) == 2
    assert "no agent" in capsys.readouterr().err


def test_tune_refuses_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert main(["tune", "--kernel", "fp8_skinny", "--repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no GPU" in err[0]


def test_the_boundarys_model_config_is_protected(tmp_path):
    import subprocess

    from metainfer.loop.judge import protected_patterns

    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs/model.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    subprocess.run(
        ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=True,
    )
    t = defaults("qwen", "cuda", "dummy:cfgs/model.json", None, None)
    pats = protected_patterns(tmp_path, parse(t), "HEAD")
    assert tamper.protected("cfgs/model.json", pats)


def test_new_root_modules_could_shadow_installed_ones():
    base = {"metainfer/engine.py", "README.md", "tools/x.py"}
    found = tamper.check_new_top_level(
        ["json.py", "torch/__init__.py", "metainfer/new.py", "tools/y.py", "notes.md", "docs/a.py"], base
    )
    assert [f.path for f in found] == ["json.py", "torch/__init__.py", "docs/a.py"]
    # a script's folder is first on its process's sys.path too
    found = tamper.check_new_top_level(
        ["tools/y.py", "tools/z/__init__.py", "metainfer/n.py"], base, ("", "tools")
    )
    assert [f.path for f in found] == ["tools/y.py", "tools/z/__init__.py"]
    assert tamper.script_dirs([["{python}", "tools/x.py", "{out}"]], base) == ("tools",)
    for path in ("sitecustomize.py", "sub/usercustomize.py", "x.pth", ".gitattributes"):
        assert tamper.protected(path, DEFAULT_PROTECTED), path


def test_tuned_tables_are_named_for_the_gpu():
    from metainfer.loop.tune_gpu import gpu_slug

    assert gpu_slug("NVIDIA H200") == "h200"  # the table the engine reads: fp8_skinny_h200.json
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100_80gb"
    assert gpu_slug("") == "gpu"
