"""gemv.cu builds for sm_90a where this machine has nvcc (a CPU-only check that the GPU tests will find a
kernel): launch.build() leaves a cubin in its cache, keyed by every part's bytes and the flags; ptxas
reports no stack frame and no spills; the timeline build's stamps stay out of the default build."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from metainfer import settings
from metainfer.kernels.cuda import gemv, launch

nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")


def test_sources_are_the_folders_parts():
    """Every .cu / .cuh beside the launcher is in the cubin cache's key (or is a main), and the CTA size the
    launcher checks gemv.cu's constants against is gemv_math.cuh's."""
    parts = sorted(f.name for f in launch.HERE.iterdir() if f.suffix in (".cu", ".cuh"))
    assert sorted(set(launch.SOURCES) | set(launch.MAINS)) == parts
    src = (launch.HERE / "gemv_math.cuh").read_text()
    ncw = int(re.search(r"constexpr int NCW = (\d+);", src).group(1))
    assert "constexpr int NT = 32 * (NCW + 1);" in src and gemv.THREADS == 32 * (ncw + 1)


@nvcc
def test_build_caches_a_cubin(tmp_path):
    with settings.override(cache_dir=tmp_path):  # METAINFER_CACHE
        out = launch.build(main="gemv.cu")
        assert out.is_file() and out.suffix == ".cubin" and out.parent.parent == tmp_path
        assert launch.build(main="gemv.cu") == out  # the same sources: the cached file


@nvcc
def test_build_from_another_folder(tmp_path):
    """src: another tree's copy of the sources (an A/B in one process) is built from that folder; the same
    sources give the same cubin, a changed copy its own."""
    with settings.override(cache_dir=tmp_path / "cache"):
        _build_from_another_folder(tmp_path)


def _build_from_another_folder(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    for name in (*launch.MAINS, *launch.SOURCES):
        shutil.copy(launch.HERE / name, ref / name)
    assert launch.build(src=ref) == launch.build()
    (ref / "gemv_math.cuh").write_text((ref / "gemv_math.cuh").read_text() + "\n// changed\n")
    other = launch.build(src=ref)
    assert other != launch.build() and other.is_file()


def test_build_refuses_what_is_not_one_define():
    for bad in ("-O0", "-DA -DB", "GEMV_TIMELINE=1"):
        with pytest.raises(ValueError, match="-DNAME"):
            launch.build(main="gemv.cu", defines=(bad,))
    with pytest.raises(ValueError, match="not one of"):
        launch.build(main="other.cu")


@nvcc
@pytest.mark.parametrize("defines", [(), ("-DGEMV_TIMELINE=1",)])
def test_gemv_builds_without_spills(tmp_path, defines):
    """gemv.cu (the FP8 projection of one token and the experts' gate/up) builds into its own cubin, its
    kernels with no stack frame and no spills; also in the timeline build, whose stamps must stay in
    registers (a stamp field indexed at run time put them in a stack frame)."""
    with settings.override(cache_dir=tmp_path / "cache"):
        out = launch.build(main="gemv.cu", defines=defines)
        default = launch.build(main="gemv.cu")
    assert out.is_file() and out.name.startswith("gemv-")
    assert (out == default) == (not defines)  # each flag set its own cubin
    cmd = launch.nvcc_command(tmp_path / "g.cubin", main="gemv.cu", defines=defines)
    res = subprocess.run([*cmd[:1], "-Xptxas", "-v", *cmd[1:]], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "warning" not in res.stderr.lower(), res.stderr[-3000:]
    for name in ("'gemv_e4m3'", "'gemv_e4m3_pre'", "'moe_gate_up_e4m3'"):
        fn = res.stderr[res.stderr.index(name):]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", fn)
        assert frame and frame.groups() == ("0", "0", "0"), fn[:500]


@nvcc
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
