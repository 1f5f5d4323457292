"""The reference's weights from an FP8 checkpoint, read by the oracle itself (not the engine's loader).

Every e4m3 `X.weight` is dequantised with its `X.weight_scale_inv` as the format defines it
(W = weight * weight_scale_inv, one float32 scale per 128 x 128 block, edge blocks smaller) in
float32, then rounded to the reference's dtype; the per-expert projections
(`mlp.experts.{e}.gate_proj/up_proj/down_proj`) are stacked into transformers' fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); unquantised tensors are
taken as they are. Names are transformers' (`model.language_model.` read as `model.`); the vision
tower and the MTP layer are left out (the reference has neither).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK = 128
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _name(key: str) -> str | None:
    if key.startswith(("model.visual.", "visual.", "mtp.")) or "rotary_emb" in key:
        return None
    return "model." + key[len("model.language_model.") :] if key.startswith("model.language_model.") else key


def dequantise(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """[N, K] e4m3 and [ceil(N/128), ceil(K/128)] scales -> [N, K] float32."""
    n, k = w.shape
    pn, pk = -n % BLOCK, -k % BLOCK
    x = F.pad(w.float(), (0, pk, 0, pn)).view((n + pn) // BLOCK, BLOCK, (k + pk) // BLOCK, BLOCK)
    return (x * scale_inv.float()[:, None, :, None]).view(n + pn, k + pk)[:n, :k]


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update(dict.fromkeys(sf.keys(), f.name))
    return out


def reference_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of the dequantised reference weights in `dtype` (the text model's tensors, no scales)."""
    from safetensors import safe_open

    total, size = 0, torch.empty((), dtype=dtype).element_size()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if _name(key) is not None and not key.endswith("scale_inv"):
                    total += size * int(torch.Size(sf.get_slice(key).get_shape()).numel())
    return total


@torch.no_grad()  # not inference mode: the tensors become the reference model's parameters
def dequantised_weights(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    num_experts: int,
    on_e4m3: Callable[[str, torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Transformers-named weights of the FP8 checkpoint in `model_dir` on `device` in `dtype`.
    on_e4m3(name, tensor): each stored e4m3 tensor under the name it takes here (the per-expert
    ones stacked, once a layer's experts are complete), before it is dropped."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    wmap = _weight_map(model_dir)
    out: dict[str, torch.Tensor] = {}
    raw: dict[str, torch.Tensor] = {}  # stacked e4m3 experts still being filled
    count: dict[str, int] = {}
    with ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(str(model_dir / f), framework="pt"))
                 for f in sorted(set(wmap.values()))}
        for key, fname in wmap.items():
            name = _name(key)
            if name is None or key.endswith("scale_inv"):
                continue
            t = files[fname].get_tensor(key).to(device)
            stored = t
            if t.dtype == torch.float8_e4m3fn:
                skey = key.removesuffix(".weight") + ".weight_scale_inv"
                if skey not in wmap:
                    raise ValueError(f"reference: {key} is e4m3 but the checkpoint has no {skey}")
                t = dequantise(t, files[wmap[skey]].get_tensor(skey).to(device))
            m = _EXPERT.match(name)
            if m is None:
                out[name] = t.to(dtype)
                if stored.dtype == torch.float8_e4m3fn and on_e4m3 is not None:
                    on_e4m3(name, stored)
                continue
            base, e, part = m.group(1), int(m.group(2)), m.group(3)
            fused = f"{base}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            rows = t.shape[0]
            if fused not in out:
                n = rows if part == "down_proj" else 2 * rows
                out[fused] = torch.empty(num_experts, n, t.shape[1], dtype=dtype, device=device)
                raw[fused] = torch.empty(num_experts, n, t.shape[1], dtype=stored.dtype, device=device)
            lo = rows if part == "up_proj" else 0
            out[fused][e, lo : lo + rows] = t.to(dtype)
            raw[fused][e, lo : lo + rows] = stored
            count[fused] = count.get(fused, 0) + 1
            if count[fused] == num_experts * (1 if part == "down_proj" else 2):
                done = raw.pop(fused)
                if done.dtype == torch.float8_e4m3fn and on_e4m3 is not None:
                    on_e4m3(fused, done)
    if raw:
        raise ValueError(f"reference: incomplete experts in the checkpoint: {sorted(raw)[:3]}")
    return out
