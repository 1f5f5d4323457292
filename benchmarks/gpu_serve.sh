#!/usr/bin/env bash
# On the H200: `metainfer serve` (full config, dummy weights) measured by `metainfer bench serve`
# with the anchors' workloads (1k-token random prompts, greedy, ignore_eos): c=1 decode, idle TTFT,
# c=32 throughput (make the report locally: metainfer bench report).
#   DTYPE=fp8|bfloat16 VERDICT=path MORE_CONCS="8 16 64" SERVE_ARGS="--ssm-state-dtype bfloat16" TAG=ssm16 \
#     POISSON_RATE=3 SUSTAINED=256 bash benchmarks/gpu_serve.sh
# (TAG names the JSON files: serve_${DTYPE}${TAG}_c32.json; POISSON_RATE adds SUSTAINED requests arriving at that rate)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DT=${DTYPE:-fp8}
TG=$DT${TAG:-}
CFG=metainfer/configs/qwen3.6-35b-a3b.json
# SWITCH_INTERVAL: the server process's GIL switch interval (sys.setswitchinterval; Python's default 5 ms), an A/B
SERVE=(python -m metainfer.cli)
[[ -n ${SWITCH_INTERVAL:-} ]] && SERVE=(python -c "import sys; sys.setswitchinterval($SWITCH_INTERVAL); \
from metainfer.cli import main; sys.exit(main(sys.argv[1:]))")
"${SERVE[@]}" serve --model dummy:$CFG --dtype $DT --device cuda --port 8000 --max-num-seqs 64 \
  --max-model-len 4096 --served-model-name qwen3.6-35b-a3b ${SERVE_ARGS:-} > $OUT/server_$TG.log 2>&1 &
SERVER=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
curl -sf http://127.0.0.1:8000/health || { tail -30 $OUT/server_$TG.log; exit 1; }
B="python -m metainfer.cli bench serve --base-url http://127.0.0.1:8000 --model qwen3.6-35b-a3b --dataset random \
   --input-len 1024 --ignore-eos --seed 0 --label metainfer-$TG --dtype $DT ${VERDICT:+--verdict $VERDICT}"
$B --output-len 1024 --num-prompts 3 --max-concurrency 1 --warmup 1 --json $OUT/serve_${TG}_c1.json 2>&1 | tail -22
$B --output-len 1 --num-prompts 7 --max-concurrency 1 --warmup 1 --json $OUT/serve_${TG}_ttft.json 2>&1 | grep -iE "ttft|fail"
$B --output-len 1024 --num-prompts 32 --max-concurrency 32 --warmup 0 --json $OUT/serve_${TG}_c32.json 2>&1 | tail -22
if [[ -n ${POISSON_RATE:-} ]]; then  # arrivals at POISSON_RATE a second (~32 in flight at 3/s), SUSTAINED (256) requests
  $B --output-len 1024 --num-prompts ${SUSTAINED:-256} --request-rate $POISSON_RATE --warmup 0 \
    --json $OUT/serve_${TG}_poisson.json 2>&1 | grep -E "Failed|throughput|TTFT|TPOT|ITL" | sed "s/^/[poisson] /"
fi
for c in ${MORE_CONCS:-}; do  # e.g. MORE_CONCS="8 16 64": the anchors' other FP8 concurrencies (c prompts at once)
  $B --output-len 1024 --num-prompts $c --max-concurrency $c --warmup 0 --json $OUT/serve_${TG}_c$c.json 2>&1 \
    | grep -E "Failed|Output token throughput|Mean TTFT|Mean TPOT" | sed "s/^/[c=$c] /"
done
kill -TERM $SERVER; wait $SERVER
grep -E "warmup|slow step launch" $OUT/server_$TG.log | cut -c1-220 | head -20
