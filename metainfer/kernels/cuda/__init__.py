"""The default path's own CUDA (built with nvcc, launched through the driver API): `gemv.cu` / `gemv`, one
decode token's FP8 projections on wgmma (the attention qkv, the DeltaNet in_proj with its conv epilogue, the
input norm as their x prologue, the experts' gate/up), `launch` (its nvcc build and driver calls),
`gemv_timeline` (its timeline build's records). gemv.cu's parts: `gemv_math.cuh` (the CTA's warps, the
reductions, x's layout, the wgmma dot), `gemv_args.cuh`, `gemv_io.cuh`, `gemv_sync.cuh`, `gemv_timeline.cuh`,
and `ptx.cuh` (PTX wrappers)."""
