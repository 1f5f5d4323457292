"""One decode token's FP8 projection on wgmma, a kernel of its own (`gemv.cu`): W as A of m64n8k32 landed by
TMA, x as two e4m3 terms, in a launch that joins the step's programmatic-dependent-launch chain. Its
producer streams the weights before `griddepcontrol.wait`, so they load while the previous kernel runs.

`fp8_linear` calls `project` for one token when `wanted` says so: an sm_90 GPU with nvcc on PATH (built
once and cached: `launch.build(main="gemv.cu")`), K = 2048, N a multiple of 16 up to MAX_N, bf16 x (the
attention qkv). `linear_conv_update` does likewise (`wanted_conv`) for the DeltaNet in_proj with its decode
conv as the epilogue; `project_pre` takes the previous MoE's rows and the input norm as its x prologue;
`moe_gate_up` runs one token's experts' gate/up, routed in the kernel. Launched through the driver on the
current torch stream with the programmatic-stream-serialization attribute when `pdl.enabled()`; CUDA graphs
record it like any kernel.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import warnings

import torch

from metainfer.kernels import pdl
from metainfer.kernels.common import interpreting

K = 2048  # the K served
MAX_N = 16384  # past it (the FP8 lm_head's 248,320 rows) the swept Triton GEMV serves
_PDL_ATTR = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
THREADS = 32 * (8 + 1)  # gemv.cu's CTA (gemv_math.cuh's NT = 32 * (NCW + 1)): 8 consumer warps, the producer


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("val", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Conv(ctypes.Structure):  # gemv.cu's Conv: the DeltaNet decode conv epilogue's operands
    _fields_ = [("w", ctypes.c_void_p), ("state", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("has", ctypes.c_void_p), ("s_slot", ctypes.c_longlong), ("s_k", ctypes.c_longlong),
                ("n_conv", ctypes.c_int)]


CONV_K = 4  # gemv.cu's conv kernel size


class _Moe(ctypes.Structure):  # gemv.cu's Moe: moe_gate_up_e4m3's operands
    _fields_ = [("logits", ctypes.c_void_p), ("gu", ctypes.c_void_p), ("tw", ctypes.c_void_p),
                ("ids", ctypes.c_void_p), ("E", ctypes.c_int), ("top_k", ctypes.c_int),
                ("rows", ctypes.c_int)]


MOE_MAX_E, MOE_MAX_K = 256, 16  # gemv.cu's routing bounds: experts (8 logits a lane), picks + 1


class _Pre(ctypes.Structure):  # gemv.cu's Pre: gemv_e4m3_pre's x prologue
    _fields_ = [("rows", ctypes.c_void_p), ("tw", ctypes.c_void_p), ("res", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("new_res", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("W", ctypes.c_int)]


PRE_MAX_W = 16  # gemv.cu's bound on the prologue's rows


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


def wanted(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether gemv.cu serves x [1, K] @ dequant(w [N, K] e4m3, s [N / 128, K / 128])^T (N a multiple of 16;
    the caller has checked the dtypes and shapes fp8_linear asserts)."""
    if not x.is_cuda or x.shape[0] != 1 or x.dtype != torch.bfloat16 or w.dim() != 2:
        return False
    N, k = w.shape
    weights = w.dtype == torch.float8_e4m3fn and s is not None and N % 16 == 0 and s.is_contiguous()
    return (weights and k == K and N <= MAX_N and x.is_contiguous() and x.data_ptr() % 16 == 0
            and w.is_contiguous() and w.data_ptr() % 16 == 0 and not interpreting()
            and _kernel(x.device) is not None)


def wanted_conv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, conv_weight: torch.Tensor,
                conv_state: torch.Tensor, slots: torch.Tensor) -> bool:
    """`wanted`, with the DeltaNet decode conv of one decoding row as the epilogue (`project`'s conv)."""
    C, ck = conv_weight.shape
    return (w.shape[1] == K and wanted(x, w, s)
            and slots.shape == (1,) and slots.dtype == torch.int64 and ck == CONV_K and C <= w.shape[0]
            and conv_weight.dtype == conv_state.dtype == torch.bfloat16 and conv_weight.is_contiguous()
            and conv_state.shape[1:] == (ck - 1, C) and conv_state.stride(2) == 1)


