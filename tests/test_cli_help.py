"""`--help` of every subcommand: each option shows its default, and the options a user needs first
(model, prompt, max tokens, temperature, device, dtype, port) come before the engine-capacity and
GPU-tuning groups."""

from __future__ import annotations

import argparse

import pytest

from metainfer.cli import build_parser, main


def _parsers(p: argparse.ArgumentParser, name: str = "metainfer"):
    yield name, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub_name, sub in a.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_option_shows_its_default() -> None:
    missing = []
    parsers = dict(_parsers(build_parser()))
    assert {"metainfer generate", "metainfer serve", "metainfer verify", "metainfer bench serve",
            "metainfer bench offline", "metainfer kb list"} <= set(parsers)
    for name, p in parsers.items():
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.nargs == 0:  # positionals, --help and on/off flags
                continue
            if "default" not in fmt._format_action(a).replace("\n", " "):
                missing.append(f"{name} {a.option_strings[0]}")
    assert not missing, f"options whose --help shows no default: {missing}"


def test_generate_help_shows_sampling_defaults_first_and_groups_tuning_last(capsys) -> None:
    out = _help(capsys, "generate")
    lines = out.splitlines()
    assert len(lines[0]) <= 80, "the usage line lists the options instead of a short synopsis"
    flat = " ".join(out.split())
    assert "--max-tokens N tokens to generate per prompt (default: 64)" in flat
    assert "--temperature T 0: greedy (default: 0.0)" in flat
    capacity, tuning = out.index("\nengine capacity:"), out.index("\nGPU performance tuning:")
    assert capacity < tuning
    for flag in ("--prompt ", "--max-tokens", "--temperature", "--model", "--device", "--dtype"):
        assert out.index(flag) < capacity, flag
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--num-kv-blocks"):
        assert capacity < out.index(flag) < tuning, flag
    for flag in ("--enforce-eager", "--prefill-graphs", "--no-warmup", "--speculative", "--ssm-state-dtype"):
        assert out.index(flag) > tuning, flag
    first_screen = "\n".join(lines[:45])
    for flag in ("--max-tokens", "--temperature", "--model", "--device", "--dtype"):
        assert flag in first_screen, flag


def test_serve_help_puts_port_and_model_before_the_engine_groups(capsys, monkeypatch) -> None:
    monkeypatch.setenv("METAINFER_API_KEY", "sekrit-from-env")
    out = _help(capsys, "serve")
    assert "sekrit-from-env" not in out, "--help must not print the API key from the environment"
    capacity, tuning = out.index("\nengine capacity:"), out.index("\nGPU performance tuning:")
    for flag in ("--port", "--host", "--model", "--device", "--dtype"):
        assert out.index(flag) < capacity, flag
    assert "(default: 8000)" in out
    assert out.index("--uvicorn-loop") > tuning


def test_serve_reads_the_api_key_from_the_environment_at_run_time(monkeypatch) -> None:
    monkeypatch.setenv("METAINFER_API_KEY", "k")
    args = build_parser("serve").parse_args(["serve"])
    assert args.api_key is None  # resolved by `run`, so that --help never shows it


def test_verify_help_says_its_engine_limits_follow_the_suite(capsys) -> None:
    out = " ".join(_help(capsys, "verify").split())
    assert "--suite {auto,quick,full}" in out and "(default: auto)" in out
    for flag in ("--max-num-seqs", "--max-model-len", "--max-num-batched-tokens"):
        i = out.index(flag + " ")
        assert "(default: sized to the suite)" in out[i : i + 200], flag


def test_bench_serve_help_groups_the_roofline(capsys) -> None:
    out = _help(capsys, "bench", "serve")
    assert out.index("--num-prompts") < out.index("\nroofline:") < out.index("--bandwidth")
    assert "(default: 1024)" in out
