"""kernels.decode_io (the decode graph's inputs and greedy tokens) vs the references, in the Triton
interpreter on the CPU (tests/gpu/test_kernels_b_gpu.py runs them on the device at the model's vocab).
Both are exact: integer moves, and an argmax (no tolerance)."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import decode_io
from metainfer.kernels import reference as ref


def _packed(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 5000, (7, width), generator=g, dtype=torch.int64)
    tok_buf = torch.randint(0, 250_000, (width + 3,), generator=g, dtype=torch.int64)
    src = torch.randint(-1, width + 3, (width,), generator=g, dtype=torch.int64)
    src[0] = -1
    if n > 1:
        src[1] = width + 2  # the buffer's last row
    packed[6] = src
    return packed, tok_buf


@pytest.mark.parametrize("n,width", [(1, 1), (3, 8), (37, 40), (0, 4)])
def test_decode_inputs_matches_reference(n, width):
    packed, tok_buf = _packed(n, width, seed=n * 7 + width)
    want, got = packed.clone(), packed.clone()
    ctx_w, seq_w = torch.full((width,), -9, dtype=torch.int32), torch.full((width,), -9, dtype=torch.int32)
    ctx_g, seq_g = ctx_w.clone(), seq_w.clone()
    ref.decode_inputs(want, tok_buf, n, ctx_w, seq_w)
    decode_io.decode_inputs(got, tok_buf, n, ctx_g, seq_g)
    assert torch.equal(got, want) and torch.equal(ctx_g, ctx_w) and torch.equal(seq_g, seq_w)
    if n:
        pend = packed[6, :n] >= 0
        assert torch.equal(got[0, :n][pend], tok_buf[packed[6, :n][pend]])  # pending rows took the buffer's
        assert torch.equal(got[0, :n][~pend], packed[0, :n][~pend])
        assert torch.equal(got[0, n:], packed[0, n:]) and (ctx_g[n:] == -9).all()  # past n: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(1, 5000), (3, 2049), (2, 2048), (4, 77)])
def test_argmax_rows_matches_torch(R, V, dtype):
    g = torch.Generator().manual_seed(R * V)
    x = torch.randn(R, V, generator=g).to(dtype)
    x[0, V // 3] = x[0, V - 1] = 9.0  # a tie across chunks: the lower index
    if R > 1:
        x[1] = float("-inf")  # all -inf: index 0
    if R > 2:
        x[2, V - 5] = float("nan")  # NaN outranks everything (torch's rule)
        x[2, 7] = float("inf")
    out = torch.full((R + 2,), -1, dtype=torch.int64)
    decode_io.argmax_rows(x, out)
    assert torch.equal(out[:R], x.float().argmax(dim=-1)) and (out[R:] == -1).all()
    assert out[0] == V // 3


def test_argmax_rows_first_nan_of_several_chunks():
    x = torch.zeros(1, 3 * decode_io.CHUNK + 5)
    x[0, 2 * decode_io.CHUNK + 1] = float("nan")
    x[0, decode_io.CHUNK + 9] = float("nan")
    x[0, 3] = float("inf")
    out = torch.empty(1, dtype=torch.int64)
    assert decode_io.argmax_rows(x, out).item() == decode_io.CHUNK + 9 == x.argmax().item()


def test_argmax_rows_strided_rows():
    """Rows of a wider buffer (the graph's logits slice [:bs] of its padded rows, or a view)."""
    x = torch.randn(3, 4100)[:, :3000]
    out = torch.empty(3, dtype=torch.int64)
    assert torch.equal(decode_io.argmax_rows(x, out), x.argmax(dim=-1))
