#!/usr/bin/env bash
# On the H200: GPU tests, MoE tile sweep at decode sizes, decode benchmark (BF16 and FP8).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 170 python -m pytest -q tests/gpu -p no:cacheprovider -x 2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 160 python benchmarks/kernels_b.py --ops moe --tokens 1,32 --sweep --out $OUT 2>&1 | grep -E "best|moe_" | tee $OUT/moe_sweep.log
timeout 110 python benchmarks/decode_bench.py --dtype bfloat16 --batches 1,32,64 --gen 32 --out $OUT 2>&1 | grep -v "falling back" | tail -22
timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1,32,64 --gen 32 --no-profile --out $OUT 2>&1 | grep -v "falling back" | tail -6
