#!/usr/bin/env bash
# History: the megakernel left the product; its code (metainfer/kernels/mega, --megakernel, tests/gpu/test_mega_gpu.py)
# is at commit b4eb65f. The phases mega, megaprof, megaeng and chunkbench need that tree (git worktree add /tmp/mega
# b4eb65f); chain2 and pdlchain (experiments/stream_chain.cu) still build here.
# On the H200: the batch-1 megakernel (metainfer/kernels/mega, `--megakernel`, KB-0075..0091; docs/megakernel.md)
# and its skeleton (experiments/stream_chain.cu, KB-0074 / KB-0092). OUT set; .whl carried. PHASES picks:
#   mega       - mega.cu's registers, its GPU tests, experiments/mega_step.py (BF16 and FP8 lm_head), mega_bench.py
#   megaprof   - the GPU tests, then the full step checked, timed and profiled (mega_step.py --prof)
#   megaeng    - the engine with --megakernel: FP8 batch 1 decode, then the oracle (one sequence at a time)
#   chunkbench - the consumers' rate on one ring slot (mega_chunk_bench.py): CUDA cores, tensor cores, the ring
#   chain2     - the skeleton alone (ncu's summary, one stage, the whole chain)
#   pdlchain   - the skeleton as one launch per stage chained by PDL (PDL_FULL, PDL_WG, PDL_ROWS)
#
#   PHASES="mega megaeng" bash experiments/gpu_mega.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MODEL=dummy:metainfer/configs/qwen3.6-35b-a3b.json
has() { [[ " $PHASES " == *" $1 "* ]]; }  # a phase named exactly (not a substring of another)
PHASES=${PHASES:?PHASES: one or more of the phases above}

if has mega; then
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -o /tmp/mega.cubin \
    metainfer/kernels/mega/mega.cu 2>&1 | grep -E "registers|spill" | tail -2
  timeout 240 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -4 $OUT/mega_tests.log
  if [[ ${MEGA_STEP:-1} == 1 ]]; then
    timeout 200 python experiments/mega_step.py --json $OUT/mega_step_bf16head.json 2>&1 | tail -12
    timeout 200 python experiments/mega_step.py --fp8-lm-head --json $OUT/mega_step_fp8head.json 2>&1 | tail -12
  fi
  timeout 150 python experiments/mega_bench.py --json $OUT/mega_bench_fp8.json 2>&1 | tail -5
fi
if has megaprof; then  # the megakernel's GPU tests, then the full step checked, timed and profiled (profile.py)
  timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -3 $OUT/mega_tests.log
  timeout 240 python experiments/mega_step.py --prof --reps 30 --leads 0 ${MEGA_ARGS:-} \
    --json $OUT/mega_step.json 2>&1 | grep -v Warn | tail -32
fi
if has megaeng; then  # the engine with --megakernel: FP8 batch 1 decode, then the oracle (only if the tests passed)
  timeout 240 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --no-profile --megakernel \
    --out $OUT/megaeng 2>&1 | grep -E "decode_tok_s|megakernel|Error|Traceback" | head -6
  # (one sequence at a time: the megakernel serves only batch-1 decode steps)
  timeout 300 python -m metainfer.cli verify --model $MODEL --dtype fp8 \
    --megakernel --max-num-seqs 1 --device cuda --suite full --json $OUT/verify_fp8_mega.json 2>&1 \
    | grep -E "verdict|FAIL|Error" | head -8
fi
if has chunkbench; then  # the consumers' rate on one ring slot: CUDA cores, tensor cores, the ring, FP8 wgmma
  timeout 240 python experiments/mega_chunk_bench.py --wgmma --variants "${CHUNK_VARIANTS:-}" \
    --json $OUT/chunk_bench.json 2>&1 | grep -v Warn | tail -12
fi
build_chain() { nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/stream_chain experiments/stream_chain.cu; }
if has chain2; then
  build_chain || exit 1
  [[ ${NCU:-1} == 1 ]] && timeout 120 ncu --clock-control none -k regex:chain_kernel -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats /tmp/stream_chain /tmp/one.json one \
    > $OUT/ncu_chain.txt 2>&1 && grep -E "DRAM Throughput|Duration|Warp Cycles" $OUT/ncu_chain.txt | head -8
  timeout 60 /tmp/stream_chain $OUT/stream_chain_single.json single 2>&1 | tee $OUT/stream_chain_single.log
  timeout 150 /tmp/stream_chain $OUT/stream_chain2.json 2>&1 | tee $OUT/stream_chain2.log
fi
if has pdlchain; then
  build_chain || exit 1
  [[ ${PDL_FULL:-1} == 1 ]] && timeout 200 /tmp/stream_chain $OUT/stream_chain_pdl.json pdl 2>&1 | tee $OUT/stream_chain_pdl.log
  [[ ${PDL_WG:-0} == 1 ]] && { timeout 60 /tmp/stream_chain /tmp/wgdebug.json wgdebug 2>&1 | tail -3
    timeout 200 /tmp/stream_chain $OUT/stream_chain_pdlwg.json pdlwg 2>&1 | tee $OUT/stream_chain_pdlwg.log; }
  for r in ${PDL_ROWS:-}; do  # e.g. "12352 9216 4608 4096": in_proj, qkv, the 9 downs, a K = 4096 projection's bytes
    timeout 60 /tmp/stream_chain $OUT/stream_chain_pdl_$r.json pdlsize $r 2>&1 | grep " us per " | tee -a $OUT/stream_chain_pdlsize.log
  done
fi
