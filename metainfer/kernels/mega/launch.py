"""Builds mega.cu into a cubin with nvcc (sm_90a; cached by the sources' hash) and launches it through
the CUDA driver API (ctypes on libcuda), on the current torch stream, so a launch can be captured in a
CUDA graph like any kernel. No torch extension build: nvcc alone, seconds.

`MegaKernel(device)` loads the module and checks its compiled constants against program.py's;
`kernel.launch(program)` runs one step (one cooperative launch, one CTA per SM).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
from pathlib import Path

import torch

from metainfer.kernels.mega import profile
from metainfer.kernels.mega import program as P

HERE = Path(__file__).resolve().parent
SOURCES = ("mega.cu", "ptx.cuh", "mega_base.cuh", "mega_math.cuh", "mega_producer.cuh", "mega_dense.cuh",
           "mega_mixers.cuh",  # mega.cu and the parts it includes; gemv.cu's (all in the cubin cache's key):
           "gemv_args.cuh", "gemv_io.cuh", "gemv_sync.cuh", "gemv_timeline.cuh")
MAINS = ("mega.cu", "gemv.cu")  # the translation units built here (build(main=...)); each hashes SOURCES too
CACHE_ENV = "METAINFER_CACHE"  # cubin cache folder (default ~/.cache/metainfer)
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin")
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


PROF_FLAGS = ("-DMEGA_PROF=1",)  # the profiling build (profile.py reads what it records)
MMA_FLAG = "-DMEGA_MMA=1"  # the tensor-core consumers' build (launch(mma=True))


def nvcc_command(out: Path, prof: bool = False, defines: tuple[str, ...] = (), src: Path = HERE,
                 main: str = "mega.cu") -> list[str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError(f"the megakernel needs nvcc (CUDA 12.4+) on PATH to build {main}")
    return [nvcc, *NVCC_FLAGS, *(PROF_FLAGS if prof else ()), *defines, "-o", str(out), str(src / main)]


def build(prof: bool = False, defines: tuple[str, ...] = (), src: Path = HERE, main: str = "mega.cu") -> Path:
    """The cubin for the sources in src (default: this package's; another folder holds an older tree's
    copy for an A/B in one process), the profiling build with prof, extra -D flags in defines (e.g.
    "-DMEGA_WGMMA=0"), compiled once per source hash and flags. main: the translation unit (mega.cu, or
    gemv.cu: the standalone projection on the same consumers)."""
    if main not in MAINS:
        raise ValueError(f"megakernel build: {main!r} is not one of {MAINS}")
    for d in defines:
        if not d.startswith("-D") or any(c.isspace() for c in d):
            raise ValueError(f"megakernel build: {d!r} is not one -DNAME[=VALUE] flag")
    h = hashlib.sha256(main.encode())
    for name in dict.fromkeys((main, *SOURCES)):
        h.update((src / name).read_bytes())
    h.update(" ".join(NVCC_FLAGS + (PROF_FLAGS if prof else ()) + tuple(defines)).encode())
    root = Path(os.environ.get(CACHE_ENV, "") or Path.home() / ".cache" / "metainfer") / "mega"
    out = root / f"{Path(main).stem}-{h.hexdigest()[:16]}.cubin"
    if not out.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run(nvcc_command(tmp, prof, defines, src, main), capture_output=True, text=True,
                             timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {main}:\n{res.stderr[-4000:]}")
        tmp.replace(out)
    return out


def text_bytes(cubin: Path, kernel: str = "mega_step") -> int:
    """The size of a kernel's code in a cubin (its .text section, from the ELF section headers). The
    megakernel's step time follows it (KB-0077); this is the figure to keep down."""
    data = cubin.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{cubin} is not a 64-bit ELF")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:  # name offset, file offset, size
        name, = struct.unpack_from("<I", data, shoff + i * shentsize)
        off, size = struct.unpack_from("<QQ", data, shoff + i * shentsize + 0x18)
        return name, off, size

    _, str_off, _ = header(shstrndx)
    want = f".text.{kernel}".encode()
    for i in range(shnum):
        name, _, size = header(i)
        if data[str_off + name:].split(b"\0", 1)[0] == want:
            return size
    raise ValueError(f"{cubin} has no {want.decode()} section")


