"""The default path's own CUDA (built with nvcc, launched through the driver API): `gemv.cu` / `gemv`, one
decode token's FP8 projections on wgmma (the attention qkv, the DeltaNet in_proj with its conv epilogue, the
input norm as their x prologue, the experts' gate/up; KB-0094), `launch` (its nvcc build and driver calls),
`gemv_timeline` (its timeline build's records). The headers `mega_base.cuh`, `mega_math.cuh` and `ptx.cuh`
(namespace `mega`) are the persistent megakernel's that gemv.cu was cut from; the megakernel itself left the
product (its code: commit b4eb65f, metainfer/kernels/mega/; docs/megakernel.md)."""
