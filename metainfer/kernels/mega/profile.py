"""Where a megakernel step's time goes: the profiling build's records (mega_base.cuh, MEGA_PROF 1) read back.

Per CTA and instruction the kernel writes PF_N words of SM cycles (clock64's low 32 bits, so differences
are taken modulo 2^32): the consumers' entry, the moment x is staged (streaming ops), their exit, their
cycles waiting for weight chunks and the chunk count (consumer thread 0); the producer's entry, its routing
wait (with the L2 lead) and its waits for empty slots (producer lane 0). After them, per CTA, globaltimer
(ns) at entry and exit, which turns cycles into time and lines the CTAs up.

`summarize(buf, instrs, grid)` -> per instruction group (op and shape) the CTAs' mean cycles in each
phase, converted to microseconds, and the step's span. Only arithmetic on the buffer: it runs on the CPU
from a saved record as well (tests/kernels/test_mega_profile.py builds one by hand).
"""

from __future__ import annotations

import torch

from metainfer.kernels.mega import program as P

C_IN, C_X, C_OUT, C_WAIT, P_IN, P_ROUTE, P_EMPTY, CHUNKS, S1, S2, S3, S4, LAT = range(13)
PF_N = 13


def words(n_instr: int, grid: int) -> int:
    """int32 words of a profile buffer for n_instr instructions on `grid` CTAs."""
    return grid * n_instr * PF_N + grid * 4


def label(g: P.Instr) -> str:
    """An instruction's group: its op and the shape that sets its cost."""
    if isinstance(g, P.Gemv):
        wt = "e4m3" if g.w.dtype == torch.float8_e4m3fn else "bf16"
        return f"Gemv {g.rows}x{g.k} {wt}"
    if isinstance(g, (P.GateUp, P.Down)):
        return type(g).__name__
    return type(g).__name__


def _u32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64) & 0xFFFFFFFF


def _delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(b - a) mod 2^32, int64."""
    return (_u32(b) - _u32(a)) & 0xFFFFFFFF


def summarize(buf: torch.Tensor, instrs: list[P.Instr], grid: int) -> dict:
    """The profile buffer (int32, words(len(instrs), grid)) -> a summary dict (see module docstring)."""
    n = len(instrs)
    buf = buf.detach().cpu().to(torch.int64)
    rec = buf[: grid * n * PF_N].view(grid, n, PF_N)
    t = _u32(buf[grid * n * PF_N : grid * n * PF_N + grid * 4].view(grid, 4))
    t_in, t_out = t[:, 0] | (t[:, 1] << 32), t[:, 2] | (t[:, 3] << 32)
    span_cycles = _delta(rec[:, 0, C_IN], rec[:, n - 1, C_OUT]).double()  # first entry to last exit, per CTA
    span_ns = (t_out - t_in).double()
    hz = float((span_cycles.sum() / span_ns.sum()) * 1e9) if float(span_ns.sum()) > 0 else float("nan")
    us = 1e6 / hz

    total = _delta(rec[:, :, C_IN], rec[:, :, C_OUT]).double()  # [grid, n]
    streaming = torch.tensor([isinstance(g, (P.Gemv, P.GateUp, P.Down)) for g in instrs])
    has_x = (rec[:, :, C_X] != 0) & streaming  # the op staged x (the CTA had units of it)
    stage = torch.where(has_x, _delta(rec[:, :, C_IN], rec[:, :, C_X]).double(), torch.zeros_like(total))
    wait = _u32(rec[:, :, C_WAIT]).double()
    route = _u32(rec[:, :, P_ROUTE]).double()
    empty = _u32(rec[:, :, P_EMPTY]).double()
    chunks = _u32(rec[:, :, CHUNKS]).double()
    lat = _u32(rec[:, :, LAT]).double()  # one L2 load's round trip at each op's entry

    phases = {"consumer_us": total, "stage_us": stage, "chunk_wait_us": wait, "work_us": total - stage - wait,
              "producer_route_us": route, "producer_empty_wait_us": empty}  # each [grid, n] cycles

    def mean_us(x: torch.Tensor, ix: torch.Tensor) -> float:  # the CTAs' mean of the summed cycles of ix
        return float(x[:, ix].sum(1).mean()) * us

    groups: dict[str, list[int]] = {}
    for i, g in enumerate(instrs):
        groups.setdefault(label(g), []).append(i)
    rows = []
    for name, idx in groups.items():
        ix = torch.tensor(idx)
        rows.append({"group": name, "instructions": len(idx),
                     "chunks_per_cta": float(chunks[:, ix].sum(1).mean()),
                     **{k: mean_us(v, ix) for k, v in phases.items()},
                     "load_latency_us": float(lat[:, ix].median()) * us})
    rows.sort(key=lambda r: -r["consumer_us"])
    every = torch.arange(n)
    return {"clock_ghz": hz / 1e9, "grid": grid, "instructions": n,
            "span_us_mean": float(span_ns.mean()) / 1e3, "span_us_all": float(t_out.max() - t_in.min()) / 1e3,
            **{k: mean_us(v, every) for k, v in phases.items()},
            "load_latency_us": float(lat.median()) * us, "groups": rows}


def record(kernel, prog: P.Program, mma: bool = False, lead: int = 0, inflight: int = P.NSLOTS,
           launches: int = 3) -> torch.Tensor:
    """The profile buffer of the last of `launches` launches of prog on kernel (a MegaKernel(prof=True))."""
    buf = torch.zeros(words(len(prog.instrs), kernel.num_sms), dtype=torch.int32, device=kernel.device)
    for _ in range(launches):
        buf.zero_()
        kernel.launch(prog, lead=lead, mma=mma, inflight=inflight, prof=buf)
    torch.cuda.synchronize(kernel.device)
    return buf


COLUMNS = (("consumer_us", "consumer us"), ("stage_us", "stage x"), ("chunk_wait_us", "chunk waits"),
           ("work_us", "work"), ("producer_route_us", "producer route"),
           ("producer_empty_wait_us", "empty waits"))


def table(s: dict) -> str:
    """summarize's dict as a markdown table (microseconds per CTA, the CTAs' mean)."""
    head = ["group", "n", "chunks/CTA", *(c for _, c in COLUMNS), "L2 load us (median)"]
    out = [f"profile: {s['instructions']} instructions on {s['grid']} CTAs, "
           f"SM clock {s['clock_ghz']:.2f} GHz, "
           f"span {s['span_us_mean']:.1f} us per CTA ({s['span_us_all']:.1f} first entry to last exit)",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = {"group": "all", "instructions": s["instructions"], "chunks_per_cta": float("nan"),
             **{k: s[k] for k, _ in COLUMNS}, "load_latency_us": s["load_latency_us"]}
    for r in [*s["groups"], total]:
        cells = [r["group"], str(r["instructions"]), f"{r['chunks_per_cta']:.1f}",
                 *(f"{r[k]:.1f}" for k, _ in COLUMNS), f"{r['load_latency_us']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
