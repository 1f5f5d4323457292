#!/usr/bin/env bash
# On the H200: batch-1 decode A/B of programmatic dependent launch (METAINFER_PDL=0 vs 1). Figures
# only; the verdicts come from gpu_final.sh on the same build.
#   DTYPES="fp8 bfloat16" bash benchmarks/gpu_pdl_ab.sh      (OUT set; wheels carried in .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for dt in ${DTYPES:-fp8}; do
  for mode in ${MODES:-0 1}; do
    METAINFER_PDL=$mode timeout ${T_DECODE:-90} python benchmarks/decode_bench.py --dtype $dt --batches ${BATCHES:-1} \
      --gen 32 --out $OUT/pdl_$mode 2>&1 | grep -v "falling back" | grep -E "^\|" | sed "s/^/[$dt PDL=$mode] /"
  done
done
