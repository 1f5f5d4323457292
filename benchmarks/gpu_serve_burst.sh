#!/usr/bin/env bash
# On the H200, the shortest check of the c=32 burst's step launches: `metainfer serve` (FP8, the
# full config, dummy weights, as gpu_serve.sh) and one c=32 burst of 1k prompts / 256 outputs, then the
# server's warmup line and any "slow step launch" notes (the kernels compiled in them). ~1 min.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python -m metainfer.cli serve --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda \
  --port 8000 --max-num-seqs 64 --max-model-len 4096 --served-model-name qwen3.6-35b-a3b > $OUT/server_burst.log 2>&1 &
SERVER=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
python -m metainfer.cli bench serve --base-url http://127.0.0.1:8000 --model qwen3.6-35b-a3b --dataset random \
  --input-len 1024 --ignore-eos --seed 0 --label metainfer-burst --dtype fp8 --output-len ${OUTPUT_LEN:-256} \
  --num-prompts 32 --max-concurrency 32 --warmup 0 --json $OUT/serve_burst_c32.json 2>&1 \
  | grep -E "Failed|Output token throughput|Mean TTFT|P90 TTFT|Mean TPOT"
kill -TERM $SERVER; wait $SERVER
grep -E "warmup|slow step launch" $OUT/server_burst.log | cut -c1-300
