"""The programmatic-dependent-launch contract (metainfer/kernels/pdl.py), checked on the source:
a kernel launched with PDL may start before the previous kernel ends, so one kernel that touched
memory before `griddepcontrol.wait`, or a launch that skipped the flag's constexpr, would race.

- every `@triton.jit` kernel (`*_kernel`) in metainfer/kernels takes `USE_PDL: tl.constexpr = 0`
  and calls `pdl.wait(USE_PDL)` at its top level; before it, nothing but index arithmetic and
  loads (directly or through a helper) of the pointers `pdl.READ_BEFORE_WAIT` names for that
  kernel: no store, no atomic;
- every launch `name_kernel[grid](...)` in metainfer/ passes `**pdl.kw()`;
- PDL is off on the interpreter and on CPU-only machines (kw() is empty).
On the H200, tests/gpu checks the engine's outputs with PDL on against PDL off."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import metainfer
from metainfer import settings
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
        body = fn.body[1:] if doc else fn.body
        waits = [i for i, st in enumerate(body) if ast.unparse(st) == "pdl.wait(USE_PDL)"]
        assert waits, (path.name, fn.name, "no top-level pdl.wait(USE_PDL)")
        for st in body[:waits[0]]:  # only index math and loads of read-only weights before the wait
            _check_before_wait(st, f"{path.name}:{fn.name}", pdl.READ_BEFORE_WAIT.get(fn.name, frozenset()))


def _check_before_wait(st: ast.stmt, where: str, allowed: frozenset) -> None:
    for node in ast.walk(st):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            assert "store" not in name and "atomic" not in name and "wait" not in name, (where, name)
            if name == "tl.load" or not name.startswith(("tl.", "pdl.")):  # a load, or a helper's
                args = node.args[:1] if name == "tl.load" else node.args  # pointer arguments
                names = [n for a in args for n in ast.walk(a) if isinstance(n, ast.Name)]
                ptrs = {n.id for n in names if n.id.endswith("_ptr")}
                assert ptrs <= allowed and (ptrs or name != "tl.load"), (where, ast.unparse(node), ptrs)


def test_read_before_wait_names_real_parameters():
    """Every READ_BEFORE_WAIT entry is a kernel of the package and names its own pointer parameters."""
    kernels = {fn.name: fn for path in KERNEL_FILES for fn in _kernels(ast.parse(path.read_text()))}
    for name, ptrs in pdl.READ_BEFORE_WAIT.items():
        assert name in kernels, name
        params = {a.arg for a in kernels[name].args.args}
        assert ptrs <= params and all(p.endswith("_ptr") for p in ptrs), (name, ptrs - params)


def test_no_kernel_releases_the_next_before_its_wait():
    """Every kernel releases the next one only in `pdl.wait` (after its own wait): at most one runs ahead."""
    for path in KERNEL_FILES:
        src = path.read_text()
        assert "gdc_launch_dependents" not in src or path.name == "pdl.py", path.name


def test_the_before_wait_check_rejects():
    """The check above fails on a store, or a load of anything but the weights, before the wait."""
    bad_ones = ("tl.store(y_ptr + 1, v)", "v = tl.load(x_ptr + offs)", "v = tl.load(w_ptr + offs)",
                "a = tl.atomic_add(lock_ptr, 1)", "v = _helper(x_ptr, 3)")
    for bad in bad_ones:
        with pytest.raises(AssertionError):
            _check_before_wait(ast.parse(bad).body[0], "test", pdl.READ_BEFORE_WAIT["_gemv_kernel"])
    _check_before_wait(ast.parse("w = tl.load(weight_ptr + offs, mask=m)").body[0], "test",
                       pdl.READ_BEFORE_WAIT["_gemv_kernel"])
    with pytest.raises(AssertionError):  # a kernel without an entry may load nothing before its wait
        _check_before_wait(ast.parse("w = tl.load(weight_ptr + offs)").body[0], "test", frozenset())


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


def test_off_on_the_interpreter_and_by_its_setting(monkeypatch):
    monkeypatch.setattr(pdl, "_SUPPORTED", True)
    with settings.override(triton_interpret=True):
        assert pdl.kw() == {} and not pdl.enabled()
    with settings.override(triton_interpret=False, pdl=False):  # METAINFER_PDL=0
        assert pdl.kw() == {}
    with settings.override(triton_interpret=False):
        assert pdl.enabled()


def test_prefill_chunks_launch_without_pdl(monkeypatch):
    """Steps with a chunk longer than PREFILL_MAX_TOKENS (and graphs captured for them) launch without PDL;
    decode steps and short verify chunks keep it."""
    monkeypatch.setattr(pdl, "_SUPPORTED", True)
    with settings.override(triton_interpret=False, pdl=True):
        assert pdl.kw() == {"USE_PDL": 1, "launch_pdl": True}
        with pdl.off_for(pdl.PREFILL_MAX_TOKENS):
            assert pdl.enabled()
        with pdl.off_for(1024):
            assert not pdl.enabled() and pdl.kw() == {}
            with pdl.off_for(1):  # nested: still off
                assert not pdl.enabled()
        assert pdl.enabled()
        try:
            with pdl.off_for(1024):
                raise RuntimeError
        except RuntimeError:
            pass
        assert pdl.enabled()  # restored after an error inside
