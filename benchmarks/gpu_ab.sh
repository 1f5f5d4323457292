#!/usr/bin/env bash
# On the H200: batch-1 decode (and idle 1k-prompt TTFT) A/B of one setting (its environment variable,
# declared in metainfer/settings.py), each mode in a fresh process on the same build. Figures only; the verdicts come from gpu_final.sh.
#   VAR=METAINFER_PDL MODES="0 1" DTYPES="fp8 bfloat16" bash benchmarks/gpu_ab.sh   (OUT set; .whl carried)
#   GEN (decode steps, 32), EXTRA (more decode_bench flags, e.g. --no-profile); a mode repeated in MODES
#   runs again in a fresh process (its folder keeps the last run)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
VAR=${VAR:-METAINFER_PDL}
for dt in ${DTYPES:-fp8}; do
  for mode in ${MODES:-0 1}; do
    env $VAR=$mode timeout ${T_DECODE:-90} python benchmarks/decode_bench.py --dtype $dt --batches ${BATCHES:-1} \
      --gen ${GEN:-32} ${EXTRA:-} --out $OUT/ab_${VAR}_$mode 2>&1 | grep -v "falling back" | grep -E "^\||TTFT|^prefill" | sed "s/^/[$dt $VAR=$mode] /"
  done
done
