#!/usr/bin/env bash
# On the H200, one build: GPU tests, oracle verdicts (BF16, FP8) on the full config, decode benchmark,
# and the programmatic-dependent-launch A/B (batch-1 decode with METAINFER_PDL=0).
#   PHASES="tests verify decode pdl_ab" DTYPES="bfloat16 fp8" bash benchmarks/gpu_final.sh
#   (OUT set; wheels carried in .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
has() { [[ " $PHASES " == *" $1 "* ]]; }  # a phase named exactly (not a substring of another)
CFG=metainfer/configs/qwen3.6-35b-a3b.json
PHASES=${PHASES:-tests verify decode}
if has tests; then
  timeout ${T_TESTS:-420} python -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -8
fi
if has verify; then
  for dt in ${DTYPES:-bfloat16 fp8}; do
    timeout ${T_VERIFY:-200} python -m metainfer.cli verify --model dummy:$CFG --dtype $dt --device cuda --suite full \
      --json $OUT/verify_$dt.json 2>&1 | grep -v "falling back" | tee $OUT/verify_$dt.log | tail -32
  done
fi
if has decode; then
  for dt in ${DTYPES:-bfloat16 fp8}; do
    timeout ${T_DECODE:-130} python benchmarks/decode_bench.py --dtype $dt --batches 1,8,32,64,128 --gen 32 --sync-too \
      --out $OUT 2>&1 | grep -v "falling back" | tail -16
  done
fi
if has pdl_ab; then
  for dt in ${DTYPES:-bfloat16 fp8}; do
    METAINFER_PDL=0 timeout ${T_DECODE:-130} python benchmarks/decode_bench.py --dtype $dt --batches 1 --gen 32 \
      --out $OUT/pdl_off 2>&1 | grep -v "falling back" | grep -E "^\|" | tail -3
  done
fi
