"""The batch-1 decode step as one persistent CUDA kernel (benchmarks/MEGAKERNEL.md): `mega.cu` (the
kernel), `program` (instructions, their checks, packing and float64 reference), `launch` (nvcc build
and driver-API launch). v0 runs chained GEMV instructions; it is not wired into the engine."""
