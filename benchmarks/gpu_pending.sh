#!/usr/bin/env bash
# On the H200: the switches built but not yet measured, and the judgement runs after them, in as few calls as
# possible (OUT set; .whl carried). PHASES picks the parts, each well under the 10-minute call limit.
#
# FIRST (an H100 will do, ~3 min warm): HALF=1 SUITE=quick LIMIT=200 bash benchmarks/gpu_oracle.sh: the oracle's three
# GPU fixes (the sampler's noise below 1, the layer hook on expert rows, the snapshot pool sized to the suite) on a
# 20-layer full-width config in BF16 and FP8; its last run stopped at the device limit before a verdict.
# THEN, before any phase below (each needs an H200: run with needs_h200; the engine and its reference do not
# fit 80 GiB), one whole call each:
#   1. PRECISIONS=fp8 LIMIT=560 bash benchmarks/gpu_oracle.sh       the hardened oracle has not yet completed on
#   2. PRECISIONS=bfloat16 LIMIT=560 bash benchmarks/gpu_oracle.sh  the full model (at half depth on an H100 its
#      reference phase took 50 s BF16 / 120 s FP8 before NOISE_MAX_LEN); read its per-phase stderr lines
#      (verify: PHASE SECONDS) and calibrate compare.GATES (noise_ratio_rmse 1.5, noise_ratio_kl 2.25,
#      layer_ratio 1.3) against the honest ratios it prints.
#   3. metainfer verify --model /tmp/ckpt/fp8 --suite full after
#      python benchmarks/fp8_checkpoint.py --dir /tmp/ckpt --formats fp8 --keep --out $OUT (the published FP8
#      layout at full size: its write, load and bit-identity are measured; the oracle on it is not).
#   4. prefix caching: `metainfer verify --suite full` (its prefix-hit suites) FP8 and BF16, then a multi-turn
#      workload (8k shared system prompt + growing history, 256 new tokens a turn, 16 conversations): TTFT on a
#      hit vs --no-enable-prefix-caching; logit_bias on CUDA: tests/server/test_common_surface.py on the GPU.
#   5. throughput (c = 32): the grouped MoE's 29 swapped-operand configs at T = 32 / 64 are no faster than the
#      current one (H100: 216.8 -> 212.5 us, 282.8 -> 277.9 us a layer): the step's gap to its byte floor is in
#      the launches between kernels (569 a step at batch 32), the dense FP8 GEMMs at M = 32 (cuBLAS, 1.05 ms of
#      12.3) and the gate/up kernel's ~75 % of peak bandwidth; measure ideas there on an H100 (relative).
#      The issue's table in one call: DTYPE=fp8 MORE_CONCS="8 64" POISSON_RATE=3 bash benchmarks/gpu_serve.sh
#      (c = 1 / 8 / 32 / 64, idle TTFT, 256 Poisson arrivals; P99 ITL in each JSON), then DTYPE=bfloat16 (c = 32).
#      The server's share: with an instant scripted engine (CPU, 32 streams of 1,024 tokens) the event loop spends
#      ~50 us of Python and one send syscall per streamed token (32 a step at c = 32), and Python's default 5 ms GIL
#      switch interval can hold the engine thread's next launch behind it: TAG=si05 SWITCH_INTERVAL=0.0005
#      bash benchmarks/gpu_serve.sh against the default on the same warm card (c = 32 output tok/s, P99 ITL).
#   6. structured outputs' cost: gpu_serve.sh's c=32 FP8 run, then the same with bench serve --extra-body
#      '{"guided_json": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}'
#      on the same warm card (target: <= 5 % output tok/s).
#
#   timeline - gemv.cu's timeline build (a measuring tool: gemv.use_timeline_build): its GPU test, then one decode
#              step's qkv / in_proj and gate/up launches CTA by CTA (experiments/gemv_timeline.py: entry, wait,
#              prologue, x staged, first chunk, end), ~2 min
#   fusverify - ON="VAR ..." (a candidate's switches, declared in metainfer/settings.py while it is measured): the
#              FP8 oracle with them, the batch-1 wall time by kernel, the layer table and batch 8, ~3 min
# The A/Bs run in one process (benchmarks/ab_inproc.py: the decode graphs captured again for each mode, IREPS (3)
# interleaved rounds), in fresh processes (REPS, 2) where that fails, INPROC=0 or FRESH=1 asks for both. Past
# DEADLINE (540 s) nothing long starts; more than 8 files in $OUT go back as $OUT/all.tgz.
# Judgement and profiles:
#   verify   - the oracle (FP8, BF16) with every switch of ON="..." set to 1, ~2 min
#   switches - FP8 batch 1 with the defaults and each of SWITCHES ("A=1 B=2", a comma joins: "A=1,B=2"), x REPS
#   final1   - the defaults: engine PDL / graph tests, the oracle (FP8, BF16), FP8 batches 1/8/32/64/128 and BF16
#              FINAL_BF16_BATCHES (1), ~8 min
#   exposed  - the FP8 batch-1 step's wall time by kernel (PDL on) at max_model_len 1,120 and 8,192, ~2 min
#   prof1    - PDL-off batch-1 kernel profiles (FP8, BF16), ~1.5 min; profile: FP8 batch 1 + 1k prefill, PDL off
# Phases of switches measured earlier (since made the only path or removed) are in this file's git history.
#
#   PHASES="final1 timeline" bash benchmarks/gpu_pending.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MODEL=dummy:metainfer/configs/qwen3.6-35b-a3b.json
has() { [[ " $PHASES " == *" $1 "* ]]; }  # a phase named exactly (not a substring of another)
tag() { while IFS= read -r l || [[ -n $l ]]; do echo "[$1] $l"; done; }  # each line prefixed (any tag)
DEADLINE=${DEADLINE:-540}  # seconds into the call past which nothing long starts (the device stops it at 600)
left() { echo $((DEADLINE - SECONDS)); }
pack_out() {  # the device returns 8 files a call: more than that, all in one archive (built outside $OUT)
  local n
  n=$(find $OUT -type f | wc -l)
  if (( n > 8 )); then
    tar czf /tmp/out_all.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/out_all.tgz $OUT/all.tgz \
      && echo "[out] $n files into \$OUT/all.tgz"
  fi
}
trap pack_out EXIT
oracle() {  # $1 dtype, $2 the verdict's JSON name under $OUT, then the switches (VAR=VALUE) -> the verdict line
  local dt=$1 name=$2; shift 2
  env "$@" timeout 150 python -m metainfer.cli verify --model $MODEL --dtype $dt --device cuda --suite full \
    --json $OUT/$name.json 2>&1 | grep -E "verdict" | head -1 | tag "$dt oracle $*"
}
passed() {  # $1 a pytest log -> 0 when its summary says passed and nothing failed (a timeout leaves no summary)
  grep -q " passed" $1 && ! grep -qE "[0-9]+ (failed|errors?)\b" $1
}
gpu_tests() {  # $1 name, $2 / $3: -k of tests/gpu/test_gemv_gpu.py / test_engine_gpu.py ("-": none) -> 0 when all
  # that ran pass; the kernel's tests first with a short limit (a hang there costs 90 s, not the phase), the
  # engine's only after them; each log holds gemv.cu's watchdog report if one fired
  local ok=0
  (( $(left) > 120 )) || { echo "[$1] no time left for its GPU tests"; return 1; }
  if [[ $2 != - ]]; then
    timeout 90 python -m pytest -q -x tests/gpu/test_gemv_gpu.py -p no:cacheprovider -k "$2" > $OUT/$1_tests.log 2>&1
    passed $OUT/$1_tests.log || ok=1
    tail -1 $OUT/$1_tests.log | sed "s/^/[$1 kernel tests] /"
  fi
  if [[ $3 != - && $ok == 0 ]]; then
    timeout 200 python -m pytest -q -x tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "$3" \
      > $OUT/$1_engine_tests.log 2>&1
    passed $OUT/$1_engine_tests.log || ok=1
    tail -1 $OUT/$1_engine_tests.log | sed "s/^/[$1 engine tests] /"
  fi
  [[ $ok == 0 ]] || echo "[$1] GPU tests failed (see $1_tests.log / $1_engine_tests.log)"
  return $ok
}
medians() {  # $1: a tag, $2: the runs' folder prefix under $OUT ($OUT/<prefix>_<mode index>_<round>), then the
  # modes in order -> each mode's median FP8 batch-1 tok/s
  python3 - "$OUT" "$@" <<'PY'
import glob, json, statistics, sys
out, tag, prefix, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
for i, mode in enumerate(modes):
    v = [json.load(open(f))["decode"][0]["decode_tok_s"] for f in glob.glob(f"{out}/{prefix}_{i}_*/decode_bench_*.json")]
    print(f"[{tag}] {mode}: median {statistics.median(v):.1f} tok/s, runs {v}" if v else f"[{tag}] {mode}: none")
PY
}
inproc_ab() {  # $1 tag, then the modes: benchmarks/ab_inproc.py (one process, the decode graphs captured again for
  # each mode, IREPS (3) interleaved rounds of --gen 64; AB_DTYPE, fp8; IPROFILE=1: then each mode's layer table)
  # -> 0 when it wrote its JSON ($OUT/$1_inproc/)
  local tag=$1 rc limit; shift
  [[ ${INPROC:-1} == 1 ]] || return 1
  limit=$(( $(left) < ${INPROC_LIMIT:-360} ? $(left) : ${INPROC_LIMIT:-360} ))
  (( limit > 90 )) || { echo "[$tag] no time left for the in-process A/B"; return 1; }
  timeout $limit python benchmarks/ab_inproc.py --dtype ${AB_DTYPE:-fp8} --rounds ${IREPS:-3} --gen ${AB_GEN:-64} \
    ${IPROFILE:+--profile} --modes "$@" --out $OUT/${tag}_inproc > $OUT/${tag}_inproc.log 2>&1
  rc=$?
  grep -E "^\| |^\[(fp8|bfloat16) batch| layer [0-9.]+ us: " $OUT/${tag}_inproc.log | tag "$tag in-process"
  # (a partial JSON stays for the record; only a whole run counts)
  [[ $rc == 0 && -f $OUT/${tag}_inproc/ab_inproc_${AB_DTYPE:-fp8}.json ]] \
    || { tail -3 $OUT/${tag}_inproc.log | tag "$tag in-process failed (rc $rc)"; false; }
}
modes_ab() {  # $1 tag, $2 the runs' folder prefix, then the modes ("default", or VAR=VALUE joined by commas): batch
  # 1 (AB_DTYPE, fp8) in each mode, in one process (inproc_ab); in fresh processes, each mode in turn x REPS (2)
  # where that failed, x FRESH_REPS (1) where FRESH=1 asks for both (the fresh runs' medians, $OUT/$1.tgz)
  local tag=$1 prefix=$2; shift 2
  local modes=("$@")
  local reps=${REPS:-2}
  if inproc_ab $tag "${modes[@]}"; then
    [[ ${FRESH:-0} == 1 ]] || return 0
    reps=${FRESH_REPS:-1}  # a cross-check of the in-process figures
  fi
  local fit=$(( $(left) / (60 * ${#modes[@]}) ))  # the rounds of fresh processes (~50 s each) that fit
  (( fit < reps )) && { echo "[$tag] time for $fit of $reps fresh rounds"; reps=$fit; }
  for r in $(seq $reps); do
    for i in "${!modes[@]}"; do
      sw=(); [[ ${modes[$i]} != default ]] && IFS=, read -ra sw <<< "${modes[$i]}"
      env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype ${AB_DTYPE:-fp8} --batches 1 \
        --gen ${AB_GEN:-64} --no-profile --out $OUT/${prefix}_${i}_$r 2>&1 | grep -E "^\| 1 " | tag "${modes[$i]} $r"
    done
  done
  (( reps > 0 )) || return 0
  medians $tag $prefix "${modes[@]}"
  (cd $OUT && tar czf $tag.tgz ${prefix}_* && rm -rf ${prefix}_*)
}
PHASES=${PHASES:?PHASES: one or more of the phases above}

if has timeline; then
  timeout 150 python -m pytest -q tests/gpu/test_gemv_gpu.py -p no:cacheprovider -k timeline 2>&1 | tail -2 \
    | tag "timeline test"
  (( $(left) > 90 )) && timeout $(( $(left) - 20 )) python experiments/gemv_timeline.py --modes default \
    --out $OUT/timeline 2>&1 | grep -v "falling back" | tail -20 | tag timeline
fi
if has fusverify; then  # the oracle (FP8) with ON's switches at 1, then the batch-1 step's wall time by kernel, the
  # layer table and batch 8 with them, ~3 min
  sw=(); for v in ${ON:?ON: the switches to judge}; do sw+=("$v=1"); done
  oracle fp8 verify_fp8_fusions "${sw[@]}"
  env "${sw[@]}" timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8 --gen 32 \
    --out $OUT/fusions_exposed 2>&1 | sed -n '/wall time by kernel/,$p' | head -14 | sed "s/^/[fusions exposed] /"
  python -m metainfer.bench.critical_path $OUT/fusions_exposed/decode_bench_fp8.json | sed "s/^/[fusions layers] /"
fi
if has verify; then
  sw=(); for v in ${ON:-}; do sw+=("$v=1"); done
  for dt in fp8 bfloat16; do oracle $dt verify_${dt}_pending "${sw[@]}"; done
fi
if has switches; then  # FP8 batch 1: the defaults and each of SWITCHES (space-separated VAR=VALUE; a comma joins
  # several into one mode: "A=1,B=2") in turn, x REPS (2) rounds, fresh processes; then each mode's median, ~45 s a run
  modes_ab switches sw default ${SWITCHES:?SWITCHES: the modes to compare with the defaults}
fi
if has final1; then
  [[ ${FINAL_GEMV:-0} == 1 ]] && timeout 200 python -m pytest -q tests/gpu/test_gemv_gpu.py tests/gpu/test_kernels_b_gpu.py \
    -p no:cacheprovider -k "gemv or moe_routed_rows or conv" 2>&1 | tail -2
  [[ ${FINAL_TESTS:-1} == 1 ]] && timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "pdl_equals or graph_replay_equals_eager" 2>&1 | tee $OUT/gpu_tests_final1.log | tail -2
  for dt in fp8 bfloat16; do
    timeout 200 python -m metainfer.cli verify --model $MODEL --dtype $dt \
      --device cuda --suite full --json $OUT/verify_$dt.json 2>&1 | grep -v "falling back" > $OUT/verify_$dt.log
    tail -3 $OUT/verify_$dt.log | sed "s/^/[$dt oracle] /"
  done
  timeout 150 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,32,64,128 --gen 32 --out $OUT/final1 2>&1 \
    | grep -v "falling back" | grep -E "^\|" | head -40
  timeout 150 python benchmarks/decode_bench.py --dtype bfloat16 --batches ${FINAL_BF16_BATCHES:-1} --gen 32 --no-profile \
    --out $OUT/final1 2>&1 | grep -E "^\|" | grep -v batch  # FINAL_BF16_BATCHES=1,8,32,64,128: all (~2 min)
fi
if has exposed; then  # (2026-12-04g) the FP8 batch-1 step's wall time by kernel with PDL on
  # (decode_bench's exposed_bs1: each kernel's time past every earlier kernel's end), at decode_bench's
  # max_model_len and the server's 8,192; the kernels' durations PDL-off beside it, ~2 min
  for mml in 0 8192; do
    timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --max-model-len $mml \
      --out $OUT/exposed_$mml 2>&1 | sed -n '/wall time by kernel/,$p' | head -18 | sed "s/^/[mml $mml] /"
  done
fi
if has prof1; then
  for dt in fp8 bfloat16; do
    METAINFER_PDL=0 timeout 80 python benchmarks/decode_bench.py --dtype $dt --batches 1 --gen 32 --out $OUT/prof1_pdl0 \
      2>&1 | grep -E "^\|" | head -24 | sed "s/^/[$dt PDL off] /"
  done
fi
if has profile; then
  METAINFER_PDL=0 timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 16 \
    --out $OUT/pdl_off_profile 2>&1 | grep -E "^\||TTFT"
  python3 - "$OUT/pdl_off_profile/decode_bench_fp8.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["prefill_profile"]
print(f"prefill {p['prompt_len']} tokens, PDL off: wall {p['wall_ms']:.1f} ms, kernels {p['kernel_ms']:.1f} ms, "
      f"{p['launches']} launches")
for r in p["top"][:12]:
    print(f"  {r['us'] / 1e3:7.2f} ms {r['calls']:5d}x  {r['kernel'][:70]}")
PY
fi
