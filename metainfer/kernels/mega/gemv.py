"""One decode token's FP8 projection on wgmma, a kernel of its own (`gemv.cu`, KB-0094): the megakernel's
consumers (W as A of m64n8k32 landed by TMA, x as two e4m3 terms) in a launch that joins the step's
programmatic-dependent-launch chain. Its producer streams the weights before `griddepcontrol.wait`, so they
load while the previous kernel runs. KB-0092 measured the form on the step's skeleton: a small launch plus
in_proj's 25 MB in 10.0 us, qkv's 19 MB in 8.8 us (the Triton path: 11.3-12.6 / 9.5-12.3 us).

`fp8_linear` calls `project` for one token when `wanted` says so (on by default; METAINFER_WGMMA_GEMV=0 keeps
the Triton kernels): an sm_90 GPU with nvcc on PATH (built once like the megakernel:
`launch.build(main="gemv.cu")`), K = 2048, N a multiple of 16 up to MAX_N, bf16 x: the attention qkv (FP8
batch 1 +2 %, KB-0094). `linear_conv_update` does likewise (`wanted_conv`) for the DeltaNet in_proj with
its decode conv as the epilogue (METAINFER_WGMMA_GEMV_CONV=0 keeps Triton's): with a ring of 4 slots (128 KB,
so the next kernel's CTA fits beside it) FP8 batch 1 went 531 -> 541-542 tok/s (KB-0095).
Launched through the driver on the current torch stream with the programmatic-stream-serialization attribute
when `pdl.enabled()`; CUDA graphs record it like any kernel.

Measured slower on the H200 (2026-12-05b, all off; their GPU tests pass): two fused launches whose consumers
wait on per-head / per-pair counts in global memory (every wait bounded: it traps rather than hangs; each
launch leaves its counts zero): `project_pre_gdn` (METAINFER_WGMMA_GEMV_GDN=1, KB-0108: the DeltaNet decode
step in the in_proj's launch, FP8 batch 1 601 -> 569 tok/s) and `moe_gate_up(down=)`
(METAINFER_WGMMA_GEMV_MOE_DOWN=1, KB-0109: the experts' down in the gate/up's, -> 557); beside them the router
in the experts' launch (KB-0111), the next projection's L2 prefetch (KB-0110), the experts' own 6-slot ring
(KB-0113) and bf16 weights (KB-0114). A launch whose CTAs wait on other CTAs holds its SMs through its tail;
the PDL chain of separate launches, weights streaming before each wait, stays faster. Their removal is next.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import warnings

import torch

from metainfer.kernels import pdl
from metainfer.kernels.common import env_int

ENV = "METAINFER_WGMMA_GEMV"  # "0": one token's FP8 projections stay on the Triton kernels
CONV_ENV = "METAINFER_WGMMA_GEMV_CONV"  # "0": the DeltaNet in_proj (conv epilogue) back on Triton
SLOTS_ENV = "METAINFER_WGMMA_GEMV_SLOTS"  # the ring's 32 KB slots (2, 4 or 6; default 4): same outputs
MOE_SLOTS_ENV = "METAINFER_WGMMA_GEMV_MOE_SLOTS"  # the experts' launches' own ring (default: SLOTS's)
DEFINES_ENV = "METAINFER_WGMMA_GEMV_DEFINES"  # more -D flags for gemv.cu's build (A/Bs): "-DGEMV_PRE_EARLY=1"
MOE_ENV = "METAINFER_WGMMA_GEMV_MOE"  # "0": one token's experts' gate/up back on Triton (KB-0096)
PRE_ENV = "METAINFER_WGMMA_GEMV_PRE"  # "0": the input norm in its own launch, not qkv / in_proj (KB-0097)
GDN_ENV = "METAINFER_WGMMA_GEMV_GDN"  # "1": the DeltaNet step in the in_proj's launch (slower, KB-0108)
GDN_WAVES_ENV = "METAINFER_WGMMA_GEMV_GDN_WAVES"  # the chunks every CTA takes before the updaters stop (A/Bs)
MOE_DOWN_ENV = "METAINFER_WGMMA_GEMV_MOE_DOWN"  # "1": the experts' down in the gate/up's (slower, KB-0109)
BF16_ENV = "METAINFER_WGMMA_GEMV_BF16"  # "1": the BF16 qkv / in_proj with their input norm too (KB-0114)
ROUTER_ENV = "METAINFER_WGMMA_GEMV_MOE_ROUTER"  # "1": the post-mixer norm and router in the experts' launch
NEXT_L2_ENV = "METAINFER_WGMMA_GEMV_NEXT_L2"  # the next projection's chunks a CTA the experts put in L2
K = 2048  # the K served (a K = 4,096 form measured no faster and was removed: KB-0095)
MAX_N = 16384  # past it (the FP8 lm_head's 248,320 rows) the swept Triton GEMV stays (KB-0067)
_PDL_ATTR = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


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


class _Gdn(ctypes.Structure):  # gemv.cu's Gdn: gemv_e4m3_pre_gdn's decode step
    _fields_ = [("state", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("has", ctypes.c_void_p),
                ("a_log", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("count", ctypes.c_void_p), ("n_slots", ctypes.c_longlong), ("hv", ctypes.c_int),
                ("hk", ctypes.c_int), ("b_off", ctypes.c_int), ("a_off", ctypes.c_int),
                ("gate_f32", ctypes.c_int), ("rot", ctypes.c_int), ("waves", ctypes.c_int)]


class _Down(ctypes.Structure):  # gemv.cu's Down: moe_gate_up_down_e4m3's down projection
    _fields_ = [("ws", ctypes.c_void_p), ("out", ctypes.c_void_p), ("count", ctypes.c_void_p),
                ("dpp", ctypes.c_int)]


class _Next(ctypes.Structure):  # gemv.cu's Next: the next projection's first chunks, prefetched into L2
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int), ("grid", ctypes.c_int), ("rot", ctypes.c_int),
                ("k", ctypes.c_int)]


class _Router(ctypes.Structure):  # gemv.cu's Router: the post-mixer add, norm and router (experts' launch)
    _fields_ = [("x", ctypes.c_void_p), ("res", ctypes.c_void_p), ("w", ctypes.c_void_p),
                ("rw", ctypes.c_void_p), ("new_res", ctypes.c_void_p), ("count", ctypes.c_void_p),
                ("eps", ctypes.c_float)]


NCW = 8  # gemv.cu's consumer warps a CTA (mega::NCW): ROUTER gives each at most one router row
DOWN_ROWS = 64  # gemv.cu's rows a down chunk (K = SEG)
SEG = 512  # a chunk's row bytes in the [64, 512] view: the down projection's K (the experts' I) must be it
GDN_D = 128  # gemv.cu's DeltaNet head dims (key and value)
GDN_ROWS = 3 * GDN_D + 2  # the y rows a value head's step reads: its key head's q and k, its v, b and a
CHUNK_ROWS = 16  # W's rows a 32 KB chunk (K = 2048)


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def wanted(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> bool:
    """Whether gemv.cu serves x [1, K] @ dequant(w [N, K] e4m3, s [N / 128, K / 128])^T (N a multiple of 16;
    the caller has checked the dtypes and shapes fp8_linear asserts), or with METAINFER_WGMMA_GEMV_BF16=1
    x @ w^T for w [N, K] bf16 and s None (N a multiple of 8: `project_pre` only, KB-0114)."""
    if not enabled() or not x.is_cuda or x.shape[0] != 1 or x.dtype != torch.bfloat16 or w.dim() != 2:
        return False
    N, k = w.shape
    if w.dtype == torch.bfloat16:
        weights = s is None and N % 8 == 0 and os.environ.get(BF16_ENV, "0") == "1"
    else:
        weights = w.dtype == torch.float8_e4m3fn and s is not None and N % 16 == 0 and s.is_contiguous()
    return (weights and k == K and N <= MAX_N and x.is_contiguous() and x.data_ptr() % 16 == 0
            and w.is_contiguous() and w.data_ptr() % 16 == 0
            and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and _kernel(x.device) is not None)


def wanted_conv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, conv_weight: torch.Tensor,
                conv_state: torch.Tensor, slots: torch.Tensor) -> bool:
    """`wanted`, with the DeltaNet decode conv of one decoding row as the epilogue (`project`'s conv)."""
    C, ck = conv_weight.shape
    return (os.environ.get(CONV_ENV, "1") != "0" and w.shape[1] == K and wanted(x, w, s)
            and slots.shape == (1,) and slots.dtype == torch.int64 and ck == CONV_K and C <= w.shape[0]
            and conv_weight.dtype == conv_state.dtype == torch.bfloat16 and conv_weight.is_contiguous()
            and conv_state.shape[1:] == (ck - 1, C) and conv_state.stride(2) == 1)


def pre_enabled() -> bool:
    return os.environ.get(PRE_ENV, "1") != "0" and enabled()


def wanted_pre(rows: torch.Tensor, tw: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
               new_res: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `project_pre` serves rms_norm(sum_j tw[j] rows[j] + residual) @ dequant(w, s)^T for one
    token (the previous MoE's rows [1, W, K] fp32, W <= PRE_MAX_W; residual, new_res [1, K] bf16; the
    norm's weight [K] bf16): its switch, and `wanted` for the projection."""
    if not pre_enabled() or not rows.is_cuda or rows.dim() != 3:
        return False
    W = rows.shape[1]
    return (rows.shape == (1, W, K) and 0 < W <= PRE_MAX_W and rows.dtype == tw.dtype == torch.float32
            and tw.shape == (1, W) and residual.shape == new_res.shape == (1, K)
            and residual.dtype == new_res.dtype == norm_weight.dtype == torch.bfloat16
            and norm_weight.shape == (K,)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0
                    for t in (rows, tw, residual, norm_weight, new_res))
            and wanted(residual, w, s))


def wanted_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor,
               s: torch.Tensor | None) -> bool:
    """Whether `moe_gate_up` serves one token's routed and shared experts' gate/up: its switch, x [1, K]
    bf16, logits [1, E + 1] bf16 (the shared expert's gate last), w [E + 1, rows, K] e4m3 (the shared expert
    at E), rows a multiple of 128, s its [E + 1, rows / 128, K / 128] block scales, E <= MOE_MAX_E,
    top_k < MOE_MAX_K; or (METAINFER_WGMMA_GEMV_BF16=1, KB-0114) w bf16 and s None."""
    if os.environ.get(MOE_ENV, "1") == "0" or not enabled() or not x.is_cuda or w.dim() != 3:
        return False
    E1, rows, k = w.shape
    if w.dtype == torch.bfloat16:
        weights = s is None and os.environ.get(BF16_ENV, "0") == "1"
    else:
        weights = (w.dtype == torch.float8_e4m3fn and s is not None and s.is_contiguous()
                   and s.shape == (E1, rows // 128, K // 128) and s.dtype == torch.float32)
    return (weights and x.shape == (1, K) and x.dtype == logits.dtype == torch.bfloat16
            and logits.shape == (1, E1) and 0 < top_k < min(MOE_MAX_K, E1) and E1 - 1 <= MOE_MAX_E and k == K
            and rows % 128 == 0 and w.is_contiguous() and x.is_contiguous() and logits.is_contiguous()
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and _kernel(x.device) is not None)


KERNEL_NAMES = ("gemv_e4m3", "gemv_e4m3_pre", "gemv_e4m3_pre_gdn", "gemv_bf16_pre", "moe_gate_up_e4m3",
                "moe_gate_up_down_e4m3", "moe_router_gate_up_down_e4m3", "moe_gate_up_bf16")


class _Kernel:
    """gemv.cu loaded on one device."""

    def __init__(self, device: torch.device) -> None:
        from metainfer.kernels.mega import launch

        self.launch_mod = launch
        torch.zeros(1, device=device)  # the primary context exists and is current
        self.drv = launch._Driver()
        # the watchdog's report: pinned host memory (the device writes it through unified addressing), which
        # stays readable once a trap has ended the context (watchdog_report)
        self.watch = torch.zeros(8, dtype=torch.int32, pin_memory=True)
        self.smem_of: dict[int, int] = {}  # each function's dynamic shared memory (its module's ring)
        self.modules: list[ctypes.c_void_p] = []  # (loaded for the process)
        slots, moe_slots = ring_slots(), moe_ring_slots()
        fns = self._load(device, slots)
        if moe_slots != slots:  # the experts' launches from a build with their own ring (KB-0113)
            fns.update({k: v for k, v in self._load(device, moe_slots).items() if k.startswith("moe_")})
        self.fn, self.pre_fn, self.gdn_fn = fns["gemv_e4m3"], fns["gemv_e4m3_pre"], fns["gemv_e4m3_pre_gdn"]
        self.bf16_pre_fn = fns["gemv_bf16_pre"]
        self.moe_fn, self.moe_down_fn = fns["moe_gate_up_e4m3"], fns["moe_gate_up_down_e4m3"]
        self.router_down_fn = fns["moe_router_gate_up_down_e4m3"]
        self.moe_bf16_fn = fns["moe_gate_up_bf16"]
        self.smem = self.smem_of[self.fn.value]
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        # moe_gate_up_down_e4m3's counts (each launch leaves them zero; one launch at a time on the device)
        self.moe_count = torch.zeros(MOE_MAX_K + 1, dtype=torch.int32, device=device)
        self.router_count = torch.zeros(2, dtype=torch.int32, device=device)  # the ROUTER launches' (as it)
        # each weight's TMA map, by (address, bytes): a map holds only those (the [bytes / 512, 512] view),
        # so a reused address of the same size gets the same map back, whatever the dtype (the launch copies
        # it into its parameters); a shape key let a bf16 weight take an e4m3 one's map (half its rows)
        self.maps: dict[tuple[int, int], ctypes.Array] = {}

    def _load(self, device: torch.device, slots: int) -> dict[str, ctypes.c_void_p]:
        """gemv.cu built with a ring of `slots` slots, loaded: -> its kernels by name (their shared memory in
        smem_of), its layout constants checked against the host's structs, its watchdog pointed at watch."""
        from metainfer.kernels.mega import program as P

        image = self.launch_mod.build(main="gemv.cu", defines=(f"-DGEMV_SLOTS={slots}", *build_defines()))
        module = ctypes.c_void_p()
        self.drv("cuModuleLoadData", ctypes.byref(module), image.read_bytes())
        self.modules.append(module)
        fns = {}
        for name in KERNEL_NAMES:
            fns[name] = ctypes.c_void_p()
            self.drv("cuModuleGetFunction", ctypes.byref(fns[name]), module, name.encode())
        out = torch.zeros(9, dtype=torch.int64, device=device)
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        for name, arg in ((b"gemv_constants", out.data_ptr()), (b"gemv_set_watch", self.watch.data_ptr())):
            fn = ctypes.c_void_p()
            self.drv("cuModuleGetFunction", ctypes.byref(fn), module, name)
            self.drv("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream,
                     self.launch_mod.kernel_params([ctypes.c_void_p(arg)]), None)
        self.threads, smem, conv, moe, pre, gdn, down, nxt, router = out.tolist()
        want = (P.THREADS, ctypes.sizeof(_Conv) * 100 + CONV_K, ctypes.sizeof(_Moe) * 10000 + MOE_MAX_E * 100
                + MOE_MAX_K, ctypes.sizeof(_Pre) * 100 + PRE_MAX_W,
                ctypes.sizeof(_Gdn) * 100000 + GDN_D * 1000 + GDN_ROWS,
                ctypes.sizeof(_Down) * 1000 + DOWN_ROWS, ctypes.sizeof(_Next), ctypes.sizeof(_Router))
        if (self.threads, conv, moe, pre, gdn, down, nxt, router) != want:
            raise RuntimeError(f"gemv.cu's constants {out.tolist()} differ from (threads, -, conv, moe, pre, "
                               f"gdn, down, next, router): {want}")
        for fn in fns.values():
            self.drv("cuFuncSetAttribute", fn, 8, smem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.smem_of[fn.value] = smem
        return fns

    def tensor_map(self, w: torch.Tensor) -> ctypes.Array:
        key = (w.data_ptr(), w.numel() * w.element_size())
        tmap = self.maps.get(key)
        if tmap is None:
            raw = self.launch_mod.encode_tensor_map(self.drv, w, 512, 64)
            tmap = self.maps[key] = (ctypes.c_uint64 * 16).from_buffer_copy(raw)
        return tmap

    def __call__(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
                 conv: tuple | None, pre: tuple | None = None, gdn: _Gdn | None = None) -> None:
        N = w.shape[0]
        tmap = self.tensor_map(w)
        cv = _Conv()
        if conv is not None:
            cw, cstate, slots, has = conv
            cv = _Conv(cw.data_ptr(), cstate.data_ptr(), slots.data_ptr(), has.data_ptr(), cstate.stride(0),
                       cstate.stride(1), cw.shape[0])
        if pre is not None:  # x is the prologue's (the residual stands in for it in the checks)
            rows, tw, res, nw, eps, new_res = pre
            p = _Pre(rows.data_ptr(), tw.data_ptr(), res.data_ptr(), nw.data_ptr(), new_res.data_ptr(), eps,
                     rows.shape[1])
            if w.dtype == torch.bfloat16:  # 32 KB chunks of 8 rows, no scales
                assert gdn is None and s is None
                self.launch(self.bf16_pre_fn, [tmap, ctypes.c_void_p(y.data_ptr()), ctypes.c_int(N), cv, p],
                            N // 8, x.device)
                return
            args = [tmap, ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(N), cv,
                    p]
            if gdn is not None:
                self.launch(self.gdn_fn, [*args, gdn], N // 16, x.device)
            else:
                self.launch(self.pre_fn, args, N // 16, x.device)
            return
        args = [tmap, ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                ctypes.c_void_p(y.data_ptr()), ctypes.c_int(N), cv]
        self.launch(self.fn, args, N // 16, x.device)  # 32 KB chunks of 16 rows

    def moe(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor,
            gu: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, down: tuple | None = None,
            out: torch.Tensor | None = None, nxt: _Next | None = None, router: tuple | None = None) -> None:
        """moe_gate_up_e4m3, or with down = (w_down, s_down) moe_gate_up_down_e4m3 (its rows into out); nxt:
        the next projection's chunks to prefetch into L2 (`next_l2`); router = (x, residual, norm weight,
        eps, router weight, new_res): moe_router_gate_up_down_e4m3 (x the mixer's output, logits written; down
        required)."""
        E1, rows, _ = w.shape
        m = _Moe(logits.data_ptr(), gu.data_ptr(), tw.data_ptr(), ids.data_ptr(), E1 - 1, top_k, rows)
        if w.dtype == torch.bfloat16:  # moe_gate_up_bf16: 8 rows a chunk, no scales (KB-0114)
            assert s is None and down is None and router is None
            args = [self.tensor_map(w), ctypes.c_void_p(x.data_ptr()), m, nxt or _Next()]
            self.launch(self.moe_bf16_fn, args, (top_k + 1) * rows // 8, x.device)
            return
        args = [self.tensor_map(w), ctypes.c_void_p(s.data_ptr())]
        if router is None:
            args.append(ctypes.c_void_p(x.data_ptr()))
        args.append(m)
        assert router is None or down is not None, "the router's launch takes the down too"
        fns = (self.moe_fn, self.moe_down_fn) if router is None else (None, self.router_down_fn)
        if down is not None:
            w_down, s_down = down
            n = w_down.shape[1] // DOWN_ROWS  # down chunks a pair
            d = _Down(s_down.data_ptr(), out.data_ptr(), self.moe_count.data_ptr(), n)
            args += [self.tensor_map(w_down), d]
        args.append(nxt or _Next())
        if router is not None:
            rx, res, nw, eps, rw, new_res = router
            args.append(_Router(rx.data_ptr(), res.data_ptr(), nw.data_ptr(), rw.data_ptr(),
                                new_res.data_ptr(), self.router_count.data_ptr(), eps))
        self.launch(fns[down is not None], args, (top_k + 1) * rows // 16, x.device)

    def launch(self, fn: ctypes.c_void_p, args: list, chunks: int, device: torch.device) -> None:
        """One CTA per SM (at most one per chunk), on the current stream, with the PDL attribute when
        `pdl.enabled()` (without it: stream order, the kernel's wait returns at once)."""
        params = self.launch_mod.kernel_params(args)
        cfg = _Config()
        cfg.grid[:] = (min(self.sms, chunks), 1, 1)
        cfg.block[:] = (self.threads, 1, 1)
        cfg.smem = self.smem_of[fn.value]
        cfg.stream = torch.cuda.current_stream(device).cuda_stream
        attr = _Attr(id=_PDL_ATTR)
        attr.value.val = 1
        cfg.attrs = ctypes.pointer(attr)
        cfg.n_attrs = int(pdl.enabled())
        self.drv("cuLaunchKernelEx", ctypes.byref(cfg), fn, params, None)


def ring_slots() -> int:
    """METAINFER_WGMMA_GEMV_SLOTS: 2, 4 (the default) or 6. Even only: the two consumer warpgroups take
    alternate chunks, so with an odd ring a slot's next chunk would be the other warpgroup's, which could pass
    its mbarrier wait a phase early (gemv.cu's static_assert says why)."""
    slots = env_int(SLOTS_ENV, 4, 2, 6)
    if slots % 2:
        raise ValueError(f"{SLOTS_ENV} must be 2, 4 or 6 (an even ring); got {slots}")
    return slots


def moe_ring_slots() -> int:
    """METAINFER_WGMMA_GEMV_MOE_SLOTS: the experts' launches' own ring (2, 4 or 6; default: the others', 4;
    KB-0113). Their CTAs cannot sit beside the next projection's at 4 slots either, so a deeper ring costs
    them no co-residency there, and 6 slots hold every chunk of a CTA's (the model's 576 over 132 CTAs: 4-5)
    in flight at once."""
    slots = env_int(MOE_SLOTS_ENV, ring_slots(), 2, 6)
    if slots % 2:
        raise ValueError(f"{MOE_SLOTS_ENV} must be 2, 4 or 6 (an even ring); got {slots}")
    return slots


def build_defines() -> tuple[str, ...]:
    """METAINFER_WGMMA_GEMV_DEFINES's flags, space-separated (launch.build rejects any but -DNAME[=VALUE])."""
    return tuple(os.environ.get(DEFINES_ENV, "").split())


_KERNELS: dict[torch.device, _Kernel | None] = {}
WATCH_KERNELS = ("a ring slot's chunk", "gemv_e4m3_pre_gdn: a head's rows",
                 "moe_gate_up_down_e4m3: a pair's chunks", "moe_router_*: the router's logits")
WATCH_CODES = {1: "a count", 2: "a full ring slot", 3: "an empty ring slot", 4: "its producer's ready"}


def watchdog_report() -> str | None:
    """What gemv.cu's watchdog recorded where a wait gave up (then the kernel trapped and the context is
    gone; this reads the pinned host copy): which kernel, CTA and thread, and what it saw against what it
    needed. None where no wait has given up (or gemv.cu is not loaded)."""
    for dev, k in _KERNELS.items():
        if k is None or int(k.watch[0]) == 0:
            continue
        code, cta, thread, saw, need, kernel = (int(v) for v in k.watch[:6].tolist())
        what = WATCH_CODES.get(code, f"code {code}")
        where = WATCH_KERNELS[kernel] if 0 <= kernel < len(WATCH_KERNELS) else f"kernel {kernel}"
        detail = (f"saw {saw}, needed {need}" if code == 1 else "its producer never passed the logits' count"
                  if code == 4 else f"chunk {saw} of the CTA, parity {need}")
        return (f"gemv.cu watchdog on {dev}: CTA {cta} thread {thread} gave up waiting on {what} ({where}): "
                f"{detail}")
    return None


LOAD_ENVS = (SLOTS_ENV, MOE_SLOTS_ENV, DEFINES_ENV)  # read when gemv.cu is built and loaded (then `reset`)


def reset() -> None:
    """Forgets the loaded kernels: the next call builds (or finds in the cubin cache) and loads gemv.cu for
    the ring sizes and -D flags the environment says now (an in-process A/B of METAINFER_WGMMA_GEMV_SLOTS,
    _MOE_SLOTS or _DEFINES: benchmarks/ab_inproc.py). The modules loaded before stay loaded; graphs captured
    with them must be dropped first."""
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
            warnings.warn(f"mega/gemv.cu unavailable, the Triton projections serve: {e}", stacklevel=2)
    _KERNELS[dev] = kernel
    return kernel


def project(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor,
            conv: tuple | None = None) -> None:
    """y [1, N] bf16 = x [1, K] bf16 @ dequant(w [N, K], s)^T on gemv.cu (the caller checked `wanted`). conv =
    (conv_weight [C, 4], conv_state [S, 3, C], slots [1] int64, has_state [1] bool), checked by `wanted_conv`:
    y[:, :C] becomes the decode conv + SiLU of itself, the slot's conv state updated in place
    (`weight_stream.linear_conv_update`'s epilogue)."""
    assert y.is_contiguous() and y.shape == (1, w.shape[0]) and y.dtype == torch.bfloat16, (y.shape, y.dtype)
    assert w.dtype == torch.float8_e4m3fn, "bf16 weights: project_pre only (gemv_bf16_pre)"
    kernel = _kernel(x.device)
    assert kernel is not None, "project() without wanted()"
    kernel(x, w, s, y, conv)


def project_pre(rows: torch.Tensor, tw: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, new_res: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
                conv: tuple | None = None) -> torch.Tensor | None:
    """One decode token's projection whose x is the previous MoE's rows summed into the residual and this
    layer's input RMSNorm, computed in gemv.cu's x prologue (norm.moe_add_rms_norm's steps; new_res gets the
    new residual): -> y [1, N] bf16, or None where the kernel does not serve it (`wanted_pre`; with conv,
    `wanted_conv`: then y[:, :C] is the decode conv of itself, as `project`'s conv). w: e4m3 with its block
    scales s, or bf16 with s None (gemv_bf16_pre, METAINFER_WGMMA_GEMV_BF16=1)."""
    if not wanted_pre(rows, tw, residual, norm_weight, new_res, w, s):
        return None
    if conv is not None and not wanted_conv(residual, w, s, *conv[:3]):
        return None
    y = torch.empty(1, w.shape[0], dtype=torch.bfloat16, device=rows.device)
    kernel = _kernel(rows.device)
    assert kernel is not None
    kernel(residual, w, s, y, conv, (rows, tw, residual, norm_weight, eps, new_res))
    return y


def next_l2(nxt: tuple[torch.Tensor, int] | None, device: torch.device) -> _Next | None:
    """The next projection's first chunks for an experts' launch to prefetch into L2 (KB-0110): nxt = (w
    [N, 2048] e4m3, rot: its chunk rotation, `gdn_schedule`'s where the DeltaNet step is fused, else 0),
    the chunks k < METAINFER_WGMMA_GEMV_NEXT_L2 (default 0: none) that its CTA of each index lands first.
    None where there is nothing to prefetch."""
    k = env_int(NEXT_L2_ENV, 0, 0, 16)
    if k == 0 or nxt is None:
        return None
    w, rot = nxt
    kernel = _kernel(device)
    if (kernel is None or w.dim() != 2 or w.shape[1] != K or w.dtype != torch.float8_e4m3fn
            or w.shape[0] % CHUNK_ROWS or not w.is_contiguous()):
        return None
    n = w.shape[0] // CHUNK_ROWS
    return _Next(w.data_ptr(), n, min(kernel.sms, n), rot % n, k)


def moe_gate_up(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor | None,
                down: tuple[torch.Tensor, torch.Tensor] | None = None,
                prefetch: tuple[torch.Tensor, int] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's experts' gate/up on gemv.cu (the caller checked `wanted_moe`): routed from logits (the
    top_k largest, lowest index on ties, as `routing.softmax_topk`) and the shared expert (w's last).
    -> (gu [top_k + 1, rows] fp32: each pair's gate . x then up . x, slot order; tw [1, top_k + 1] fp32 the
    routing weights, the shared expert's sigmoid(gate) last; ids [1, top_k + 1] int64).
    down = (w_down, s_down) (the caller checked `wanted_moe_down`): the experts' down projection in the same
    launch, and rows [top_k + 1, K] fp32 in gu's place: each pair's unweighted down of bf16(silu(gate) * up),
    slot order, the shared expert last, as `moe._routed_down`'s. prefetch = (w, rot): the next projection,
    whose first chunks the launch prefetches into L2 once its own are landed (`next_l2`; off by default)."""
    kernel = _kernel(x.device)
    assert kernel is not None, "moe_gate_up() without wanted_moe()"
    gu, tw, ids, out = _moe_outputs(top_k + 1, w, down, x.device)
    kernel.moe(x, logits, top_k, w, s, gu, tw, ids, down, out, next_l2(prefetch, x.device))
    return (gu if out is None else out), tw, ids


def _moe_outputs(W: int, w: torch.Tensor, down: tuple | None, device: torch.device) -> tuple:
    """The experts' launches' outputs for W pairs: gu [W, rows] fp32, tw [1, W] fp32, ids [1, W] int64, and
    with down the rows [W, K] fp32 (else None)."""
    gu = torch.empty(W, w.shape[1], dtype=torch.float32, device=device)
    tw = torch.empty(1, W, dtype=torch.float32, device=device)
    ids = torch.empty(1, W, dtype=torch.int64, device=device)
    out = None if down is None else torch.empty(W, down[0].shape[1], dtype=torch.float32, device=device)
    return gu, tw, ids, out


def wanted_moe_router(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                      router_weight: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `moe_router_gate_up` serves one token's post-mixer add + RMSNorm, router and experts in one
    launch: its switch (off until measured), x and residual [1, K] bf16 (the mixer's output and the residual
    stream), the norm's weight [K] bf16, the router's [E + 1, K] bf16 (the shared expert's gate last, E + 1
    = w's experts) and `wanted_moe`'s experts, with every router row a consumer warp's."""
    if os.environ.get(ROUTER_ENV, "0") != "1" or not x.is_cuda or w.dim() != 3:
        return False
    E1 = w.shape[0]
    logits = torch.empty(1, E1, dtype=torch.bfloat16, device="meta")  # (the logits' shape, for wanted_moe)
    if not wanted_moe(x, logits, top_k, w, s):
        return False
    kernel = _kernel(x.device)
    grid = min(kernel.sms, (top_k + 1) * w.shape[1] // CHUNK_ROWS)
    same = residual.dtype == norm_weight.dtype == router_weight.dtype == x.dtype
    return (residual.shape == x.shape and same and residual.is_contiguous() and residual.data_ptr() % 16 == 0
            and norm_weight.shape == (K,) and norm_weight.is_contiguous() and norm_weight.data_ptr() % 16 == 0
            and router_weight.shape == (E1, K) and router_weight.is_contiguous()
            and router_weight.data_ptr() % 16 == 0 and grid * NCW >= E1)


def moe_router_gate_up(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router_weight: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor,
                       down: tuple[torch.Tensor, torch.Tensor],
                       prefetch: tuple[torch.Tensor, int] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_gate_up(down=)` with the post-mixer add + RMSNorm and the router in the same launch (the caller
    checked `wanted_moe_router` and `wanted_moe_down`; the down is required: the Triton down reads the logits
    before its PDL wait): x the mixer's output [1, K], residual the stream before the add. -> (the rows, tw,
    ids as `moe_gate_up(down=)`; new residual [1, K] = bf16(x + residual); logits [1, E + 1] bf16), as
    norm.add_rms_norm_router then `moe_gate_up(down=)` give them."""
    kernel = _kernel(x.device)
    assert kernel is not None, "moe_router_gate_up() without wanted_moe_router()"
    gu, tw, ids, out = _moe_outputs(top_k + 1, w, down, x.device)
    logits = torch.empty(1, w.shape[0], dtype=torch.bfloat16, device=x.device)
    new_res = torch.empty_like(residual)
    kernel.moe(x, logits, top_k, w, s, gu, tw, ids, down, out, next_l2(prefetch, x.device),
               router=(x, residual, norm_weight, eps, router_weight, new_res))
    return out, tw, ids, new_res, logits


def gdn_enabled() -> bool:
    return os.environ.get(GDN_ENV, "0") == "1" and pre_enabled()


def gdn_schedule(n_rows: int, grid: int, hv: int, hk: int, b_off: int) -> tuple[int, int]:
    """gemv_e4m3_pre_gdn's chunk order -> (rot, waves). Virtual chunk c is W's chunk (c + rot) % chunks: rot
    is the chunk of b's first row, so the b and a rows (the last of the DeltaNet in_proj) come first, q, k, v
    next, the z rows last. Every CTA takes its chunks c = b + k grid for k < waves; past them only the CTAs
    >= hv (the heads' updaters wait and step instead). waves: the fewest that hold every head's rows (q, k,
    v), so that the updaters' own chunks end about when their rows are in; METAINFER_WGMMA_GEMV_GDN_WAVES
    overrides it."""
    n_chunks = n_rows // CHUNK_ROWS
    rot = b_off // CHUNK_ROWS
    last = (2 * hk + hv) * GDN_D - 1  # the last v row
    ready = (last // CHUNK_ROWS - rot) % n_chunks + 1  # virtual chunks up to the one holding it
    waves = env_int(GDN_WAVES_ENV, -(-ready // grid), 1, n_chunks)
    return rot, waves


def wanted_gdn(y_rows: int, conv: tuple | None, A_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, count: torch.Tensor, hk: int, hv: int, b_off: int, a_off: int) -> bool:
    """Whether `project_pre_gdn` can take the DeltaNet decode step into the in_proj's launch (its switch; the
    in_proj's rows [q | k | v | z | b | a] with head dims GDN_D: q, k, v rows below b_off, b and a apart; the
    conv epilogue; fp32 states [S, hv, D, D]; count [hv] int32 zeros; hv <= 32 and fewer than the grid)."""
    if not gdn_enabled() or conv is None or not state.is_cuda:
        return False
    kernel = _kernel(state.device)
    qkv = (2 * hk + hv) * GDN_D
    return (kernel is not None and 0 < hk and hv % hk == 0 and hv <= 32
            and hv < min(kernel.sms, y_rows // CHUNK_ROWS) and y_rows % CHUNK_ROWS == 0
            and conv[0].shape[0] == qkv and qkv <= b_off and b_off + hv <= a_off and a_off + hv <= y_rows
            and state.dtype == torch.float32 and state.is_contiguous() and state.dim() == 4
            and tuple(state.shape[1:]) == (hv, GDN_D, GDN_D) and state.data_ptr() % 16 == 0
            and count.dtype == torch.int32 and count.shape == (hv,) and count.is_contiguous()
            and A_log.shape == dt_bias.shape == (hv,) and A_log.dtype == dt_bias.dtype
            and A_log.dtype in (torch.float32, torch.bfloat16) and A_log.is_contiguous()
            and dt_bias.is_contiguous())


def project_pre_gdn(rows: torch.Tensor, tw: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, new_res: torch.Tensor, w: torch.Tensor, s: torch.Tensor, conv: tuple,
                    gdn: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`project_pre` of the DeltaNet in_proj (conv: its decode conv) with the layer's decode step in the
    same launch: gdn = (A_log, dt_bias, ssm_state, count, hk, hv, b_off, a_off), the step of
    `gdn_decode.gdn_decode_gated` on y's q, k, v, a, b (the slot and has_state: conv's). count: the layer's
    [hv] int32 arrival counters, zeros (each launch leaves them zero). -> (y [1, N] bf16, the step's output
    [1, hv, D] bf16), or None where the kernel does not serve it (`wanted_gdn`, `wanted_pre`,
    `wanted_conv`)."""
    A_log, dt_bias, state, count, hk, hv, b_off, a_off = gdn
    N = w.shape[0]
    if not (wanted_gdn(N, conv, A_log, dt_bias, state, count, hk, hv, b_off, a_off)
            and wanted_pre(rows, tw, residual, norm_weight, new_res, w, s)
            and wanted_conv(residual, w, s, *conv[:3]) and conv[3].dtype in (torch.bool, torch.uint8)):
        return None
    kernel = _kernel(rows.device)
    slots, has = conv[2], conv[3]
    rot, waves = gdn_schedule(N, min(kernel.sms, N // CHUNK_ROWS), hv, hk, b_off)
    y = torch.empty(1, N, dtype=torch.bfloat16, device=rows.device)
    core = torch.empty(1, hv, GDN_D, dtype=torch.bfloat16, device=rows.device)
    g = _Gdn(state.data_ptr(), slots.data_ptr(), has.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
             core.data_ptr(), count.data_ptr(), state.shape[0], hv, hk, b_off, a_off,
             int(A_log.dtype == torch.float32), rot, waves)
    kernel(residual, w, s, y, conv, (rows, tw, residual, norm_weight, eps, new_res), gdn=g)
    return y, core


def wanted_moe_down(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: torch.Tensor, s: torch.Tensor,
                    w_down: torch.Tensor, s_down: torch.Tensor) -> bool:
    """Whether `moe_gate_up(..., down=)` serves one token's experts, gate/up and down in one launch: its
    switch (off until measured), `wanted_moe`, and the down weights w_down [E + 1, K, I] e4m3 with I = SEG
    (the gate/up's rows / 2) and their [E + 1, K / 128, I / 128] fp32 block scales s_down."""
    if os.environ.get(MOE_DOWN_ENV, "0") != "1" or not wanted_moe(x, logits, top_k, w, s):
        return False
    if "-DGEMV_PRE_EARLY=1" in build_defines():  # the next prologue would read tw before it is written
        return False
    E1, rows, k = w.shape
    return (w_down.shape == (E1, k, rows // 2) and rows // 2 == SEG and w_down.dtype == torch.float8_e4m3fn
            and w_down.is_contiguous() and w_down.data_ptr() % 16 == 0 and s_down.dtype == torch.float32
            and s_down.shape == (E1, k // 128, SEG // 128) and s_down.is_contiguous()
            and s_down.data_ptr() % 16 == 0)