def wanted_pre(rows: torch.Tensor, tw: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
               new_res: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `project_pre` serves rms_norm(sum_j tw[j] rows[j] + residual) @ dequant(w, s)^T for one
    token (the previous MoE's rows [1, W, K] fp32, W <= PRE_MAX_W; residual, new_res [1, K] bf16; the
    norm's weight [K] bf16), and `wanted` for the projection."""
    if not rows.is_cuda or rows.dim() != 3:
        return False
    W = rows.shape[1]
    return (rows.shape == (1, W, K) and 0 < W <= PRE_MAX_W and rows.dtype == tw.dtype == torch.float32
            and tw.shape == (1, W) and residual.shape == new_res.shape == (1, K)
            and residual.dtype == new_res.dtype == norm_weight.dtype == torch.bfloat16
            and norm_weight.shape == (K,)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0
                    for t in (rows, tw, residual, norm_weight, new_res))
            and wanted(residual, w, s))


def wanted_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `moe_gate_up` serves one token's routed and shared experts' gate/up: x [1, K]
    bf16, logits [1, E + 1] bf16 (the shared expert's gate last), w [E + 1, rows, K] e4m3 (the shared expert
    at E), rows a multiple of 128, s its [E + 1, rows / 128, K / 128] block scales, E <= MOE_MAX_E,
    top_k < MOE_MAX_K."""
    if not x.is_cuda or w.dim() != 3:
        return False
    E1, rows, k = w.shape
    weights = (w.dtype == torch.float8_e4m3fn and s is not None and s.is_contiguous()
               and s.shape == (E1, rows // 128, K // 128) and s.dtype == torch.float32)
    return (weights and x.shape == (1, K) and x.dtype == logits.dtype == torch.bfloat16
            and logits.shape == (1, E1) and 0 < top_k < min(MOE_MAX_K, E1) and E1 - 1 <= MOE_MAX_E and k == K
            and rows % 128 == 0 and w.is_contiguous() and x.is_contiguous() and logits.is_contiguous()
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and not interpreting()
            and _kernel(x.device) is not None)


KERNEL_NAMES = ("gemv_e4m3", "gemv_e4m3_pre", "moe_gate_up_e4m3")


class _Kernel:
    """gemv.cu loaded on one device (the timeline build where `use_timeline_build` says so), its layout
    constants checked against the host's structs, its watchdog pointed at pinned host memory."""

    def __init__(self, device: torch.device) -> None:
        from metainfer.kernels.cuda import launch

        self.launch_mod = launch
        torch.zeros(1, device=device)  # the primary context exists and is current
        self.drv = launch._Driver()
        # the watchdog's report: pinned host memory (the device writes it through unified addressing), which
        # stays readable once a trap has ended the context (watchdog_report)
        self.watch = torch.zeros(8, dtype=torch.int32, pin_memory=True)
        image = launch.build(main="gemv.cu", defines=(TIMELINE_DEFINE,) if _TIMELINE else ())
        self.module = ctypes.c_void_p()  # (loaded for the process)
        self.drv("cuModuleLoadData", ctypes.byref(self.module), image.read_bytes())
        fns = {}
        for name in KERNEL_NAMES:
            fns[name] = ctypes.c_void_p()
            self.drv("cuModuleGetFunction", ctypes.byref(fns[name]), self.module, name.encode())
        out = torch.zeros(6, dtype=torch.int64, device=device)
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        for name, arg in ((b"gemv_constants", out.data_ptr()), (b"gemv_set_watch", self.watch.data_ptr())):
            fn = ctypes.c_void_p()
            self.drv("cuModuleGetFunction", ctypes.byref(fn), self.module, name)
            self.drv("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream,
                     launch.kernel_params([ctypes.c_void_p(arg)]), None)
        self.threads, self.smem, conv, moe, pre, tl = out.tolist()
        self.timeline_words = tl % 100  # per CTA record (gemv_timeline.Recorder checks them against TL_N)
        self.timeline_built = tl // 100 == 1  # built with -DGEMV_TIMELINE=1
        self.seq = 0  # gemv.cu launches so far: each launch's place in the timeline's records
        want = (THREADS, ctypes.sizeof(_Conv) * 100 + CONV_K,
                ctypes.sizeof(_Moe) * 10000 + MOE_MAX_E * 100 + MOE_MAX_K,
                ctypes.sizeof(_Pre) * 100 + PRE_MAX_W)
        if (self.threads, conv, moe, pre) != want:
            raise RuntimeError(f"gemv.cu's constants {out.tolist()} differ from (threads, -, conv, moe, "
                               f"pre): {want}")
        for fn in fns.values():
            self.drv("cuFuncSetAttribute", fn, 8, self.smem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.fn, self.pre_fn, self.moe_fn = (fns[n] for n in KERNEL_NAMES)
        self.set_timeline_fn = ctypes.c_void_p()
        self.drv("cuModuleGetFunction", ctypes.byref(self.set_timeline_fn), self.module, b"gemv_set_timeline")
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        # each weight's TMA map, by (address, bytes): a map holds only those (the [bytes / 512, 512] view),
        # so a reused address of the same size gets the same map back (the launch copies it into its
        # parameters)
        self.maps: dict[tuple[int, int], ctypes.Array] = {}

    def set_timeline(self, buf: torch.Tensor | None, slots: int = 0, grid: int = 0) -> None:
        """Points the timeline build's records at buf ([slots, grid, TL_N] int64 on this device), or off
        (None): gemv_timeline.Recorder's."""
        dev = buf.device if buf is not None else None
        stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
        ptr = buf.data_ptr() if buf is not None else 0
        args = [ctypes.c_void_p(ptr), ctypes.c_int(slots), ctypes.c_int(grid)]
        self.drv("cuLaunchKernel", self.set_timeline_fn, 1, 1, 1, 1, 1, 1, 0, stream,
                 self.launch_mod.kernel_params(args), None)

    def tensor_map(self, w: torch.Tensor) -> ctypes.Array:
        key = (w.data_ptr(), w.numel() * w.element_size())
        tmap = self.maps.get(key)
        if tmap is None:
            raw = self.launch_mod.encode_tensor_map(self.drv, w, 512, 64)
            tmap = self.maps[key] = (ctypes.c_uint64 * 16).from_buffer_copy(raw)
        return tmap

    def __call__(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
                 conv: tuple | None, pre: tuple | None = None) -> None:
        N = w.shape[0]
        cv = _Conv()
        if conv is not None:
            cw, cstate, slots, has = conv
            cv = _Conv(cw.data_ptr(), cstate.data_ptr(), slots.data_ptr(), has.data_ptr(), cstate.stride(0),
                       cstate.stride(1), cw.shape[0])
        args = [self.tensor_map(w), ctypes.c_void_p(s.data_ptr())]
        if pre is not None:  # x is the prologue's (the residual stands in for it in the checks)
            rows, tw, res, nw, eps, new_res = pre
            p = _Pre(rows.data_ptr(), tw.data_ptr(), res.data_ptr(), nw.data_ptr(), new_res.data_ptr(), eps,
                     rows.shape[1])
            self.launch(self.pre_fn, [*args, ctypes.c_void_p(y.data_ptr()), ctypes.c_int(N), cv, p], N // 16,
                        x.device)
        else:
            self.launch(self.fn, [*args, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                  ctypes.c_int(N), cv], N // 16, x.device)  # 32 KB chunks of 16 rows

    def moe(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor,
            gu: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> None:
        """moe_gate_up_e4m3: gu, tw and ids written (`moe_gate_up`)."""
        E1, rows, _ = w.shape
        m = _Moe(logits.data_ptr(), gu.data_ptr(), tw.data_ptr(), ids.data_ptr(), E1 - 1, top_k, rows)
        args = [self.tensor_map(w), ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(x.data_ptr()), m]
        self.launch(self.moe_fn, args, (top_k + 1) * rows // 16, x.device)

    def launch(self, fn: ctypes.c_void_p, args: list, chunks: int, device: torch.device) -> None:
        """One CTA per SM (at most one per chunk), on the current stream, with the PDL attribute when
        `pdl.enabled()` (without it: stream order, the kernel's wait returns at once)."""
        args = [*args, ctypes.c_int(self.seq)]  # seq: the timeline's place (kept alive until the launch)
        self.seq = (self.seq + 1) % (1 << 30)
        params = self.launch_mod.kernel_params(args)
        cfg = _Config()
        cfg.grid[:] = (min(self.sms, chunks), 1, 1)
        cfg.block[:] = (self.threads, 1, 1)
        cfg.smem = self.smem
        cfg.stream = torch.cuda.current_stream(device).cuda_stream
        attr = _Attr(id=_PDL_ATTR)
        attr.value.val = 1
        cfg.attrs = ctypes.pointer(attr)
        cfg.n_attrs = int(pdl.enabled())
        self.drv("cuLaunchKernelEx", ctypes.byref(cfg), fn, params, None)


_KERNELS: dict[torch.device, _Kernel | None] = {}
WATCH_CODES = {2: "a full ring slot", 3: "an empty ring slot"}


def watchdog_report() -> str | None:
    """What gemv.cu's watchdog recorded where a wait gave up (then the kernel trapped and the context is
    gone; this reads the pinned host copy): which CTA and thread, and which chunk and phase it waited for.
    None where no wait has given up (or gemv.cu is not loaded)."""
    for dev, k in _KERNELS.items():
        if k is None or int(k.watch[0]) == 0:
            continue
        code, cta, thread, chunk, parity = (int(v) for v in k.watch[:5].tolist())
        what = WATCH_CODES.get(code, f"code {code}")
        return (f"gemv.cu watchdog on {dev}: CTA {cta} thread {thread} gave up waiting on {what}: "
                f"chunk {chunk} of the CTA, parity {parity}")
    return None


TIMELINE_DEFINE = "-DGEMV_TIMELINE=1"  # the timeline build's flag (gemv_timeline.py reads its records)
_TIMELINE = False  # the next load builds gemv.cu with the timeline's stamps (`use_timeline_build`)


def use_timeline_build(on: bool = True) -> None:
    """gemv.cu loads as the timeline build (TIMELINE_DEFINE: each CTA's phases recorded) from the next
    load on, or as the default build (off); `reset` after a load, graphs captured with the old module
    dropped first."""
    global _TIMELINE
    _TIMELINE = on


def reset() -> None:
    """Forgets the loaded kernels: the next call builds (or finds in the cubin cache) and loads gemv.cu again
    (the build `use_timeline_build` says now). The modules loaded before stay loaded; graphs captured with
    them must be dropped first."""
    _KERNELS.clear()


def _kernel(device: torch.device) -> _Kernel | None:
    """The device's loaded kernel, built at the first call (outside a graph capture: one that finds it
    unbuilt runs the Triton kernel this time); None where it cannot run (before sm_90, no nvcc, a failed
    build: then the Triton kernels serve, with one warning)."""
    dev = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if dev in _KERNELS:
        return _KERNELS[dev]
    if torch.cuda.is_current_stream_capturing():
        return None
    kernel = None
    if torch.cuda.get_device_capability(dev) >= (9, 0) and shutil.which("nvcc") is not None:
        try:
            kernel = _Kernel(dev)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            warnings.warn(f"cuda/gemv.cu unavailable, the Triton projections serve: {e}", stacklevel=2)
    _KERNELS[dev] = kernel
    return kernel


def project(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
            conv: tuple | None = None) -> None:
    """y [1, N] bf16 = x [1, K] bf16 @ dequant(w [N, K], s)^T on gemv.cu (the caller checked `wanted`). conv =
    (conv_weight [C, 4], conv_state [S, 3, C], slots [1] int64, has_state [1] bool), checked by `wanted_conv`:
    y[:, :C] becomes the decode conv + SiLU of itself, the slot's conv state updated in place
    (`fp8_linear.linear_conv_update`'s epilogue)."""
    assert y.is_contiguous() and y.shape == (1, w.shape[0]) and y.dtype == torch.bfloat16, (y.shape, y.dtype)
    kernel = _kernel(x.device)
    assert kernel is not None, "project() without wanted()"
    kernel(x, w, s, y, conv)


def project_pre(rows: torch.Tensor, tw: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, new_res: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                conv: tuple | None = None) -> torch.Tensor | None:
    """One decode token's projection whose x is the previous MoE's rows summed into the residual and this
    layer's input RMSNorm, computed in gemv.cu's x prologue (norm.moe_add_rms_norm's steps; new_res gets the
    new residual): -> y [1, N] bf16, or None where the kernel does not serve it (`wanted_pre`; with conv,
    `wanted_conv`: then y[:, :C] is the decode conv of itself, as `project`'s conv). w: e4m3 with its block
    scales s."""
    if not wanted_pre(rows, tw, residual, norm_weight, new_res, w, s):
        return None
    if conv is not None and not wanted_conv(residual, w, s, *conv[:3]):
        return None
    y = torch.empty(1, w.shape[0], dtype=torch.bfloat16, device=rows.device)
    kernel = _kernel(rows.device)
    assert kernel is not None
    kernel(residual, w, s, y, conv, (rows, tw, residual, norm_weight, eps, new_res))
    return y


def moe_gate_up(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's experts' gate/up on gemv.cu (the caller checked `wanted_moe`): routed from logits (the
    top_k largest, lowest index on ties, as `routing.softmax_topk`) and the shared expert (w's last).
    -> (gu [top_k + 1, rows] fp32: each pair's gate . x then up . x, slot order; tw [1, top_k + 1] fp32 the
    routing weights, the shared expert's sigmoid(gate) last; ids [1, top_k + 1] int64)."""
    kernel = _kernel(x.device)
    assert kernel is not None, "moe_gate_up() without wanted_moe()"
    W = top_k + 1
    gu = torch.empty(W, w.shape[1], dtype=torch.float32, device=x.device)
    tw = torch.empty(1, W, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, W, dtype=torch.int64, device=x.device)
    kernel.moe(x, logits, top_k, w, s, gu, tw, ids)
    return gu, tw, ids