def kernel_params(args: list) -> ctypes.Array:
    """cuLaunchKernel's kernelParams for ctypes values (c_void_p for pointers; any ctypes object passed by
    value, e.g. a CUtensorMap's 128 bytes), in the kernel's parameter order. Keep `args` alive until the
    launch."""
    return (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])


TMAP_WORD = 8 + 9  # the table word of an instruction's p[9]: its TMA tensor map (mega_producer.cuh: wg_gemv)


def wgmma_box_rows(g: P.Instr) -> int:
    """The rows of the TMA boxes that g's chunks land by for wgmma in the MEGA_WGMMA build (0: none; mega.cu
    decides with the same rule and p[9] != 0): an e4m3 GEMV of K = 2048 (16-row chunks: boxes of 64 rows of
    its [4 rows, 512] view), the experts' gate/up of H = 2048 (8 gate and 8 up rows: boxes of 32 rows)."""
    if isinstance(g, P.Gemv) and g.w.dtype == torch.float8_e4m3fn and g.k == 2048 and P.SLOT // g.k == 16:
        return 64 if g.w.is_contiguous() else 0
    if isinstance(g, P.GateUp) and g.w.shape[2] == 2048:
        return 32 if g.w.is_contiguous() else 0
    return 0


def encode_tensor_map(drv: _Driver, w: torch.Tensor, width: int, box_rows: int) -> bytes:
    """The 2-D TMA map (CUtensorMap, 128 opaque bytes) of w's bytes viewed as [w.nbytes / width, width]: boxes
    of 128 bytes x box_rows, 128-byte swizzle."""
    tmap = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(width, w.numel() * w.element_size() // width)
    strides = (ctypes.c_uint64 * 1)(width)
    box = (ctypes.c_uint32 * 2)(128, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # uint8, rank 2, no interleave, SWIZZLE_128B (3), L2 promotion 128B (2), no OOB fill (zeros)
    drv("cuTensorMapEncodeTiled", tmap, 0, 2, ctypes.c_void_p(w.data_ptr()), dims, strides, box, elem,
        0, 3, 2, 0)
    return bytes(tmap)


class _Driver:
    """The few libcuda entry points used here, each call checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


class MegaKernel:
    """mega.cu loaded on a CUDA device (sm_90); prof: its profiling build (launch(prof=buffer)); defines:
    extra -D flags, src: the sources' folder (build). Each consumer kind is its own build (MMA_FLAG: the
    tensor cores), loaded at its first launch: one kernel holding both carries both's code (KB-0077: the
    step's time follows code size)."""

    def __init__(self, device: torch.device | str = "cuda", prof: bool = False,
                 defines: tuple[str, ...] = (), src: Path = HERE) -> None:
        self.prof = prof
        self.defines = tuple(defines)
        self.src = Path(src)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report "cuda:N"
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (9, 0):
            raise RuntimeError("the megakernel needs a Hopper (sm_90) GPU")
        torch.zeros(1, device=self.device)  # the primary context exists and is current
        self.drv = _Driver()
        self._loaded: dict[bool, tuple] = {}  # mma -> (image, module, step function): kept alive together
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.load(False)
        self._check_constants()

    def load(self, mma: bool) -> ctypes.c_void_p:
        """The step function of the build with these consumers (built and loaded once)."""
        if mma not in self._loaded:
            image = build(self.prof, self.defines + ((MMA_FLAG,) if mma else ()), self.src).read_bytes()
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            self.drv("cuModuleLoadData", ctypes.byref(module), image)
            self.drv("cuModuleGetFunction", ctypes.byref(fn), module, b"mega_step")
            self.drv("cuFuncSetAttribute", fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, P.SMEM)
            self._loaded[mma] = (image, module, fn)
        return self._loaded[mma][2]

    def _launch(self, fn, grid: int, block: int, smem: int, args: list, cooperative: bool) -> None:
        """args: ctypes values (c_void_p for pointers), in the kernel's parameter order."""
        params = kernel_params(args)
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        name = "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel"
        extra = () if cooperative else (None,)
        self.drv(name, fn, grid, 1, 1, block, 1, 1, smem, stream, params, *extra)

    def prepare(self, program: P.Program) -> None:
        """The tensor map of each instruction whose chunks land by TMA (wgmma_box_rows) into device memory,
        its address into the instruction's p[9]. Once per program, before a graph capture (launch calls it);
        every build may run the program (only MEGA_WGMMA reads p[9])."""
        if program.tensor_maps is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MegaKernel.prepare(program) must run before a graph capture")
        idx = [i for i, g in enumerate(program.instrs) if wgmma_box_rows(g)]
        host = torch.zeros(max(len(idx), 1), 128, dtype=torch.uint8)
        for j, i in enumerate(idx):
            g = program.instrs[i]
            raw = encode_tensor_map(self.drv, g.w, 512, wgmma_box_rows(g))
            host[j] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        maps = host.to(self.device)  # (128-byte rows: each map 64-byte aligned, as TMA needs)
        for j, i in enumerate(idx):
            program.table[i, TMAP_WORD] = maps.data_ptr() + 128 * j
        program.tensor_maps = maps

    def _check_constants(self) -> None:
        module = self._loaded[False][1]
        fn = ctypes.c_void_p()
        self.drv("cuModuleGetFunction", ctypes.byref(fn), module, b"mega_constants")
        out = torch.zeros(8, dtype=torch.int64, device=self.device)
        self._launch(fn, 1, 1, 0, [ctypes.c_void_p(out.data_ptr())], cooperative=False)
        got = out.tolist()
        want = [P.THREADS, P.SMEM, P.SLOT, P.KMAX, P.WORDS * 8, P.SCRATCH, P.MAX_SCORES, P.SCALE_BYTES]
        if got != want:
            raise RuntimeError(f"mega.cu's constants {got} differ from program.py's {want}")

    def launch(self, program: P.Program, lead: int = 0, mma: bool = False, inflight: int = P.NSLOTS,
               prof: torch.Tensor | None = None) -> None:
        """One step: every instruction of `program`, in order, on the current stream. lead: bytes per CTA
        of the next dense chunks prefetched into L2 before each routing wait (0: off; mega.cu's l2_lead).
        mma: the e4m3 dots of 16-row tiles (K <= 2048, the experts) on the tensor cores (tile_mma; that
        build is loaded at its first launch, or by load(True) before a graph capture).
        Eager launches are cooperative (the driver guarantees every CTA is resident at once, which the
        CTAs' waits on each other need); inside a CUDA-graph capture a plain launch is recorded: one CTA
        per SM with this much shared memory fills each SM alone, so all of them are resident once the SMs
        are free. inflight: the most weight chunks the producer keeps on their way to the ring (1..NSLOTS;
        the rest of the ring holds landed chunks), to test whether the polls queue behind bulk copies in
        flight to the SM (measured 2026-12-02, 1 to 6: the same step time). prof (the profiling build
        only): an int32 buffer of profile.words(n_instr, grid) words that the step's cycle counts go to
        (profile.py)."""
        if program.table.device != self.device:
            raise ValueError("the program lives on another device")
        if (prof is not None) != self.prof:
            raise ValueError("a profile buffer goes with the profiling build (MegaKernel(prof=True)), only")
        if prof is not None and (prof.dtype != torch.int32 or prof.device != self.device
                                 or prof.numel() < profile.words(len(program.instrs), self.num_sms)):
            raise ValueError("the profile buffer is not an int32 tensor of profile.words() on this device")
        args = [ctypes.c_void_p(program.table.data_ptr()), ctypes.c_int(len(program.instrs)),
                ctypes.c_void_p(program.state.data_ptr()), ctypes.c_uint32(lead), ctypes.c_uint32(inflight),
                ctypes.c_void_p(0 if prof is None else prof.data_ptr())]
        self.prepare(program)
        capturing = torch.cuda.is_current_stream_capturing()
        self._launch(self.load(bool(mma)), self.num_sms, P.THREADS, P.SMEM, args, cooperative=not capturing)
