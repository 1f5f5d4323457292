#!/usr/bin/env bash
# On the H200, one build: decode-kernel tile search (FMA vs tensor-core variants), then the oracle and
# the batch-1 decode benchmark on the winners (no figure counts without the verdict on the same build).
#   bash benchmarks/gpu_sweep.sh        (OUT set; wheels carried in .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CFG=metainfer/configs/qwen3.6-35b-a3b.json
timeout ${T_SWEEP:-300} python benchmarks/sweep_decode_kernels.py ${SWEEP_ARGS:-} --out $OUT > $OUT/sweep.log 2>&1
grep -E "skip" $OUT/sweep.log | head -3; grep -A12 '^op ' $OUT/sweep.log
export METAINFER_FP8_TUNED=$OUT/fp8_skinny_tuned.json METAINFER_MOE_TUNED=$OUT/moe_pair_tuned.json
for dt in ${DTYPES:-fp8 bfloat16}; do
  [[ " ${VERIFY:-fp8 bfloat16} " == *" $dt "* ]] && timeout ${T_VERIFY:-150} python -m metainfer.cli verify --model dummy:$CFG --dtype $dt --device cuda --suite full \
    --json $OUT/verify_$dt.json 2>&1 | grep -v "falling back" | tail -3
  timeout ${T_DECODE:-100} python benchmarks/decode_bench.py --dtype $dt --batches ${BATCHES:-1} --gen 32 \
    --out $OUT 2>&1 | grep -v "falling back" | tail -14
done
