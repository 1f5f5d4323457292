"""The batch-1 decode step as one persistent CUDA kernel (docs/megakernel.md): `mega.cu` (the
kernel), `program` (instructions, their checks, packing and float64 reference), `launch` (nvcc build
and driver-API launch); the engine runs it with `--megakernel`. `gemv.cu` / `gemv` put its FP8 wgmma
consumers in a kernel of their own that the default decode path uses for one token's projections (KB-0094)."""
