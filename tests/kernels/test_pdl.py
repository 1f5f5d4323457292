"""The programmatic-dependent-launch contract (metainfer/kernels/pdl.py), checked on the source:
a kernel launched with PDL may start before the previous kernel ends, so one kernel that touched
memory before `griddepcontrol.wait`, or a launch that skipped the flag's constexpr, would race.

- every `@triton.jit` kernel (`*_kernel`) in metainfer/kernels takes `USE_PDL: tl.constexpr = 0`
  and its first statement (after the docstring) is `pdl.wait(USE_PDL)`;
- every launch `name_kernel[grid](...)` in metainfer/ passes `**pdl.kw()`;
- PDL is off on the interpreter and on CPU-only machines (kw() is empty).
On the H200, tests/gpu checks the engine's outputs with PDL on against PDL off."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import metainfer
from metainfer.kernels import pdl

ROOT = Path(metainfer.__file__).resolve().parent
KERNEL_FILES = sorted((ROOT / "kernels").glob("*.py"))


def _kernels(tree: ast.Module):
    for node in tree.body:
        decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
        if isinstance(node, ast.FunctionDef) and any("triton.jit" in d for d in decorators):
            yield node


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_every_kernel_waits_first(path):
    tree = ast.parse(path.read_text())
    for fn in _kernels(tree):
        if not fn.name.endswith("_kernel"):
            continue  # a @triton.jit helper, inlined into its kernels
        args = fn.args.args
        assert args[-1].arg == "USE_PDL", (path.name, fn.name)
        assert ast.unparse(args[-1].annotation) == "tl.constexpr" and ast.unparse(fn.args.defaults[-1]) == "0"
        doc = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        first = fn.body[1] if doc else fn.body[0]
        assert ast.unparse(first) == "pdl.wait(USE_PDL)", (path.name, fn.name, ast.unparse(first))


def test_every_launch_passes_the_flag():
    launches = 0
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")):
                launches += 1
                kws = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                assert "pdl.kw()" in kws, (path.name, node.lineno, node.func.value.id)
    assert launches >= 20  # the walk found the launch sites


def test_off_on_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.kw() == {} and not pdl.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.kw() == {}
