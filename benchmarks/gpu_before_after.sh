#!/usr/bin/env bash
# Two builds side by side on one GPU: decode_bench.py (FP8, batches 1 and 32, 32 tokens, no profile: steady
# decode tok/s, the idle 1k-prompt TTFT and the greedy tokens' fingerprint) for each build, twice in
# alternation (A B A B), so drift shows.
# A build is a folder holding `metainfer/` and `benchmarks/` (e.g. `git archive <sha> metainfer benchmarks`).
#   BUILDS="old:.old new:." bash benchmarks/gpu_before_after.sh        # OUT defaults to out/before_after
set -u
OUT=${OUT:-out/before_after}
DTYPE=${DTYPE:-fp8}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for r in $(seq 1 "$ROUNDS"); do
  for b in ${BUILDS:-old:.old new:.}; do
    name=${b%%:*}; dir=${b#*:}
    (cd "$dir" && timeout "${LIMIT:-240}" python benchmarks/decode_bench.py --dtype "$DTYPE" --batches 1,32 --gen 32 \
        --no-profile --out "$OUT/${name}_$r" > "$OUT/${name}_$r.log" 2>&1)
    echo "[$name round $r] exit $?"
    grep -E "^\| (1|32) \||^TTFT 1k" "$OUT/${name}_$r.log" | sed "s/^/  $name r$r /"
    python -c "import json, sys; d = json.load(open(sys.argv[1])); print('  $name r$r greedy tokens sha1',
        {r['batch']: r.get('tokens_sha1') for r in d['decode']})" "$OUT/${name}_$r/decode_bench_$DTYPE.json" 2>/dev/null
  done
done
