#!/usr/bin/env bash
# On the H200, one build: tune the FP8 decode linear's tiles, then judge and time the engine with them
# (the oracle runs on the tuned build before any figure counts).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CFG=metainfer/configs/qwen3.6-35b-a3b.json
timeout 170 python benchmarks/tune_fp8_skinny.py --tokens 1 --out $OUT 2>&1 | grep -v skip | tail -5
export METAINFER_FP8_TUNED=$OUT/fp8_skinny_tuned.json
timeout 120 python -m metainfer.cli verify --model dummy:$CFG --dtype fp8 --device cuda --suite full \
  --json $OUT/verify_fp8_tuned.json 2>&1 | grep -v "falling back" | tail -4
timeout 140 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,32,64,128 --gen 32 --out $OUT 2>&1 \
  | grep -v "falling back" | grep -E "^\||TTFT|skinny"
