"""mega.cu builds for sm_90a where this machine has nvcc (a CPU-only check that the GPU tests will find a
kernel): launch.build() leaves a cubin in its cache, and ptxas reports no spills and at most the 48-byte
stack frame seen at 2026-12-01 (32 bytes are sincosf's large-argument reduction: RoPE angles reach pos
* 1 rad)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from metainfer.kernels.mega import launch

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")


def test_build_caches_a_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path))
    out = launch.build()
    assert out.is_file() and out.suffix == ".cubin" and out.parent.parent == tmp_path
    assert launch.build() == out  # the same sources: the cached file


def test_build_from_another_folder(tmp_path, monkeypatch):
    """src: another tree's copy of the sources (an A/B in one process, mega_step.py --ref-src) is built from
    that folder; the same sources give the same cubin, a changed copy its own."""
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path / "cache"))
    ref = tmp_path / "ref"
    ref.mkdir()
    for name in launch.SOURCES:
        shutil.copy(launch.HERE / name, ref / name)
    assert launch.build(src=ref) == launch.build()
    (ref / "mega_base.cuh").write_text((ref / "mega_base.cuh").read_text() + "\n// changed\n")
    other = launch.build(src=ref)
    assert other != launch.build() and other.is_file()


@pytest.mark.parametrize("defines", [(), (launch.MMA_FLAG,)])  # both builds
def test_no_spills(tmp_path, defines):
    cmd = launch.nvcc_command(tmp_path / "m.cubin", defines=defines)
    res = subprocess.run([*cmd[:1], "-Xptxas", "-v", *cmd[1:]], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-3000:]
    step = res.stderr[res.stderr.index("'mega_step'"):]
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", step)
    assert frame and int(frame.group(1)) <= 48 and frame.groups()[1:] == ("0", "0"), step[:500]


def test_code_size_budget(tmp_path, monkeypatch):
    """The kernel's code is measured here, so it cannot grow unnoticed: its size sets the step's time
    (KB-0077: 338 KB 4.0 ms, 222 KB 2.85 ms, 180 KB 2.60 ms; with x staged in 16-byte pairs and an FP8
    lm_head, 169 KB 2.37 ms but 191 KB, 5 pairs in flight, 2.47 ms). The slow paths of the polls and waits
    are out of line, the gated norm's per-element work is cut, polls go 3 (pairs) at a time, one consumer
    kind per build, and the attention's cache rows are shifts. The wgmma build (the default since KB-0080)
    carries both GEMV paths: 184.6 KB, and faster than the 160.9 KB CUDA-core build (2.297 vs 2.366 ms).
    The norms' polls all in flight (NORM_GROUP 4, GATED_GROUP 4, KB-0081): 188.0 KB, measured faster than
    the 182.4 KB build with 3 pairs at a time (2.278 vs 2.331 ms). Attend's 8 cache rows a warp in flight
    (KB-0090): 189.4 KB, faster than the 179.3 KB build with 4 (2.238 vs 2.256 ms)."""
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path))
    assert launch.text_bytes(launch.build()) <= 190_000  # wgmma (KB-0080, KB-0081)
    assert launch.text_bytes(launch.build(defines=("-DMEGA_WGMMA=0",))) <= 168_000  # the CUDA cores alone
    assert launch.text_bytes(launch.build(defines=(launch.MMA_FLAG,))) <= 194_000  # + mma.sync
    big = launch.build(defines=("-DMEGA_FETCH_GROUP=9",))  # a variant: its own cubin, more unrolled code
    assert big != launch.build() and launch.text_bytes(big) > launch.text_bytes(launch.build())


def test_build_refuses_what_is_not_one_define():
    for bad in ("-O0", "-DA -DB", "MEGA_FETCH_GROUP=3"):
        with pytest.raises(ValueError, match="-DNAME"):
            launch.build(defines=(bad,))
    with pytest.raises(ValueError, match="not one of"):
        launch.build(main="other.cu")


@pytest.mark.parametrize("defines", [(), ("-DGEMV_PRE_EARLY=1",), ("-DGEMV_TIMELINE=1",)])
def test_gemv_builds_without_spills(tmp_path, monkeypatch, defines):
    """gemv.cu (the standalone FP8 projection on the same consumers, KB-0094, and the experts' gate/up,
    KB-0096) builds into its own cubin, its kernels with no stack frame and no spills; also with the
    prologue's early loads (GEMV_PRE_EARLY, METAINFER_WGMMA_GEMV_DEFINES) and in the timeline build, whose
    stamps must stay in registers (a stamp field indexed at run time put them in a 152-byte stack frame)."""
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path / "cache"))
    out = launch.build(main="gemv.cu", defines=defines)
    assert out.is_file() and out.name.startswith("gemv-") and out != launch.build()
    cmd = launch.nvcc_command(tmp_path / "g.cubin", main="gemv.cu", defines=defines)
    res = subprocess.run([*cmd[:1], "-Xptxas", "-v", *cmd[1:]], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "warning" not in res.stderr.lower(), res.stderr[-3000:]
    for name in ("'gemv_e4m3'", "'gemv_e4m3_pre'", "'moe_gate_up_e4m3'"):
        fn = res.stderr[res.stderr.index(name):]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", fn)
        assert frame and frame.groups() == ("0", "0", "0"), fn[:500]


def test_gemv_timeline_compiles_out_of_the_default_build(tmp_path):
    """The timeline's stamps (clock64, globaltimer, smid) are in the timeline build's PTX only: the default
    build's kernels read no clock (its PTX was compared whole against the build before the timeline: the same
    but for the launches' sequence argument)."""
    texts = {}
    for flag in ((), ("-DGEMV_TIMELINE=1",)):
        cmd = launch.nvcc_command(tmp_path / "g.ptx", main="gemv.cu", defines=flag)
        cmd[cmd.index("-cubin")] = "-ptx"
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        texts[bool(flag)] = (tmp_path / "g.ptx").read_text()
    stamps = re.compile(r"%globaltimer|%clock64|%smid")
    assert not stamps.search(texts[False])
    assert len(stamps.findall(texts[True])) >= 3 * 4  # each of the three kernels stamps its phases
