"""FP8 weights: 128x128 block quantisation (the published checkpoint format), in-place conversion
of a loaded model, and placement of an FP8 checkpoint's tensors.

Format (DeepSeek-V3 / Qwen FP8 checkpoints): for every 128x128 block of W [N, K] (edge blocks
smaller), scale_inv = amax(|block|) / 448 (fp32) and w_e4m3 = clamp(W / scale_inv, +-448);
dequantised W ~ w_e4m3 * scale_inv. An all-zero block gets scale_inv = 1.

Quantised (e4m3 + `weight_scale_inv`): every dense Linear of the decoder layers and the MTP
(attention qkv/o, DeltaNet in_proj/out_proj, shared-expert gate_up/down, mtp.fc) and the routed
experts (`w_gate_up`/`w_down` + `w_gate_up_scale`/`w_down_scale`). Kept BF16: the router (with the
shared-expert gate row), norms, conv/A_log/dt_bias, embeddings and lm_head.

DeltaNet in_proj stacks [qkv | z | b | a]; the published checkpoint keeps in_proj_b/a in BF16.
qkv (8192 rows) and z (4096) end on a 128-row boundary, so b|a (2 x 32 rows) form the last row
block alone: they are quantised here with their own scales (one per 128 input columns), a small
precision loss the BF16 checkpoint avoids. Splitting b|a into a separate BF16 Linear (a change in
deltanet.py) would remove it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import nn

from metainfer.model.layers import Linear, SparseMoE

FP8_MAX = 448.0
BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (w_e4m3 [..., N, K], scale_inv [..., ceil(N/b), ceil(K/b)] fp32). CPU or CUDA."""
    *lead, N, K = w.shape
    nb, kb = _cdiv(N, block), _cdiv(K, block)
    wf = w.float()
    if (nb * block, kb * block) != (N, K):
        wf = torch.nn.functional.pad(wf, (0, kb * block - K, 0, nb * block - N))
    blocks = wf.view(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(*lead, nb * block, kb * block)[..., :N, :K].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from metainfer.kernels.ops import ref_dequant_fp8

    return ref_dequant_fp8(q, scale_inv, dtype)


def _quantize_chunked(w: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_block over the leading dim `chunk` slices at a time (bounded fp32 temporaries)."""
    if w.dim() == 2:
        return quantize_fp8_block(w)
    E, N, K = w.shape
    q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(E, _cdiv(N, BLOCK), _cdiv(K, BLOCK), dtype=torch.float32, device=w.device)
    for e in range(0, E, chunk):
        q[e : e + chunk], s[e : e + chunk] = quantize_fp8_block(w[e : e + chunk])
    return q, s


def fp8_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """The dense Linears that go FP8: every Linear of the decoder/MTP layers but the router, and mtp.fc."""
    out = []
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.layers)]
    if getattr(model, "mtp", None) is not None:
        out.append(("mtp.fc", model.mtp.fc))
        layers.append(("mtp.layers.0", model.mtp.layers[0]))
    for prefix, layer in layers:
        for name, mod in layer.named_modules():
            if isinstance(mod, Linear) and not name.endswith("router"):
                out.append((f"{prefix}.{name}", mod))
    return out


def fp8_moes(model: nn.Module) -> list[SparseMoE]:
    mods = [layer.mlp for layer in model.layers]
    if getattr(model, "mtp", None) is not None:
        mods.append(model.mtp.layers[0].mlp)
    return mods


def _set_linear(lin: Linear, q: torch.Tensor, s: torch.Tensor) -> None:
    lin.weight = nn.Parameter(q, requires_grad=False)
    lin.weight_scale_inv = s


def _set_experts(moe: SparseMoE, gu: tuple[torch.Tensor, ...], dn: tuple[torch.Tensor, ...]) -> None:
    moe.w_gate_up = nn.Parameter(gu[0], requires_grad=False)
    moe.w_down = nn.Parameter(dn[0], requires_grad=False)
    moe.w_gate_up_scale, moe.w_down_scale = gu[1], dn[1]


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, expert_chunk: int = 16, lm_head: bool = False) -> int:
    """Converts the model's FP8-eligible weights in place, layer by layer, dropping each BF16 tensor
    once its FP8 copy exists (peak extra memory: one fp32 chunk of experts). Idempotent: tensors
    already in e4m3 are left alone. lm_head (EngineConfig.fp8_lm_head): the untied lm_head
    too, beyond the published checkpoint's layout (half its bytes per decode step). Returns how many
    tensors were converted."""
    n = 0
    head = getattr(model, "lm_head", None)
    if lm_head and head is not None and not model.cfg.tie_word_embeddings and head.weight_scale_inv is None:
        _set_linear(head, *quantize_fp8_block(head.weight.data))
        n += 1
    for _, lin in fp8_linears(model):
        if lin.weight_scale_inv is None:
            _set_linear(lin, *quantize_fp8_block(lin.weight.data))
            n += 1
    for moe in fp8_moes(model):
        if moe.w_gate_up_scale is None:
            gu = _quantize_chunked(moe.w_gate_up.data, expert_chunk)
            moe.w_gate_up = nn.Parameter(gu[0], requires_grad=False)
            moe.w_gate_up_scale = gu[1]
            dn = _quantize_chunked(moe.w_down.data, expert_chunk)
            moe.w_down = nn.Parameter(dn[0], requires_grad=False)
            moe.w_down_scale = dn[1]
            n += 2
        if moe.w_gate_up.is_cuda:
            torch.cuda.empty_cache()
    return n


# ---- FP8 checkpoints -----------------------------------------------------------------------------
def prepare_fp8_storage(model: nn.Module) -> None:
    """Replaces every FP8-eligible weight by uninitialised e4m3 storage + fp32 scales (freeing the
    BF16 tensors), ready for `Fp8CheckpointLoader`. Call before loading an FP8 checkpoint; on a model
    on the meta device nothing is allocated (then `Module.to_empty` and `scales_to`)."""
    for _, lin in fp8_linears(model):
        (N, K), dev = lin.weight.shape, lin.weight.device
        s = torch.empty(_cdiv(N, BLOCK), _cdiv(K, BLOCK), dtype=torch.float32, device=dev)
        _set_linear(lin, torch.empty(N, K, dtype=torch.float8_e4m3fn, device=dev), s)
    for moe in fp8_moes(model):
        pairs = []
        for w in (moe.w_gate_up, moe.w_down):
            E, N, K = w.shape
            pairs.append(
                (
                    torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                    torch.empty(E, _cdiv(N, BLOCK), _cdiv(K, BLOCK), dtype=torch.float32, device=w.device),
                )
            )
        _set_experts(moe, pairs[0], pairs[1])


def scales_to(model: nn.Module, device: torch.device | str) -> None:
    """Uninitialised fp32 scales on `device` for every FP8 weight: the scales are plain attributes,
    which `Module.to_empty` does not move (after `prepare_fp8_storage` on the meta device)."""
    for _, lin in fp8_linears(model):
        if lin.weight_scale_inv is not None:
            lin.weight_scale_inv = torch.empty_like(lin.weight_scale_inv, device=device)
    for moe in fp8_moes(model):
        if moe.w_gate_up_scale is not None:
            moe.w_gate_up_scale = torch.empty_like(moe.w_gate_up_scale, device=device)
            moe.w_down_scale = torch.empty_like(moe.w_down_scale, device=device)


@dataclass
class _Dest:
    """Where one checkpoint tensor lands: rows [row, row+rows) of an FP8 matrix ([R, C], or
    [E, R, C] for a fused expert tensor) and of its scales."""

    weight: torch.Tensor  # [..., R, C] e4m3
    scale: torch.Tensor  # [..., ceil(R/128), ceil(C/128)] fp32
    row: int
    rows: int

    def direct(self) -> bool:
        """The checkpoint's own 128-blocks coincide with the engine's: e4m3 + scales copy as is."""
        R = self.weight.shape[-2]
        return self.row % BLOCK == 0 and (self.rows % BLOCK == 0 or self.row + self.rows == R)

    def weight_rows(self) -> torch.Tensor:
        return self.weight[..., self.row : self.row + self.rows, :]

    def scale_rows(self) -> torch.Tensor:
        return self.scale[..., self.row // BLOCK : _cdiv(self.row + self.rows, BLOCK), :]


class Fp8CheckpointLoader:
    """Places FP8 checkpoint tensors (`X.weight` e4m3 + `X.weight_scale_inv`; fused experts
    `experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`) into a model made ready by
    `prepare_fp8_storage`. Parts whose 128-row blocks match the engine's are copied bit for bit;
    BF16 tensors are quantised on arrival; parts that share an engine block with another part
    (in_proj_b|a, or anything not 128-row aligned) are staged in fp32 and quantised per engine
    block by `finish()`.

    In the loader: `if fp8.load_tensor(name, tensor): continue` for every canonical name, then
    `fp8.finish()`; names it declines (BF16 parameters) go through the normal path. `views`: every
    canonical checkpoint name (fused and per-expert expert keys) -> its view of the engine's storage
    (`weights.param_targets` and `weights._per_expert_targets`, `Target.view`)."""

    def __init__(self, model: nn.Module, views: dict[str, torch.Tensor]) -> None:
        owners = [(lin.weight.data, lin.weight_scale_inv) for _, lin in fp8_linears(model)]
        for moe in fp8_moes(model):
            owners += [(moe.w_gate_up.data, moe.w_gate_up_scale), (moe.w_down.data, moe.w_down_scale)]
        assert all(w.dtype == torch.float8_e4m3fn for w, _ in owners), "call prepare_fp8_storage first"
        owners.sort(key=lambda o: o[0].data_ptr())
        starts = [w.data_ptr() for w, _ in owners]
        self.dests: dict[str, _Dest] = {}
        for name, view in views.items():
            dest = _locate(view, owners, starts)
            if dest is not None:
                self.dests[name.removesuffix(".weight")] = dest
        # base -> the parts (weight / scale) seen so far: the tensors where they are needed later
        # (staged destinations), else None (already copied: no host copy is kept)
        self._pending: dict[str, dict[str, torch.Tensor | None]] = {}
        self._filled: set[str] = set()
        self._staged: dict[tuple[int, tuple[int, ...]], list[tuple[_Dest, torch.Tensor]]] = {}

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        for suffix, kind in ((".weight_scale_inv", "scale"), ("_scale_inv", "scale"), (".weight", "weight")):
            if name.endswith(suffix):
                return name[: -len(suffix)], kind
        return name, "weight"

    def owns(self, name: str) -> bool:
        """Whether the canonical checkpoint name (weight or scale) has an FP8 destination."""
        return self._split(name)[0] in self.dests

    @staticmethod
    def _check(name: str, t: torch.Tensor, kind: str, dest: _Dest) -> None:
        """The checkpoint tensor's dtype and shape against its destination's (ValueError naming it)."""
        want = tuple(dest.weight_rows().shape)
        if kind == "scale":
            want = (*want[:-2], _cdiv(dest.rows, BLOCK), _cdiv(want[-1], BLOCK))
            if not t.dtype.is_floating_point or t.element_size() < 2:
                raise ValueError(f"{name}: scales in {t.dtype}; expected float32, bfloat16 or float16")
        elif t.dtype != torch.float8_e4m3fn and (not t.dtype.is_floating_point or t.element_size() < 2):
            raise ValueError(f"{name}: weights in {t.dtype}; expected float8_e4m3fn or a float type")
        if tuple(t.shape) != want:
            what = f"one scale per {BLOCK} x {BLOCK} block of {tuple(dest.weight_rows().shape)}"
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != expected {want}"
                             + (f" ({what})" if kind == "scale" else ""))

    @torch.no_grad()
    def load_tensor(self, name: str, t: torch.Tensor) -> bool:
        """Consumes one canonical-named checkpoint tensor; False if it has no FP8 destination.
        Scales may be BF16 / FP16 (widened to float32 exactly); a misshapen tensor is a ValueError."""
        base, kind = self._split(name)
        dest = self.dests.get(base)
        if dest is None:
            return False
        self._check(name, t, kind, dest)
        if kind == "weight" and t.dtype != torch.float8_e4m3fn:  # BF16 in the checkpoint
            t = t.to(dest.weight.device).reshape(dest.weight_rows().shape)
            if dest.direct():
                q, sc = _quantize_chunked(t, 16)
                dest.weight_rows().copy_(q)
                dest.scale_rows().copy_(sc)
            else:
                self._stage(dest, t.float())
            self._filled.add(base)
            return True
        got = self._pending.setdefault(base, {})
        if dest.direct():
            target = dest.weight_rows() if kind == "weight" else dest.scale_rows()
            target.copy_(t.reshape(target.shape))
            got[kind] = None
        else:
            got[kind] = t
        if not dest.direct() and len(got) == 2:
            from metainfer.kernels.ops import ref_dequant_fp8

            self._stage(dest, ref_dequant_fp8(got["weight"], got["scale"], torch.float32))
        if len(got) == 2:
            self._filled.add(base)
            del self._pending[base]
        return True

    def _uncovered(self, names: set[str]) -> list[str]:
        """Those of `names` whose bytes no filled name covered (fused vs per-expert expert keys)."""
        spans = sorted(_span(self.dests[n]) for n in self._filled)
        starts = [a for a, _ in spans]
        out = []
        for n in names:
            lo, hi = _span(self.dests[n])
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while i < len(spans) and spans[i][0] <= lo < hi:
                lo = max(lo, spans[i][1])
                i += 1
            if lo < hi:
                out.append(n)
        return sorted(out)

    def _stage(self, dest: _Dest, t: torch.Tensor) -> None:
        key = (dest.weight.data_ptr(), tuple(dest.weight.shape))
        self._staged.setdefault(key, []).append((dest, t.reshape(dest.weight_rows().shape)))

    @torch.no_grad()
    def finish(self) -> None:
        """Quantises the staged rows per engine 128-row block; errors on incomplete tensors."""
        if self._pending:
            lacks = [f"{b} ({'weight_scale_inv' if 'weight' in g else 'weight'})"
                     for b, g in sorted(self._pending.items())]
            raise ValueError(f"{len(lacks)} FP8 tensors lack their weight or weight_scale_inv in the "
                             f"checkpoint: {', '.join(lacks[:3])}{', ...' if len(lacks) > 3 else ''}")
        missing = self._uncovered(set(self.dests) - self._filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} FP8 tensors, e.g. {missing[:5]}")
        for parts in self._staged.values():
            w, s = parts[0][0].weight, parts[0][0].scale
            lo = min(d.row for d, _ in parts) // BLOCK * BLOCK
            hi = min(_cdiv(max(d.row + d.rows for d, _ in parts), BLOCK) * BLOCK, w.shape[-2])
            rows = torch.full((*w.shape[:-2], hi - lo, w.shape[-1]), float("nan"), device=w.device)
            for d, t in parts:
                rows[..., d.row - lo : d.row - lo + d.rows, :] = t.to(rows.device)
            if rows.isnan().any():
                raise ValueError("an FP8 row block mixes staged and bit-copied parts")
            q, sc = quantize_fp8_block(rows)
            w[..., lo:hi, :] = q
            s[..., lo // BLOCK : _cdiv(hi, BLOCK), :] = sc
        self._staged.clear()


def _span(dest: _Dest) -> tuple[int, int]:
    """[first, last+1) byte addresses of the destination rows (contiguous for every _Dest)."""
    rows = dest.weight_rows()
    return rows.data_ptr(), rows.data_ptr() + rows.numel()


def _locate(view: torch.Tensor, owners: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int]
            ) -> _Dest | None:
    """The FP8 matrix whose storage holds `view` (a Target view of the engine's parameters); owners
    sorted by address, `starts` their addresses (storages never overlap: one candidate)."""
    if view.dtype != torch.float8_e4m3fn:
        return None
    i = bisect.bisect_right(starts, view.data_ptr()) - 1
    for w, s in owners[max(i, 0) : i + 1]:
        off = view.data_ptr() - w.data_ptr()  # bytes == elements for e4m3
        if not 0 <= off < w.numel():
            continue
        R, C = w.shape[-2:]
        if w.dim() == 2:
            return _Dest(w, s, off // C, view.shape[0])
        if view.dim() == 3:  # whole experts [e0, e0 + n) of the fused [E(+1), R, C] tensor
            e0, n = off // (R * C), view.shape[0]
            return _Dest(w[e0 : e0 + n], s[e0 : e0 + n], 0, R)
        e, r = divmod(off // C, R)
        return _Dest(w[e], s[e], r, view.shape[0])
    return None
