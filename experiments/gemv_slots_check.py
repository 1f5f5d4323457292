"""cuda/gemv.cu's outputs do not depend on its ring's slot count (METAINFER_WGMMA_GEMV_SLOTS): run once per
count in fresh processes, each saving the attention-qkv-shaped projection, the in_proj with its conv epilogue
and the updated conv state; --compare checks that the saved files are bit-identical.

    METAINFER_WGMMA_GEMV_CONV=1 METAINFER_WGMMA_GEMV_SLOTS=6 python experiments/gemv_slots_check.py $OUT/y6.pt
    python experiments/gemv_slots_check.py --compare $OUT/y6.pt $OUT/y4.pt
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    if sys.argv[1] == "--compare":
        ref = torch.load(sys.argv[2])
        for f in sys.argv[3:]:
            same = all(torch.equal(a, b) for a, b in zip(ref, torch.load(f), strict=True))
            print(f"{f}: {'bit-identical to' if same else 'DIFFERS from'} {sys.argv[2]}")
        return
    from metainfer.kernels import fp8_linear
    from metainfer.kernels.cuda import gemv
    from metainfer.model.fp8 import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(0)
    w, s = quantize_fp8_block(torch.randn(12352, 2048, generator=g, device="cuda") * 0.05)
    x = torch.randn(1, 2048, generator=g, device="cuda").to(torch.bfloat16)
    cw = (torch.randn(8192, 4, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    state = torch.randn(4, 3, 8192, generator=g, device="cuda").to(torch.bfloat16)
    wq, sq = w[:9216].contiguous(), s[:72].contiguous()
    assert gemv.wanted(x, wq, sq) and gemv.wanted_conv(x, w, s, cw, state, torch.zeros(1, dtype=torch.int64))
    y1 = fp8_linear.fp8_linear(x, wq, sq)
    y2 = fp8_linear.linear_conv_update(x, w, s, cw, state, torch.tensor([2], device="cuda"),
                                          torch.tensor([True], device="cuda"))
    torch.save((y1.cpu(), y2.cpu(), state.cpu()), sys.argv[1])


if __name__ == "__main__":
    main()
