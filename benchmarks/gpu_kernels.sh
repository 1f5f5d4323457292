#!/usr/bin/env bash
# On the H200: kernel correctness tests at full shapes, then kernel microbenchmarks.
#   bash benchmarks/gpu_kernels.sh   (OUT must be set; wheels in .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
timeout 200 python -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -25
timeout 150 python benchmarks/kernels_a.py --out $OUT 2>&1 | tee $OUT/kernels_a.log | tail -40
timeout 170 python benchmarks/kernels_b.py --out $OUT 2>&1 | tee $OUT/kernels_b.log | tail -60
