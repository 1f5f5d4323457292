#!/usr/bin/env bash
# The oracle on the H200: `metainfer verify --suite full` on the full Qwen3.6-35B-A3B config (dummy
# weights) for each precision of $PRECISIONS (default "fp8 bfloat16"), verdict JSON and log under $OUT,
# then one summary line per precision (checks failed, noise ratios, worst layer, coverage, timing).
#   PRECISIONS="fp8" bash benchmarks/gpu_oracle.sh          # OUT defaults to out/oracle
#   HALF=1 SUITE=quick bash benchmarks/gpu_oracle.sh        # a 20-layer full-width config: fits an H100
set -u
OUT=${OUT:-out/oracle}
MODEL=${MODEL:-dummy:metainfer/configs/qwen3.6-35b-a3b.json}
if [[ -n ${HALF:-} ]]; then  # HALF=1: the first 20 of the 40 layers at full width (engine + reference fit an H100)
  python - <<'EOF2'
import json
c = json.load(open("metainfer/configs/qwen3.6-35b-a3b.json"))
t = c["text_config"]
t["num_hidden_layers"], t["layer_types"] = 20, t["layer_types"][:20]
json.dump(c, open("/tmp/half.json", "w"))
EOF2
  MODEL=dummy:/tmp/half.json
fi
LIMIT=${LIMIT:-280}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for dt in ${PRECISIONS:-fp8 bfloat16}; do
  timeout "$LIMIT" python -m metainfer.cli verify --model "$MODEL" --dtype "$dt" --device cuda --suite ${SUITE:-full} \
    --json "$OUT/verify_$dt.json" 2>&1 | grep -v "falling back" > "$OUT/verify_$dt.log"
  echo "[$dt] exit ${PIPESTATUS[0]}"
  tail -n 60 "$OUT/verify_$dt.log" | grep -E "FAIL|Traceback|Error|error:" | head -20
  python - "$OUT/verify_$dt.json" "$dt" <<'EOF'
import json, sys
try:
    v = json.load(open(sys.argv[1]))
except Exception as e:  # the run died before writing its verdict
    print(f"[{sys.argv[2]}] no verdict: {e}"); sys.exit(0)
f = v["figures"]
n = lambda p: f.get(p, {}).get("noise", {})
lay = f.get("layers", {})
print(f"[{sys.argv[2]}] passed={v['passed']} failed={v['failed']}")
print(f"  noise ratios prefill {n('prefill').get('rel_rmse_ratio')} / {n('prefill').get('kl_mean_ratio')}, "
      f"decode {n('decode').get('rel_rmse_ratio')} / {n('decode').get('kl_mean_ratio')}")
print(f"  layers ratio max {max(lay.get('ratio') or [0]):.3f} first over {lay.get('first_layer_over')}")
print(f"  coverage {f.get('coverage')}")
print(f"  noise gates {f.get('noise_gates')}  weights {f.get('weights', {}).get('mode')}")
print(f"  timing {v.get('timing')}")
EOF
done
