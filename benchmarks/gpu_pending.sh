#!/usr/bin/env bash
# On the H200: the switches built but not yet measured, in as few calls as possible (OUT set; .whl
# carried). PHASES picks the parts (each well under the 10-minute call limit):
#   tests  - their GPU tests (the gated DeltaNet prefill prep, its sm_90 build), ~1 min
#   ab     - decode batch 1 + 1k TTFT (fresh engine and after the runs) + prefill profile, each switch
#            0 -> 1 in fresh processes: METAINFER_PREFILL_GATING (KB-0029, the DeltaNet gates inside
#            the prefill prep kernel: ~210 launches fewer per 1k prefill; FP8 and BF16), and
#            METAINFER_MOE_PAIR_MAX_T 32 -> 8 (FP8 batches 16, 32 on the grouped e4m3 path), and
#            METAINFER_FP8_GEMM triton -> cublas (prefill dense GEMMs, KB-0031), ~6 min
#   rows   - KB-0035 METAINFER_MOE_ROWS 0 -> 1 (the experts' weighted sum in the next norm instead of
#            a combine launch; BF16 batches <= 8, FP8 5-16): its GPU test, batch 1, 8 and 16, ~5 min
#   pgraph - idle 1k TTFT without and with the lone-prefill CUDA graphs (--prefill-graphs 1024;
#            KB-0030), FP8 and BF16, then the oracle with them (verify --prefill-graphs 1024), ~5 min
#   sweep  - the grouped MoE at T = 32 and 1,024 (two M-block sizes each), e4m3 activations off and on
#            (at T = 32 against the per-pair path's ~180 us: moe.use_pair_path), ~6 min
#   sweep_head - tiles of the FP8 lm_head (248,320 x 2,048) at batch 1: skinny and GEMV spaces, ~4 min
#            (KB-0026: METAINFER_FP8_LM_HEAD measured +7 tok/s untuned)
#   sweep16 - the grouped MoE's 16-row bucket (T <= 456: FP8 decode batches 17-456; never swept with
#            e4m3 activations and the shared expert, heuristic tiles today) at T = 64, then decode
#            batches 32 / 64 / 128 without and with the swept table, and the FP8 oracle with it, ~6 min
#   barrier - KB-0034's first question: the grid barrier's GPU tests, then benchmarks/barrier_bench.py
#            (a chain of 40 dependent GEMVs: one launch per stage, PDL off / on, vs one persistent
#            launch with a grid barrier between stages), ~1 min
#   prof32 - batch-32 decode kernel profiles, PDL off, FP8 and BF16 (the batch kept whole since
#            2026-11-30h; the c=32 step's split between MoE, DeltaNet, projections and small kernels), ~2 min
#   spec   - KB-0038: batch-1 decode with and without n-gram speculation (benchmarks/spec_bench.py,
#            random and repeated-pattern 1k prompts; acceptance reported), SPEC_DTYPES (fp8), ~2 min each
#   stream64 - FP8 dense projections of 17-64 tokens (decode batches 24-64) on the weight-streaming
#            kernel with swept tiles (T = 32, 64; nearest wider config between) instead of cuBLAS's
#            W8A8 GEMM (24 % of its byte floor at batch 32, 2026-11-30i): sweep, then decode batches
#            24/32/48/64 without and with it, ~8 min; s64verify: the FP8 oracle with it, ~2 min
#   small  - FP8 dense projections at 2-16 tokens (decode batches 2-16, a lone verify's 1 + K): the
#            committed table has T = 1 rows only, the rest run skinny_config's heuristic (a 5-token
#            verify's projections took 25 us per call vs 8.9 at T = 1, 2026-11-30i profile). Sweep at
#            SMALL_T (2,4,5,8,16), then decode batches 2/4/8/16 and spec_bench's script-4 without and
#            with the table, ~9 min; then PHASES=s64verify STREAM64_TUNED=<its JSON> style: sverify
#   sverify - the FP8 oracle with SMALL_TUNED (the small phase's fp8_skinny_tuned.json), ~1.5 min
#   asplit - METAINFER_ATTN_PREFILL_SPLIT 0 -> 1 (split-KV attention for chunks <= 16 tokens: a
#            verify's 5 queries over a 1k context ran on 2 programs per layer): its GPU test, spec_bench
#            script-4 (the verify step's median) without and with it, the FP8 oracle with it, ~4 min
#   srepeat - the oracle on the speculative verify path: --speculative repeat (the last token drafted K
#            times: every eligible step verifies, most drafts rejected, states restored) with verifies of
#            up to 64 sequences beside each other, FP8 and BF16, ~5 min
#   bisect - spec_bench script-4 on an older tree (REF_TREE: `git archive <sha> metainfer benchmarks`
#            extracted into an ignored folder, carried), ~2 min
#   t1out  - batch-1 decode with the T = 1 out_proj/o_proj row on benchmarks/tuned/t1_out_proj_tc.json, ~1.5 min
#   nsw    - KB-0043/44/45: their GPU tests, then FP8 decode batches 8/32/64 + TTFT with the defaults and
#            with each of METAINFER_ALIGN_ROWS, METAINFER_MOE_GROUPED_ROWS, METAINFER_MOE_BUCKET_ONE at 0, ~5 min
#   sgtest - the speculative engine GPU test with METAINFER_ATTN_PREFILL_SPLIT 1 and 0 (KB-0041), ~1.5 min
#   ssm16  - KB-0046 --ssm-state-dtype bfloat16 (the DeltaNet states stored in bf16, fp32 math: half the
#            state traffic): its GPU tests, FP8 decode batches 1/32/64/128 with fp32 and bf16 states, the
#            oracle (FP8, BF16) with bf16 states, ~8 min
#   verify - the oracle with every switch of ON="..." set to 1 (FP8 and BF16), ~2 min
#   profile - FP8 batch-1 decode and 1k prefill profiles with PDL off (each kernel's own time; with
#            PDL on a kernel's time includes its wait for the one before), ~1 min
#   gtune  - the DeltaNet prefill kernels' configs (gdn_prefill.py grids: sub_block 1-16 x prep warps, block_v x
#            scan stages; GDN_GRID=0 skips them) and the grouped MoE with TMA weight tiles and in-kernel activation
#            quantisation (sweep_decode_kernels.py --grouped-tma: TMA, QA, wider down tiles; FP8 T = 1024, 64),
#            then FP8 decode batches 1/64 + TTFT with the winners (METAINFER_GDN_PREFILL, METAINFER_MOE_TUNED)
#            against the defaults, fresh processes, ~7 min (measured at a668ef6: KB-0047, KB-0048)
#   nquant - METAINFER_NORM_QUANT 0 vs 1 (KB-0052, on by default since 2026-11-30m: the norms before FP8 GEMMs write their e4m3 copy; 110
#            of 120 act_quant launches fewer per 1k prefill): its GPU tests, the FP8 A/B (TTFT, batches 32/64), the
#            oracle (FP8) with it on, ~6 min
#   tiediag - the speculative-vs-plain GPU test (failed at 79ef3e9: BF16 batched vs lone, FP8 at an exact tie)
#            at the defaults, with METAINFER_PDL_PREFILL=1 and with the pre-KB-0047 prep config
#   gjudge - with GDN="<fields>" and MOE_TUNED=<table> (gtune's winners): the TMA GPU test, FP8 TTFT default / GDN /
#            GDN + MoE table, the oracle (FP8, BF16) with both, BF16 TTFT both / default, ~7 min
#   vstep  - the speculative verify step (1 + 4 tokens: 5.36 ms vs a 2.2 ms decode step, 2026-11-30m): the
#            short-chunk DeltaNet kernel's GPU test with its BLOCK_T form, the step's kernel profile with PDL off
#            (split-KV attention on), the BF16 router on the weight-streaming kernel at T = 3, 5 (swept against
#            cuBLAS), then spec_bench's forced-acceptance script-4 rows: base, the route launch folded into
#            gate/up at T = 5 (METAINFER_MOE_ROUTED_MAX_T=5), the swept router, the DeltaNet inputs loaded
#            before the token loop (METAINFER_GDN_RECURRENT_PRELOAD=1, KB-0053: 1.8x slower, removed since;
#            the switch now does nothing), all three, ~7 min
#   mtp    - MTP speculation (--speculative mtp, KB-0060): FP8 oracle with it (--speculative-max-seqs 64; on dummy
#            weights its drafts are noise: the verify path judged), spec_bench plain / mtp / mtp-script-2,4
#            (the MTP drafter's cost at forced acceptance) and a profile of mtp-script-4; GPU tests first, ~8 min
#   mtp3   - after the removals (KB-0061, KB-0063): MTP/speculative GPU tests, FP8 oracle with MTP over 32k draft
#            ids (--speculative-draft-vocab), forced-acceptance K = 4 whole / 32k vocabulary, FP8 plain decode, ~7 min
#   mtpserve - the server with MTP drafts over 32k ids (gpu_serve.sh: c = 1, idle TTFT, c = 32), then forced-
#            acceptance K = 3 / 6 over 32k ids, ~6 min
#   downids - the per-pair rows' down on the preloading kernel from ids (METAINFER_MOE_DOWN_IDS, KB-0059; the FP8
#            default since 2026-12-01a): GPU test, batches DI_BATCHES (2,8) A/B (x2) in DI_DTYPES (bfloat16), ~3 min
#   gswap  - the grouped MoE GEMMs swapped (weights as the MMA's M side, METAINFER_MOE_GROUPED_SWAP): GPU tests,
#            sweep at T = 64 / 1,024, FP8 batches 8 / 16 on the swapped grouped path vs per-pair, FP8 batch 64 +
#            TTFT on the swept table vs the committed one (x2), ~10 min (the sweep alone ~5)
#   host   - the verify step's host work: stacked DeltaNet states and staged prefill-graph inputs (REF_TREE =
#            the tree before them), interleaved spec_bench script-4 rows; engine GPU tests first, ~7 min
#   host2  - the host A/B again (5 alternating processes) and the verify step's PDL-off kernel profiles:
#            defaults, routing in gate/up at T = 5 + swept router, KB-0053; ~6 min
#   nrouter - the post-attention add+RMSNorm and the MoE router in one launch (METAINFER_NORM_ROUTER_MAX_T, default 8):
#            GPU tests (kernel, engine on/off, PDL, sm_90 build), FP8 batches 1/2/4/8 A/B 0 vs 8 (x2), BF16 1/8
#            (x1), a PDL-off FP8 batch-1 profile with it, ~7 min
#   nrverify - the oracle (FP8, BF16) with the defaults, spec_bench forced-acceptance n-gram K = 4 / 8 / 15
#            (the verify of 16 tokens: how far long drafts go), ~6 min
#   gnorm  - the DeltaNet gated RMSNorm as out_proj's weight-preloading prologue (METAINFER_GNORM_MAX_T, then 4;
#            METAINFER_GNORM_CFG "BLOCK_N,HEADS,warps"): its GPU tests, FP8 batches 1/2/4 off / default config /
#            three others, BF16 off / on, fresh processes, ~8 min
#   gnorm2 - (its cut form gnorm2b measured: results/2026-12-01d, KB-0069) _gnorm_gemv_kernel's batched-dot (MMA)
#            form for 2-16 tokens (METAINFER_GNORM_MAX_T 1 -> 16):
#            its GPU tests, FP8 batches 1/2/4/8/16 (x2, alternating), MMA configs 16,8,8 / 32,16,8 at 2/4/8, BF16
#            1/2/8, spec_bench forced K = 4 (the 5-token verify) 1 vs 16, ~9 min; if faster, the oracle with it
#   final1 - the defaults after nrouter / gnorm: the PDL and graph-replay engine tests, the oracle (FP8, BF16),
#            FP8 decode batches 1/8/32/64/128 and BF16 1, ~8 min
#   prof1  - PDL-off batch-1 kernel profiles (FP8, BF16) of the defaults, ~1.5 min (at cc0eabf it also ran
#            moe_add_rms_norm on 4 / 8 / 16 warps: FP8 batch 1 512 / 512 / 509, batch 8 1,793 / 1,788 / 1,783; the
#            switch was removed)
#   head   - KB-0026's judgement: the FP8 lm_head's tiles swept at T = 1, 8 (skinny, then the preloading GEMV against
#            the skinny winner), FP8 decode batches 1 / 8 / 32 with the BF16 head, the FP8 head on the swept table and
#            on heuristic tiles (bf16, swept, heur, bf16, swept), then the oracle (FP8) with the swept FP8 head, ~9 min
#   gnorm2b - gnorm2 cut to one call's remaining budget: the gated-norm GPU tests, FP8 batches 1/2/4/8 with the bound
#            1 / 16 (x2, alternating), spec_bench forced K = 4 (the 5-token verify) 1 vs 16, the oracle (FP8) with 16, ~6 min
#   gprof  - NOT YET RUN: KB-0069's open question, PDL-off kernel profiles with METAINFER_GNORM_MAX_T 1 / 16: FP8 decode
#            batch 4 (--profile-batch 4) and spec_bench's forced K = 4 verify (--profile script-4), the out_proj
#            pair (gated norm + _skinny_kernel) against _gnorm_gemv_kernel on each path, ~4 min
#   Measured (results/2026-12-01d): head (KB-0067), gnorm2b (KB-0069); the residual fold (KB-0068: built at d45b425 /
#   69c12ba, slower, reverted; its phases fold / fold2 went with it)
#   Measured (results/2026-12-01b): mtp, mtpheads and mtp2 (at b5d5eca: KB-0061's and KB-0063's switches, removed
#   since; KB-0062's draft vocabulary now --speculative-draft-vocab); (2026-12-01a): sonce (KB-0058: slower, removed;
#   KB-0059 kept for FP8), gswap (KB-0057:
#   the swapped FP8 configs in the table; the swapped grouped path at batches 8 / 16 slower than per-pair);
#   (2026-11-30j): small (KB-0042), bisect, t1out, asplit (KB-0041), nsw (KB-0043..45), srepeat,
#   sgtest; (2026-11-30h): rows (KB-0035, kept), sweep16 (KB-0037), barrier (KB-0034); earlier: ab, pgraph,
#   sweep, sweep_head.
#   (2026-12-01e): probe (moe_bs1_probe.py), topk (KB-0070), epick (KB-0071), mtp4 (MTP tests at the defaults,
#   FP8-head draft slice). Built, not run: rtiles (KB-0071's sweep at 2-4 tokens).
#   (2026-12-01f): aprologue (KB-0072: no faster, an engine graph test failed with it on; off), fused (KB-0073: the MoE
#   block in one launch, slower, removed: its phase went with it).
#   chain  - benchmarks/stream_chain.cu (KB-0074): the batch-1 step's byte and dependency skeleton (241 chained e4m3
#            GEMV stages) in one persistent CUDA kernel whose producer warp prefetches later stages' weights while a
#            stage waits, against no dependencies and against no cross-stage prefetch; then the engine's graph-replay
#            test at the defaults and the FP8 oracle with the FP8 lm_head (KB-0067's build re-checked), ~6 min
#   chain2 - stream_chain.cu after the first run's lessons (its x reload per stage cost more than the stream: a modulo
#            and tanhf per value, scaling with the consumer warps): the modes again, a no-compute variant, then ncu
#            (--clock-control none) on one mode-0 run, ~3 min
#   chain3 - stream_chain.cu v2 (KB-0075): the producer's L2 lead over data-independent chunks (through the routing
#            waits) and the tensor-core consumers' rows summed in shared memory (no global atomics): `single` and
#            `v2` variant sets; v3: COMPUTE 4 (the FP8 model's W8A16 arithmetic: bf16 x, 128 x 128 block scales, fresh
#            accumulators per block) and XCH (outputs tagged in their 64-bit word: consumers poll the data, not a
#            counter, then the data), with and without the lead, ~3 min
#   pdlchain - stream_chain.cu `pdl` (KB-0092): the same 241 stages as one launch each, chained by programmatic
#            dependent launch in a CUDA graph (weights loaded before griddepcontrol.wait, dependents released late or
#            early, rings small enough for the next stage's CTA to be resident), against the persistent kernel, ~2 min
#   (2026-12-04e): wgslots, wgwide, wgall (KB-0095: in_proj at 4 slots kept; the K = 4,096 forms no faster, removed
#            with their switches: results/2026-12-04e/k4096_forms_removed.patch)
#   wgmoe  - KB-0096: the experts' gate/up on gemv.cu (tests, engine graph test, A/B x2, oracle, profile)
#   wgpre  - KB-0097 (run 2026-12-04f, now the default): the input norm as qkv's / in_proj's x prologue on gemv.cu
#            (tests, engine tests, A/B x3, oracle, profile; METAINFER_WGMMA_GEMV_PRE=0|1)
#   attn   - (built 2026-12-04f) the attention split kernel's first K/V tile before the PDL wait
#            (METAINFER_ATTN_PRELOAD=1), smaller key tiles / more splits (METAINFER_ATTN_DECODE), and the experts'
#            down tiles (METAINFER_MOE_TUNED: PRELOAD_BLOCK_H / DOWN_WARPS): GPU tests, FP8 batch-1 A/Bs, ~5 min
#   downab - the experts' down tile $DOWN (64:4) against the table's, x REPS; kept for later phases where it wins
#   downsweep - the experts' down tiles $DOWNS against the table's, x REPS; the oracle with the best if it wins
#   gdnpre - KB-0021's state preload re-measured beside gemv.cu's in_proj (METAINFER_GDN_PRELOAD), x3, ~3 min
#   exposed - NOT YET RUN: the FP8 batch-1 step's wall time by kernel with PDL on (metainfer/bench/critical_path.py),
#            at max_model_len 1,120 and 8,192, ~2 min
#   reduce - NOT YET RUN: the decode attention reduce over the splits with keys only (METAINFER_ATTN_REDUCE_ACTIVE=1),
#            FP8 batch 1 at max_model_len 8,192 (the server's) and 1,120, x2, ~5 min ($OUT/reduce.tgz)
#   wgearly - NOT YET RUN: gemv.cu's pre prologue with its static loads before the PDL wait and its rows in one wave
#            (-DGEMV_PRE_EARLY=1 via METAINFER_WGMMA_GEMV_DEFINES): GPU tests, A/B x3, oracle, ~6 min
#   mega   - the megakernel (metainfer/kernels/mega; first run 2026-12-02a, KB-0076): ptxas report; its GPU tests (each
#            instruction against emulate.py from the kernel's own inputs: a GEMV chain, an MoE block, a two-layer
#            decode step, which is also checked against the engine's; same bits on a second launch; graph replay);
#            benchmarks/mega_step.py (the full config's decode step, 1k context, against the engine's step and
#            timed; BF16 then FP8 lm_head); benchmarks/mega_bench.py (the GEMV skeleton, chained and hop-free), ~7 min
#            (MEGA_STEP=0 skips the full-config runs)
#   megaprof - the megakernel's GPU tests, then mega_step.py --prof (the full step checked, timed and profiled:
#            where each instruction group's time goes, profile.py), ~2 min
#   megacode - (KB-0076/77) the GPU tests; mega_step.py --prof for the default build and MEGA_VARIANTS (less
#            unrolled code: -DMEGA_FETCH_GROUP=2), both consumer kinds (MEGA_MMAS); with NCU=1 then ncu's warp
#            stall reasons on one step ("no instruction": the SM waiting for code), ~4 min
#   megasrc - ncu's source counters on one megakernel step: warp stalls and instructions per SASS address
#            ($OUT/mega_source.csv; map addresses to ops with the same build's nvdisasm), ~2 min
#   megaeng - the engine with --megakernel (after `mega` passes): FP8 batch-1 decode (decode_bench), then
#            `metainfer verify --suite full --megakernel` (the oracle on the megakernel's steps), ~6 min
#   megawg   - (2026-12-02e) the K = 2048 e4m3 GEMVs and gate/up on FP8 wgmma (the default; -DMEGA_WGMMA=0: CUDA
#            cores): GPU tests of both builds, then mega_step.py --prof of both (MEGA_VARIANTS), ~2 min
#   megapoll - (2026-12-03) the x prologues' polls (settled polls, the norms' groups, evict-first weights:
#            KB-0081; Attend's L2 prefetch, the routing by warp reductions: measured and dropped, KB-0082):
#            GPU tests, then the step against REF_SRC's
#            sources (mega_step.py --ref-src), MEGA_VARIANTS, MEGA_LEADS; then benchmarks/l2_broadcast_bench.py
#            (132 CTAs reading the same L2 words: the hops' cost apart from the step), ~5 min
#   megaroute - (run 2026-12-03c, KB-0083; the variant since removed) the GPU tests of a -D build, then
#            mega_step.py --rounds 4 of it against the default at L2 leads 0 and 128 KB: MEGA_ROUTE_DEFINES
#            (-DMEGA_ROUTE_ALL=1 was the routing's logits in one settled group: 2.372 vs 2.305 ms), ~3 min
#   (megarouter, run 2026-12-03c and removed with its knob, KB-0083: the router's bf16 rows 2 a chunk, 2.348 vs
#            2.277-2.310 ms; the knob: benchmarks/results/2026-12-03c/small_rpc_removed.patch)
#   chunkbench - (KB-0079) the megakernel's consumers apart from the step: benchmarks/mega_chunk_bench.py with
#            --wgmma (modes 4, 5: FP8 wgmma on TMA-swizzled chunks, built 2026-12-02d, not yet run; its outputs
#            checked against fp32), CHUNK_VARIANTS (-D lists for mega_math.cuh), ~1 min
#   gdnfuse - (2026-12-04i, not yet run) the DeltaNet decode step inside the in_proj's launch: GPU tests, then A/B,
#            oracle, profile (see the phase), ~6 min
#   moedown - (2026-12-04i, not yet run) the experts' down inside the gate/up's launch: GPU tests, A/B, oracle,
#            ~7 min; fusedboth: both fusions against neither, and their profile, ~5 min
#   fusions - (2026-12-05) both fusions' GPU tests, then none / each / both in turn (~8 min); fusverify ON="...":
#            the oracle and the profile with those switches (~3 min): the two calls in place of the three above
#   nextl2 - (KB-0110, 2026-12-05, not yet run) the experts' L2 prefetch of the next projection: GPU tests, then
#            NEXT_L2 0 / 2 / 4 (BASE: switches on in every mode), ~5 min
#   router - (KB-0111, 2026-12-05, not yet run) the post-mixer norm and router in the experts' launch (the down
#            fused too): GPU tests, then 0 / 1 (BASE), the oracle, ~6 min
#   reduceearly - (KB-0112, 2026-12-05, not yet run) the attention reduce releasing the o_proj early: the engine
#            test, then 0 / 1 (BASE), ~4 min
#   moeslots - (KB-0113, 2026-12-05, not yet run) the experts' launches on a 6-slot ring of their own: the GPU
#            test, then 4 / 6 (BASE), ~4 min
#   bf16gemv - (KB-0114, 2026-12-05, not yet run) the BF16 qkv / in_proj with their input norm on gemv.cu: GPU
#            tests, BF16 batch 1 0 / 1, the BF16 oracle, ~6 min
#   PHASES="tests ab" bash benchmarks/gpu_pending.sh; PHASES=verify ON="METAINFER_FP8_LM_HEAD" bash ...
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
has() { [[ " $PHASES " == *" $1 "* ]]; }  # a phase named exactly (not a substring of another)
ab_bs1() {  # FP8 batch-1 decode with switch $1 = 0 / 1, alternating in fresh processes x $3, outputs $OUT/$2_<mode>_<round>
  for r in $(seq $3); do
    for m in 0 1; do
      env $1=$m timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --no-profile \
        --out $OUT/$2_${m}_$r 2>&1 | grep -E "^\| 1 " | sed "s/^/[$2 $m $r] /"
    done
  done
}
prof_bs1() {  # the FP8 batch-1 kernel profile with PDL off and switch $1 on, into $OUT/$2_prof; its largest kernels
  env $1=1 METAINFER_PDL=0 timeout 80 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 \
    --out $OUT/$2_prof 2>&1 | grep -E "^\| 1 " && top_kernels $OUT/$2_prof/decode_bench_fp8.json
}
down_table() {  # $1 = PRELOAD_BLOCK_H:DOWN_WARPS -> $2: moe_pair_h200.json's fp8,1 with them (a METAINFER_MOE_TUNED file)
  python3 -c "
import json, sys
t = json.load(open('metainfer/kernels/moe_pair_h200.json'))['configs']['fp8,1']
t.update(PRELOAD_BLOCK_H=int(sys.argv[1]), DOWN_WARPS=int(sys.argv[2]))
json.dump({'configs': {'fp8,1': t}}, open(sys.argv[3], 'w'))" $(echo $1 | tr : ' ') "$2"
}
top_kernels() {  # a decode_bench JSON's batch-1 profile: the 14 largest kernels, us a step
  python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['profile_bs1'][:14]:
    print(f\"{r['kernel'][:40]:40s} {r['calls_per_step']:5.0f} {r['us_per_step']:8.1f} us\")" "$1"
}
fusion_tests() {  # $1 name, $2 / $3: -k of tests/gpu/test_gemv_gpu.py / test_engine_gpu.py -> 0 when both pass
  # (the kernel's tests first, with a short limit: a hang there costs 90 s, not the phase; log $OUT/$1_tests.log)
  { timeout 90 python -m pytest -q -x tests/gpu/test_gemv_gpu.py -p no:cacheprovider -k "$2" 2>&1 \
      && timeout 150 python -m pytest -q -x tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "$3" 2>&1; } \
    | tee $OUT/$1_tests.log | grep -E "passed|failed|rror" | tail -4
  [ "$(grep -c " passed" $OUT/$1_tests.log)" = 2 ] && ! grep -qE "[0-9]+ (failed|errors?)\b" $OUT/$1_tests.log
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
switch_ab() {  # $1 tag, $2 VAR, $3 its values ("0 2 4"), $4 the runs' folder prefix: batch 1 (AB_DTYPE, fp8) with VAR
  # at each value in turn x REPS (2), BASE's switches (space-separated VAR=VALUE) on in every run; medians, $OUT/$4*.tgz
  local base=(${BASE:-}) modes=($3)
  for r in $(seq ${REPS:-2}); do
    for i in "${!modes[@]}"; do
      env "${base[@]}" $2=${modes[$i]} timeout 90 python benchmarks/decode_bench.py --dtype ${AB_DTYPE:-fp8} --batches 1 --gen 32 \
        --no-profile --out $OUT/$4_${i}_$r 2>&1 | grep -E "^\| 1 " | sed "s/^/[$1 ${modes[$i]} ${BASE:-} $r] /"
    done
  done
  medians "$1 ${BASE:-}" $4 "${modes[@]}"
  (cd $OUT && tar czf $4${BASE:+-base}.tgz $4_* && rm -rf $4_*)  # (not $4_base: rm would take it)
}
modes_ab() {  # $1 tag, $2 the runs' folder prefix, then the modes ("default", or VAR=VALUE joined by commas): FP8
  # batch 1 in each mode in turn x REPS (2), fresh processes; medians, $OUT/$1.tgz
  local tag=$1 prefix=$2; shift 2
  local modes=("$@")
  for r in $(seq ${REPS:-2}); do
    for i in "${!modes[@]}"; do
      sw=(); [[ ${modes[$i]} != default ]] && IFS=, read -ra sw <<< "${modes[$i]}"
      env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --no-profile \
        --out $OUT/${prefix}_${i}_$r 2>&1 | grep -E "^\| 1 " | sed "s/^/[${modes[$i]} $r] /"
    done
  done
  medians $tag $prefix "${modes[@]}"
  (cd $OUT && tar czf $tag.tgz ${prefix}_* && rm -rf ${prefix}_*)
}
PHASES=${PHASES:-tests ab}
if has tests; then
  timeout 150 python -m pytest -q tests/gpu -p no:cacheprovider -k "gated or compiles" 2>&1 \
    | tee $OUT/gpu_tests_pending.log | tail -3
fi
if has ab; then
  VAR=METAINFER_PREFILL_GATING DTYPES="fp8 bfloat16" bash benchmarks/gpu_ab.sh
  # FP8 batches 9-32 on the grouped e4m3 path instead of the per-pair one (32: today's bound)
  VAR=METAINFER_MOE_PAIR_MAX_T MODES="32 8" DTYPES=fp8 BATCHES=16,32 bash benchmarks/gpu_ab.sh
  # prefill dense FP8 GEMMs (T > 64) on cuBLAS's blockwise _scaled_mm instead of _w8a8_kernel (KB-0031)
  VAR=METAINFER_FP8_GEMM MODES="triton cublas" DTYPES=fp8 bash benchmarks/gpu_ab.sh
fi
if has rows; then  # KB-0035: the combine launch left out (BF16 batches 1-8; FP8 5-16)
  timeout 150 python -m pytest -q tests/gpu/test_engine_gpu.py -k moe_rows -p no:cacheprovider 2>&1 | tail -2
  VAR=METAINFER_MOE_ROWS MODES="0 1" DTYPES="bfloat16 fp8" BATCHES=1,8,16 bash benchmarks/gpu_ab.sh | grep -v TTFT
fi
if has pgraph; then
  for dt in fp8 bfloat16; do
    for pg in "" 1024; do
      timeout 120 python benchmarks/decode_bench.py --dtype $dt --batches 1 --gen 32 --prefill-graphs "$pg" \
        --out $OUT/pgraph_${dt}_${pg:-none} 2>&1 | grep -E "^\||TTFT|^prefill|replays" | sed "s/^/[$dt graphs=${pg:-none}] /"
    done
    timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --prefill-graphs 1024 --json $OUT/verify_${dt}_pgraph.json 2>&1 \
      | grep -E "verdict" | sed "s/^/[$dt prefill graphs] /"
  done
fi
if has sweep_head; then
  for space in base gemv; do
    timeout 280 python benchmarks/sweep_decode_kernels.py --space $space --linears lm_head --moe= \
      --out $OUT/sweep_head_$space 2>&1 | grep -v "falling back\|skip" | tail -2 | sed "s/^/[lm_head $space] /"
  done
fi
if [[ " $PHASES " == *" sweep "* ]]; then
  for a8 in 0 1; do
    METAINFER_MOE_W8A8=$a8 timeout 280 python benchmarks/sweep_decode_kernels.py --grouped-tokens 32,1024 --moe fp8 \
      --linears= --out $OUT/sweep_grouped_a8_$a8 2>&1 | grep -v "falling back\|skip" | tail -3 | sed "s/^/[a8=$a8] /"
  done
fi
if has sweep16; then
  timeout 280 python benchmarks/sweep_decode_kernels.py --grouped-tokens 64 --moe fp8 --linears= \
    --out $OUT/sweep16 2>&1 | grep -v "falling back\|skip" | tail -3 | sed "s/^/[grouped T=64] /"
  T16=$OUT/sweep16/moe_pair_tuned.json
  for tuned in "" $T16; do
    METAINFER_MOE_TUNED=$tuned timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches 32,64,128 \
      --gen 32 --no-profile --out $OUT/sweep16_ab${tuned:+_tuned} 2>&1 | grep -E "^\|" | sed "s/^/[tuned=${tuned:+yes}] /"
  done
  METAINFER_MOE_TUNED=$T16 timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_sweep16.json 2>&1 | grep -E "verdict" | sed "s/^/[sweep16] /"
fi
if has barrier; then
  timeout 120 python -m pytest -q tests/gpu/test_grid_sync_gpu.py -p no:cacheprovider 2>&1 | tail -3
  timeout 120 python benchmarks/barrier_bench.py --out $OUT 2>&1 | grep -v "falling back" | tail -12
fi
if has spec; then
  for dt in ${SPEC_DTYPES:-fp8}; do
    timeout 240 python benchmarks/spec_bench.py --dtype $dt --gen ${SPEC_GEN:-256} --k ${SPEC_K:-4} --out $OUT/spec ${SPEC_ARGS:-} \
      2>&1 | grep -v "falling back" | tail -${SPEC_TAIL:-14}
  done
fi
if has stream64; then
  timeout 300 python benchmarks/sweep_decode_kernels.py --linears deltanet.in_proj,deltanet.out_proj,attn.qkv,attn.o_proj \
    --moe= --tokens 32,64 --out $OUT/stream64 2>&1 | grep -v "falling back\|skip" | tail -12
  T64=$OUT/stream64/fp8_skinny_tuned.json
  for on in 0 1; do
    sw=(); [[ $on == 1 ]] && sw=(METAINFER_FP8_STREAM_MAX_T=64 METAINFER_FP8_TUNED=$T64)
    env "${sw[@]}" timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 24,32,48,64 --gen 32 \
      --no-profile --out $OUT/stream64_ab$on 2>&1 | grep -E "^\|" | sed "s/^/[stream64=$on] /"
  done
fi
if has s64verify; then  # the oracle on stream64's configs (STREAM64_TUNED: their JSON)
  METAINFER_FP8_STREAM_MAX_T=64 METAINFER_FP8_TUNED=$STREAM64_TUNED timeout 110 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_stream64.json 2>&1 | grep -E "verdict|decode" | tail -4 | sed "s/^/[stream64] /"
fi
if [[ " $PHASES " == *" small "* ]]; then
  timeout 300 python benchmarks/sweep_decode_kernels.py --linears deltanet.in_proj,deltanet.out_proj,attn.qkv,attn.o_proj \
    --moe= --tokens ${SMALL_T:-2,4,5,8,16} --out $OUT/small 2>&1 | grep -v "falling back\|skip" | tail -22
  TS=$OUT/small/fp8_skinny_tuned.json
  for on in 0 1; do
    sw=(); [[ $on == 1 ]] && sw=(METAINFER_FP8_TUNED=$TS)
    env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 2,4,8,16 --gen 32 \
      --no-profile --out $OUT/small_ab$on 2>&1 | grep -E "^\|" | sed "s/^/[small=$on] /"
    env "${sw[@]}" timeout 80 python benchmarks/spec_bench.py --dtype fp8 --gen 64 --reps 3 --script-k 4 --modes script \
      --out $OUT/small_spec$on 2>&1 | grep -E "script-4" | sed "s/^/[small=$on] /"
  done
fi
if has sverify; then
  METAINFER_FP8_TUNED=$SMALL_TUNED timeout 110 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_small.json 2>&1 | grep -E "verdict|decode" | tail -4 | sed "s/^/[small] /"
fi
if has asplit; then
  timeout 120 python -m pytest -q tests/gpu -p no:cacheprovider -k "prefill_split or compile" 2>&1 | tail -1
  for on in 0 1; do
    METAINFER_ATTN_PREFILL_SPLIT=$on timeout 80 python benchmarks/spec_bench.py --dtype fp8 --gen 64 --reps 3 \
      --script-k 4 --modes script --out $OUT/asplit$on 2>&1 | grep -E "script-4" | sed "s/^/[asplit=$on] /"
  done
  METAINFER_ATTN_PREFILL_SPLIT=1 timeout 110 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_asplit.json 2>&1 | grep -E "verdict|decode" | tail -4
fi
if has srepeat; then
  for dt in fp8 bfloat16; do
    timeout 250 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --speculative repeat --speculative-max-seqs 64 --json $OUT/verify_${dt}_repeat.json \
      2>&1 | grep -E "verdict|decode.rel" | sed "s/^/[$dt repeat] /"
  done
fi
if has prof32; then
  for dt in fp8 bfloat16; do
    METAINFER_PDL=0 timeout 150 python benchmarks/decode_bench.py --dtype $dt --batches 32 --gen 16 --profile-batch 32 \
      --out $OUT/prof32_$dt 2>&1 | grep -v "falling back" | sed -n '/profile/,$p' | head -30
  done
fi
if [[ " $PHASES " == *" profile "* ]]; then
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
if has gtune; then  # GDN_GRID=0: the MoE sweep and the A/B only
  [[ ${GDN_GRID:-1} == 0 ]] || timeout 150 python benchmarks/gdn_prefill.py --lengths 1024 --varlen '' --grid "sub_block=1,2,4,8,16;prep_warps=4,8" \
    --grid "block_v=16,32;scan_stages=2,3" --out $OUT/gdn 2>&1 | grep -v "falling back" | tail -24
  timeout 240 python benchmarks/sweep_decode_kernels.py --grouped-tokens 1024,64 --moe fp8 --grouped-tma \
    --out $OUT/tma_fp8 2>&1 | grep -v "falling back" | tail -8
  GDN=""
  [[ ${GDN_GRID:-1} == 0 ]] || GDN=$(python3 - "$OUT"/gdn/gdn_prefill_*.json <<'PY'
import json, sys
sweep = [r for r in json.load(open(sys.argv[1]))["sweep"] if r.get("ok")]
won = []  # each grid's fastest passing combination, where >= 3 % faster than the defaults' row
for first, default in (("sub_block", "sub_block=2 prep_warps=4"), ("block_v", "block_v=32 scan_stages=2")):
    rows = [r for r in sweep if r["tag"].startswith(first)]
    base = next((r for r in rows if r["tag"] == default), None)
    best = min(rows, key=lambda r: r["us"]) if rows else None
    if best and base and best["us"] < 0.97 * base["us"]:
        won.append(best["tag"].replace(" ", ","))
print(",".join(won))
PY
)
  echo "gdn winner: '${GDN}'"
  for mode in default tuned; do
    if [[ $mode == tuned ]]; then export METAINFER_GDN_PREFILL=$GDN METAINFER_MOE_TUNED=$OUT/tma_fp8/moe_pair_tuned.json; fi
    timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1,64 --gen 32 --no-profile \
      --out $OUT/gtune_$mode 2>&1 | grep -E "^\||TTFT" | sed "s/^/[$mode] /"
  done
  unset METAINFER_GDN_PREFILL METAINFER_MOE_TUNED
fi
if has gjudge; then  # GDN="<PrefillConfig fields>" MOE_TUNED=<table>
  timeout 90 python -m pytest -q tests/gpu/test_kernels_b_gpu.py -k tma -p no:cacheprovider 2>&1 | tail -2
  for mode in default gdn gdn_moe; do
    unset METAINFER_GDN_PREFILL METAINFER_MOE_TUNED
    if [[ $mode == gdn* ]]; then export METAINFER_GDN_PREFILL=$GDN; fi
    if [[ $mode == gdn_moe ]]; then export METAINFER_MOE_TUNED=$MOE_TUNED; fi
    timeout 80 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 16 --no-profile \
      --out $OUT/gj_fp8_$mode 2>&1 | grep -E "TTFT" | sed "s/^/[fp8 $mode] /"
  done
  for dt in fp8 bfloat16; do  # both switches on
    timeout 130 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --json $OUT/verify_${dt}_gjudge.json 2>&1 | grep -E "verdict|rel_rmse" | sed "s/^/[$dt] /"
  done
  for mode in gdn_moe default; do
    if [[ $mode == default ]]; then unset METAINFER_GDN_PREFILL METAINFER_MOE_TUNED; fi
    timeout 80 python benchmarks/decode_bench.py --dtype bfloat16 --batches 1 --gen 16 --no-profile \
      --out $OUT/gj_bf16_$mode 2>&1 | grep -E "TTFT" | sed "s/^/[bf16 $mode] /"
  done
fi
if has verify; then
  for v in ${ON:-}; do export $v=1; done
  for dt in fp8 bfloat16; do
    timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --json $OUT/verify_${dt}_pending.json 2>&1 | grep -E "verdict" | sed "s/^/[$dt ${ON:-}] /"
  done
fi
if has bisect; then  # spec_bench script-4 on an exported older tree (REF_TREE: git archive of metainfer, benchmarks)
  (cd $REF_TREE && PYTHONPATH=/tmp/site:$PWD timeout 200 python benchmarks/spec_bench.py --dtype fp8 --gen 64 --reps 3 \
    --script-k 4 --out $OUT/bisect 2>&1 | grep -E "script-4|plain" | sed "s/^/[ref] /")
fi
if has t1out; then  # batch-1 out_proj/o_proj on the T = 2 tensor-core config (benchmarks/tuned/)
  for on in 0 1; do
    sw=(); [[ $on == 1 ]] && sw=(METAINFER_FP8_TUNED=$PWD/benchmarks/tuned/t1_out_proj_tc.json)
    env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 64 --no-profile \
      --out $OUT/t1out$on 2>&1 | grep -E "^\|" | sed "s/^/[t1out=$on] /"
  done
fi
if has nsw; then  # KB-0042..44: the defaults against each new switch off (FP8; fresh processes)
  timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "grouped_rows or moe_rows or prefill_split or grouped or speculative or pdl_equals" 2>&1 | tail -2
  for sw in NONE METAINFER_ALIGN_ROWS METAINFER_MOE_GROUPED_ROWS METAINFER_MOE_BUCKET_ONE; do
    e=(); [[ $sw != NONE ]] && e=($sw=0)
    env "${e[@]}" timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches ${NEWAB_BATCHES:-8,32,64} --gen 32 \
      --no-profile --out $OUT/newab_$sw 2>&1 | grep -E "^\||TTFT" | sed "s/^/[$sw off] /"
  done
fi
if has sgtest; then  # the speculative GPU test with split-KV prefill on and off (its failure shown)
  for on in 1 0; do
    METAINFER_ATTN_PREFILL_SPLIT=$on timeout 150 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider \
      -k "speculative_verify_equals" --tb=short 2>&1 | grep -E "^E |assert|passed|failed" | head -12 | sed "s/^/[split=$on] /"
  done
fi
if has ssm16; then  # --ssm-state-dtype bfloat16 (KB-0046): GPU tests, FP8 decode A/B, the oracle
  timeout 150 python -m pytest -q tests/gpu -p no:cacheprovider -k "bf16_state or compiles" 2>&1 | tail -2
  for st in float32 bfloat16; do
    timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches 1,32,64,128 --gen 32 --no-profile \
      --ssm-state-dtype $st --out $OUT/ssm_$st 2>&1 | grep -E "^\||TTFT" | sed "s/^/[state $st] /"
  done
  for dt in fp8 bfloat16; do
    timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --ssm-state-dtype bfloat16 --json $OUT/verify_${dt}_ssm16.json 2>&1 \
      | grep -E "verdict|decode.rel" | sed "s/^/[$dt state bf16] /"
  done
fi
if has tiediag; then
  T=tests/gpu/test_engine_gpu.py::test_speculative_verify_equals_plain_greedy
  for mode in default pdl_prefill_1 prep_16_8; do
    unset METAINFER_PDL_PREFILL METAINFER_GDN_PREFILL
    [[ $mode == pdl_prefill_1 ]] && export METAINFER_PDL_PREFILL=1
    [[ $mode == prep_16_8 ]] && export METAINFER_GDN_PREFILL=sub_block=16,prep_warps=8
    sel="$T"; [[ $mode == default ]] || sel="$T[None]"
    timeout 150 python -m pytest -q "$sel" -p no:cacheprovider 2>&1 | grep -E "^E .*(part|assert)|passed|failed" \
      | sed "s/^/[spec $mode] /"
  done
  unset METAINFER_PDL_PREFILL METAINFER_GDN_PREFILL
fi
if has nquant; then
  timeout 150 python -m pytest -q tests/gpu -p no:cacheprovider -k "norm_quant or compiles or norm" 2>&1 | tail -2
  VAR=METAINFER_NORM_QUANT MODES="0 1 0 1" DTYPES=fp8 BATCHES=32,64 GEN=16 EXTRA=--no-profile bash benchmarks/gpu_ab.sh
  METAINFER_NORM_QUANT=1 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_nquant.json 2>&1 | grep -E "verdict|rel_rmse"
fi
if has mtp; then  # KB-0060: the checkpoint's MTP layer as the drafter
  timeout 200 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "mtp or speculative" 2>&1 | tail -3
  timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 \
    --device cuda --suite full --speculative mtp --speculative-max-seqs 64 --json $OUT/verify_fp8_mtp.json 2>&1 \
    | grep -E "verdict:|decode.rel" | sed "s/^/[fp8 mtp] /"
  timeout 240 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes mtp,mtp-script --script-k 2,4 --reps 2 \
    --profile mtp-script-4 --profile-gen 64 --out $OUT/mtp 2>&1 | grep -vE "falling back" | tail -40
fi
if has mtp3; then  # after KB-0061/63's removal and the draft vocabulary as an engine option: the MTP and speculative
  # GPU tests, the FP8 oracle with MTP drafts over 32k ids, forced-acceptance K = 4 over the whole / 32k ids, FP8
  # plain decode batches 1 / 8 / 64
  timeout 220 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "mtp or speculative" 2>&1 | tail -2
  timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 \
    --device cuda --suite full --speculative mtp --speculative-max-seqs 64 --speculative-draft-vocab 32768 \
    --json $OUT/verify_fp8_mtp_32k.json 2>&1 | grep -E "verdict:|decode.rel|^speculative" | sed "s/^/[fp8 mtp 32k] /"
  for dv in 0 32768; do
    timeout 150 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes mtp-script --script-k 4 --reps 2 \
      --draft-vocab $dv --out $OUT/mtp3_$dv 2>&1 | grep -E "^\| (plain/r|mtp)|script-.*: " | sed "s/^/[vocab $dv] /"
  done
  timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,64 --gen 64 --no-profile \
    --out $OUT/mtp3_decode 2>&1 | grep -E "^\||TTFT" | sed "s/^/[fp8 plain] /"
fi
if has mtpserve; then  # `metainfer serve --speculative mtp --speculative-draft-vocab 32768` through bench serve (c = 1,
  # idle TTFT, c = 32: drafting pauses while more than one runs), then forced-acceptance K = 3 / 6 over 32k ids
  DTYPE=fp8 TAG=_mtp32k SERVE_ARGS="--speculative mtp --speculative-draft-vocab 32768" bash benchmarks/gpu_serve.sh \
    2>&1 | grep -E "Failed|Output token throughput|Mean TTFT|Mean TPOT|server-side|warmup|slow|Error|error" | head -30
  timeout 150 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes mtp-script --script-k 3,6 --reps 2 \
    --draft-vocab 32768 --out $OUT/mtp_k36 2>&1 | grep -E "^\| (plain/r|mtp)|script-.*: " | sed "s/^/[vocab 32768] /"
fi
if has downids; then  # KB-0059: METAINFER_MOE_DOWN_IDS 0 / 1 (unset: FP8 on, BF16 off)
  timeout 200 python -m pytest -q tests/gpu/test_kernels_b_gpu.py -p no:cacheprovider -k "down_from_ids" 2>&1 | tail -2
  VAR=METAINFER_MOE_DOWN_IDS MODES="0 1 0 1" DTYPES=${DI_DTYPES:-bfloat16} BATCHES=${DI_BATCHES:-2,8} GEN=16 \
    EXTRA=--no-profile bash benchmarks/gpu_ab.sh | grep -v TTFT
fi
if has gswap; then  # METAINFER_MOE_GROUPED_SWAP: the grouped (prefill, batch > 16) GEMMs with the weight tile as the
  # MMA's M side; GPU tests, the sweep (FP8, T = 64 and 1,024: current config unswapped / swapped, then 27 swapped
  # configs), then FP8 decode_bench batch 64 + 1k TTFT on its table vs the committed one
  timeout 240 python -m pytest -q tests/gpu/test_kernels_b_gpu.py -p no:cacheprovider \
    -k "swapped or tma_weights or w8a8_full" 2>&1 | tail -2
  timeout 330 python benchmarks/sweep_decode_kernels.py --grouped-tokens 64,1024 --moe fp8 --grouped-swap \
    --out $OUT/gswap 2>&1 | grep -v "falling back\|skip" | tail -5
  # batches 8 / 16 on the grouped path (bucketed: an expert drawn by several tokens streamed once) swapped, with
  # 16-row blocks, against the per-pair default
  for m in pair gswap; do
    sw=(); [[ $m == gswap ]] && sw=(METAINFER_MOE_PAIR_MAX_T=4 METAINFER_MOE_GROUPED_SWAP=1)
    env "${sw[@]}" timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 8,16 --gen 16 --no-profile \
      --out $OUT/gswap_small_$m 2>&1 | grep -E "^\| *(8|16) " | sed "s/^/[$m] /"
  done
  for m in 0 1 0 1; do
    sw=(); [[ $m == 1 ]] && sw=(METAINFER_MOE_TUNED=$OUT/gswap/moe_pair_tuned.json)
    env "${sw[@]}" timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches 64 --gen 16 --no-profile \
      --out $OUT/gswap_ab$m 2>&1 | grep -E "^\| *64|TTFT" | sed "s/^/[swept=$m] /"
  done
fi
if has host; then  # the verify step's host work (stacked DeltaNet states: 2 snapshot copies, not 60; the prefill
  # graphs' inputs in 2 staged copies, not 5) against REF_TREE, interleaved; then with the routing in gate/up
  # at T = 5 and the swept BF16 router at T = 3, 5 (benchmarks/tuned/router_t3_t5.json)
  timeout 200 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider \
    -k "speculative or prefill_graph or graph_replay" 2>&1 | tail -2
  SB="python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes script --script-k 4 --reps 2"
  for rep in 1 2; do
    (cd $REF_TREE && PYTHONPATH=/tmp/site:$PWD timeout 90 $SB --out $OUT/host_ref$rep 2>&1 \
      | grep -E "^\| script|script-4/random: " | sed "s/^/[ref $rep] /")
    timeout 90 $SB --out $OUT/host_new$rep 2>&1 | grep -E "^\| script|script-4/random: " | sed "s/^/[new $rep] /"
    METAINFER_MOE_ROUTED_MAX_T=5 METAINFER_FP8_TUNED=$PWD/benchmarks/tuned/router_t3_t5.json timeout 90 $SB \
      --out $OUT/host_rr$rep 2>&1 | grep -E "^\| script|script-4/random: " | sed "s/^/[new+rr $rep] /"
  done
fi
if has host2; then  # the host A/B again (ref, new alternating, 5 processes), then PDL-off kernel profiles of the
  # verify step: the defaults, + routing in gate/up at T = 5 and the swept router (rr), + KB-0053 (gpre)
  SB="python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes script --script-k 4"
  for run in new1 ref1 new2 ref2 new3; do
    if [[ $run == ref* ]]; then
      (cd $REF_TREE && PYTHONPATH=/tmp/site:$PWD timeout 90 $SB --reps 2 --out $OUT/h2_$run 2>&1 \
        | grep -E "script-4/random: " | sed "s/^/[$run] /")
    else
      timeout 90 $SB --reps 2 --out $OUT/h2_$run 2>&1 | grep -E "script-4/random: " | sed "s/^/[$run] /"
    fi
  done
  RR=(METAINFER_MOE_ROUTED_MAX_T=5 METAINFER_FP8_TUNED=$PWD/benchmarks/tuned/router_t3_t5.json)
  for mode in base rr gpre; do
    sw=(METAINFER_PDL=0)
    case $mode in rr) sw+=("${RR[@]}") ;; gpre) sw+=(METAINFER_GDN_RECURRENT_PRELOAD=1) ;; esac  # gpre: removed since
    env "${sw[@]}" timeout 100 $SB --reps 1 --profile script-4 --profile-gen 128 --out $OUT/h2_prof_$mode 2>&1 \
      | grep -E "script-4/random: " | sed "s/^/[prof $mode] /"
  done
fi
if has vstep; then
  timeout 120 python -m pytest -q tests/gpu/test_gdn_prefill_gpu.py -k "recurrent" -p no:cacheprovider 2>&1 | tail -2
  SB="python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes script --script-k 4"
  METAINFER_PDL=0 timeout 100 $SB --reps 1 --profile script-4 --profile-gen 128 --out $OUT/vstep_profile 2>&1 \
    | grep -A21 "^\[script-4\] kernels" | sed "s/^/[profile] /"
  timeout 200 python benchmarks/sweep_decode_kernels.py --linears= --moe= --bf16-linears moe.router --tokens 3,5 \
    --out $OUT/vsweep 2>&1 | grep -v "falling back\|skip" | tail -4
  VT=$OUT/vsweep/fp8_skinny_tuned.json
  for mode in base routed5 router gpre all; do
    sw=()
    case $mode in
      routed5) sw=(METAINFER_MOE_ROUTED_MAX_T=5) ;;
      router) sw=(METAINFER_FP8_TUNED=$VT) ;;
      gpre) sw=(METAINFER_GDN_RECURRENT_PRELOAD=1) ;;
      all) sw=(METAINFER_MOE_ROUTED_MAX_T=5 METAINFER_FP8_TUNED=$VT METAINFER_GDN_RECURRENT_PRELOAD=1) ;;
    esac
    env "${sw[@]}" timeout 90 $SB --reps 2 --out $OUT/vstep_$mode 2>&1 | grep -E "^\| script|script-4/random: " \
      | sed "s/^/[$mode] /"
  done
fi
if has nrouter; then
  timeout 240 python -m pytest -q tests/gpu -p no:cacheprovider -k "norm_router or compiles or pdl_equals" 2>&1 \
    | tee $OUT/gpu_tests_nrouter.log | tail -3
  VAR=METAINFER_NORM_ROUTER_MAX_T MODES="0 8 0 8" DTYPES=fp8 BATCHES=1,2,4,8 EXTRA=--no-profile \
    bash benchmarks/gpu_ab.sh | grep -v TTFT
  VAR=METAINFER_NORM_ROUTER_MAX_T MODES="0 8" DTYPES=bfloat16 BATCHES=1,8 EXTRA=--no-profile \
    bash benchmarks/gpu_ab.sh | grep -v TTFT
  METAINFER_PDL=0 timeout 120 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 \
    --out $OUT/nrouter_prof_pdl0 2>&1 | grep -v "falling back" | grep -E "^\|" | head -24
fi
if has nrverify; then
  for dt in fp8 bfloat16; do
    timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --json $OUT/verify_$dt.json 2>&1 | grep -E "verdict|PASS|FAIL" | tail -3 \
      | sed "s/^/[$dt oracle] /"
  done
  timeout 300 python benchmarks/spec_bench.py --dtype fp8 --gen 256 --reps 2 --modes script --script-k 4,8,15 \
    --out $OUT/nrverify_spec 2>&1 | grep -v "falling back" | tail -12
fi
if has gnorm; then
  timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider -k "gated_norm_linear" 2>&1 \
    | tee $OUT/gpu_tests_gnorm.log | tail -3
  for run in "fp8 0 -" "fp8 4 -" "fp8 4 16,16,8" "fp8 4 8,32,4" "fp8 4 32,32,8" "bfloat16 0 -" "bfloat16 4 -"; do
    set -- $run
    cfg=$3; [[ $cfg == - ]] && cfg=""
    METAINFER_GNORM_MAX_T=$2 METAINFER_GNORM_CFG=$cfg timeout 90 python benchmarks/decode_bench.py --dtype $1 \
      --batches $([[ $1 == fp8 ]] && echo 1,2,4 || echo 1) --gen 32 --no-profile \
      --out $OUT/gnorm_${1}_${2}_$(echo ${cfg:-default} | tr , _) \
      2>&1 | grep -E "^\|" | grep -v "batch" | sed "s/^/[$1 gnorm $2 cfg ${cfg:-default}] /"
  done
fi

if has wgearly; then  # (2026-12-04g: neutral, KB-0102) gemv.cu's pre prologue with its residual / norm weight /
  # routing weights loaded before the PDL wait and the 9 rows in one wave of loads (-DGEMV_PRE_EARLY=1 through
  # METAINFER_WGMMA_GEMV_DEFINES): the gemv GPU tests and the engine's PDL / graph tests with it, FP8 batch 1
  # default / early alternating x REPS (3), the oracle (FP8) with it, ~6 min
  EARLY="-DGEMV_PRE_EARLY=1"
  METAINFER_WGMMA_GEMV_DEFINES=$EARLY timeout 200 python -m pytest -q tests/gpu/test_gemv_gpu.py -p no:cacheprovider \
    2>&1 | tail -2
  METAINFER_WGMMA_GEMV_DEFINES=$EARLY timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "pdl_equals or graph_replay_equals_eager" 2>&1 | tail -2
  for r in $(seq ${REPS:-3}); do
    for m in 0 1; do
      env METAINFER_WGMMA_GEMV_DEFINES="$([[ $m == 1 ]] && echo $EARLY)" timeout 90 python benchmarks/decode_bench.py \
        --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/wgearly_${m}_$r 2>&1 | grep -E "^\| 1 " \
        | sed "s/^/[wgearly $m $r] /"
    done
  done
  METAINFER_WGMMA_GEMV_DEFINES=$EARLY timeout 150 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_wgearly.json 2>&1 | grep -E "verdict" | head -1
fi
if has gdnpre; then  # KB-0021's DeltaNet state read before the PDL wait (neutral then, beside the Triton in_proj;
  # 2026-12-04g: +2 %, the default now, KB-0100),
  # again beside gemv.cu's in_proj + conv (METAINFER_GDN_PRELOAD 0 / 1 alternating x REPS (3)), ~3 min
  ab_bs1 METAINFER_GDN_PRELOAD gdnpre ${REPS:-3}
fi
if has bf16ab; then  # (built 2026-12-04g) BF16 batch 1 with KB-0100's state preload and KB-0101's reduce each off
  # against the defaults (both measured in FP8 only; BF16 read 404.7 after them, 408.7 before), alternating x REPS (2)
  for r in $(seq ${REPS:-2}); do
    for m in def gdn0 red0; do
      sw=(); [[ $m == gdn0 ]] && sw=(METAINFER_GDN_PRELOAD=0)
      [[ $m == red0 ]] && sw=(METAINFER_ATTN_REDUCE_ACTIVE=0 METAINFER_ATTN_DECODE=reduce_chunk=16)
      env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype bfloat16 --batches 1 --gen 32 --no-profile \
        --out $OUT/bf16ab_${m}_$r 2>&1 | grep -E "^\| 1 " | sed "s/^/[bf16 $m $r] /"
    done
  done
fi
if has switches; then  # FP8 batch 1: the defaults and each of SWITCHES (space-separated VAR=VALUE; a comma joins
  # several into one mode: "A=1,B=2") in turn, x REPS (2) rounds, fresh processes; then each mode's median, ~45 s a run
  modes_ab switches sw default ${SWITCHES:-METAINFER_WGMMA_GEMV_SLOTS=2 METAINFER_WGMMA_GEMV_SLOTS=6}  # (even rings)
fi
if has oproj; then  # (2026-12-04g) KB-0066 again: the attention o_proj at batch 1 on the one-wave preloading GEMV
  # (slower then, beside the Triton qkv; gdnpre's switch turned from neutral to +2 % beside gemv.cu), FP8 x REPS (3)
  for r in $(seq ${REPS:-3}); do
    for m in 0 1; do
      env METAINFER_FP8_TUNED=$([[ $m == 1 ]] && echo benchmarks/tuned/oproj_gemv_t1.json) timeout 90 python \
        benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/oproj_${m}_$r 2>&1 \
        | grep -E "^\| 1 " | sed "s/^/[oproj $m $r] /"
    done
  done
fi
if has glue; then  # (built 2026-12-04h) the decode graph's glue inside the graph (kernels.decode_io: the pending
  # token and the lengths in one launch, the greedy argmax on the bf16 logits) against the build at BASE (6382c13, a
  # git worktree): the GPU tests, FP8 batch 1 base / new alternating x REPS (3) in fresh processes, the oracle (FP8)
  timeout 200 python -m pytest -q tests/gpu/test_kernels_b_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider \
    -k "decode_io or graph or pending or async" 2>&1 | tail -2
  rm -rf /tmp/base && git worktree add -f /tmp/base ${BASE:-6382c13} >/dev/null 2>&1 || echo "[glue] no worktree"
  for r in $(seq ${REPS:-3}); do
    for m in base new; do
      (cd $([[ $m == base ]] && echo /tmp/base || echo $PWD) && PYTHONPATH=$PWD:/tmp/site timeout 90 python \
        benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/glue_${m}_$r 2>&1 \
        | grep -E "^\| 1 " | sed "s/^/[glue $m $r] /")
    done
  done
  (cd $OUT && tar czf glue.tgz glue_* && rm -rf glue_*)
  timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 \
    --device cuda --suite full --json $OUT/verify_fp8_glue.json 2>&1 | grep -E "verdict" | head -1
fi
if has onepass; then  # (built 2026-12-04g, not yet run) the DeltaNet decode step with every operand loaded before
  # any reduction and its reductions independent of each other (METAINFER_GDN_ONEPASS=1; the short-chunk loop too):
  # the gdn GPU tests with it, FP8 batch 1 0 / 1 alternating x REPS (3), the oracle (FP8) with it, ~5 min
  METAINFER_GDN_ONEPASS=1 timeout 150 python -m pytest -q tests/gpu/test_kernels_a_gpu.py tests/gpu/test_gdn_prefill_gpu.py \
    -p no:cacheprovider -k "gdn" 2>&1 | tail -2
  ab_bs1 METAINFER_GDN_ONEPASS onepass ${REPS:-3}
  METAINFER_GDN_ONEPASS=1 timeout 150 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_onepass.json 2>&1 | grep -E "verdict" | head -1
fi
if has gdnfuse; then  # (built 2026-12-04i on the CPU, not yet run) the DeltaNet decode step inside the in_proj's
  # launch (mega/gemv.cu's gemv_e4m3_pre_gdn, METAINFER_WGMMA_GEMV_GDN=1): its GPU tests (the kernel against the two
  # launches over 3 steps, graph replay, the engine's tokens); only if they pass: FP8 batch 1 0 / 1 alternating x
  # REPS (3), the oracle (FP8) with it, the exposed profile with it, and GDN_WAVES (e.g. "3 5") as A/Bs, ~7 min
  if fusion_tests gdnfuse "gdn" "gemv_fusions and gdn"; then
    ab_bs1 METAINFER_WGMMA_GEMV_GDN gdnfuse ${REPS:-3}
    METAINFER_WGMMA_GEMV_GDN=1 timeout 150 python -m metainfer.cli verify \
      --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
      --json $OUT/verify_fp8_gdnfuse.json 2>&1 | grep -E "verdict" | head -1
    METAINFER_WGMMA_GEMV_GDN=1 timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 \
      --out $OUT/gdnfuse_exposed 2>&1 | sed -n '/wall time by kernel/,$p' | head -12 | sed "s/^/[gdnfuse exposed] /"
    for w in ${GDN_WAVES:-}; do
      METAINFER_WGMMA_GEMV_GDN=1 METAINFER_WGMMA_GEMV_GDN_WAVES=$w timeout 90 python benchmarks/decode_bench.py \
        --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/gdnfuse_waves_$w 2>&1 | grep -E "^\| 1 " \
        | sed "s/^/[gdnfuse waves $w] /"
    done
  else
    echo "[gdnfuse] GPU tests failed: no A/B (see gdnfuse_tests.log)"
  fi
fi
if has moedown; then  # (built 2026-12-04i on the CPU, not yet run) the experts' down inside the gate/up's launch
  # (mega/gemv.cu's moe_gate_up_down_e4m3, METAINFER_WGMMA_GEMV_MOE_DOWN=1): its GPU tests; only if they pass: FP8
  # batch 1 0 / 1 alternating x REPS (3), the oracle (FP8) with it, ~7 min
  if fusion_tests moedown "moe_gate_up_down" "gemv_fusions and moe_down"; then
    ab_bs1 METAINFER_WGMMA_GEMV_MOE_DOWN moedown ${REPS:-3}
    METAINFER_WGMMA_GEMV_MOE_DOWN=1 timeout 150 python -m metainfer.cli verify \
      --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
      --json $OUT/verify_fp8_moedown.json 2>&1 | grep -E "verdict" | head -1
  else
    echo "[moedown] GPU tests failed: no A/B (see moedown_tests.log)"
  fi
fi
if has fusions; then  # (2026-12-05: gdnfuse, moedown and fusedboth's A/Bs in one call) each fusion's GPU tests in
  # processes of their own (a trap ends its process's context, not the other's; gemv.cu's watchdog report is in the
  # log); then FP8 batch 1 with none, each fusion whose tests passed, and both, in turn x REPS (2), ~8 min.
  # The oracle and the profile of the winner: PHASES=fusverify ON="VAR ..." (~3 min).
  ok=()
  for f in "gdn METAINFER_WGMMA_GEMV_GDN gdn gdn" "moedown METAINFER_WGMMA_GEMV_MOE_DOWN moe_gate_up_down moe_down"; do
    set -- $f
    if fusion_tests $1 "$3" "gemv_fusions and $4"; then ok+=("$2=1"); else echo "[fusions] $1: GPU tests failed"; fi
  done
  modes=(default "${ok[@]}")
  [ ${#ok[@]} = 2 ] && modes+=("${ok[0]},${ok[1]}")
  modes_ab fusions fus "${modes[@]}"
fi
if has nextl2; then  # (KB-0110, built 2026-12-05 on the CPU, not yet run) the experts' launch prefetching the next
  # layer's first projection into L2 (METAINFER_WGMMA_GEMV_NEXT_L2 chunks a CTA): its GPU tests (a hint: the same
  # bits), then FP8 batch 1 at 0 and each of NEXT_L2S (2 4) in turn x REPS (2), BASE's switches on in every mode
  # (e.g. BASE=METAINFER_WGMMA_GEMV_MOE_DOWN=1, whose CTAs the next projection's cannot sit beside), ~5 min
  if fusion_tests nextl2 "next_l2" "gemv_fusions and next_l2"; then
    switch_ab next_l2 METAINFER_WGMMA_GEMV_NEXT_L2 "0 ${NEXT_L2S:-2 4}" nl2
  else
    echo "[nextl2] GPU tests failed: no A/B (see nextl2_tests.log)"
  fi
fi
if has router; then  # (KB-0111, built 2026-12-05 on the CPU, not yet run) the post-mixer add + RMSNorm and the router
  # inside the experts' launch (METAINFER_WGMMA_GEMV_MOE_ROUTER=1; with the down fused: BASE gets
  # METAINFER_WGMMA_GEMV_MOE_DOWN=1 and whatever else it holds): its GPU tests, then 0 / 1 in turn x REPS (2), then
  # the oracle with both switches, ~6 min
  if fusion_tests router "moe_router" "gemv_fusions and moe_router"; then
    BASE="METAINFER_WGMMA_GEMV_MOE_DOWN=1 ${BASE:-}" switch_ab router METAINFER_WGMMA_GEMV_MOE_ROUTER "0 1" rt
    METAINFER_WGMMA_GEMV_MOE_DOWN=1 METAINFER_WGMMA_GEMV_MOE_ROUTER=1 timeout 150 python -m metainfer.cli verify \
      --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
      --json $OUT/verify_fp8_router.json 2>&1 | grep -E "verdict" | head -1
  else
    echo "[router] GPU tests failed: no A/B (see router_tests.log)"
  fi
fi
if has reduceearly; then  # (KB-0112, built 2026-12-05 on the CPU, not yet run) the decode attention reduce releasing
  # the o_proj before its PDL wait (METAINFER_ATTN_REDUCE_EARLY=1): the engine's logits with it on and off, then
  # 0 / 1 in turn x REPS (2) with BASE, ~4 min
  timeout 200 python -m pytest -q -x tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "gemv_fusions and reduce_early" \
    2>&1 | tee $OUT/reduceearly_tests.log | grep -E "passed|failed|rror" | tail -2
  if grep -q " passed" $OUT/reduceearly_tests.log && ! grep -qE "[0-9]+ (failed|errors?)\b" $OUT/reduceearly_tests.log; then
    switch_ab reduce_early METAINFER_ATTN_REDUCE_EARLY "0 1" re
  else
    echo "[reduceearly] GPU test failed: no A/B (see reduceearly_tests.log)"
  fi
fi
if has moeslots; then  # (KB-0113, built 2026-12-05 on the CPU, not yet run) the experts' launches with their own
  # 6-slot ring (METAINFER_WGMMA_GEMV_MOE_SLOTS; the rest keep 4): its GPU test (the same bits), then 4 / 6 in turn
  # x REPS (2) with BASE, ~4 min
  timeout 120 python -m pytest -q -x tests/gpu/test_gemv_gpu.py -p no:cacheprovider -k "own_ring" 2>&1 \
    | tee $OUT/moeslots_tests.log | grep -E "passed|failed|rror" | tail -2
  if grep -q " passed" $OUT/moeslots_tests.log && ! grep -qE "[0-9]+ (failed|errors?)\b" $OUT/moeslots_tests.log; then
    switch_ab moe_slots METAINFER_WGMMA_GEMV_MOE_SLOTS "4 6" ms
  else
    echo "[moeslots] GPU test failed: no A/B (see moeslots_tests.log)"
  fi
fi
if has bf16gemv; then  # (KB-0114, built 2026-12-05 on the CPU, not yet run) the BF16 model's qkv / in_proj with their
  # input norm on gemv.cu (gemv_bf16_pre, METAINFER_WGMMA_GEMV_BF16=1): its GPU tests, then BF16 batch 1 0 / 1 in turn
  # x REPS (2), then the oracle (BF16) with it, ~6 min
  if fusion_tests bf16gemv "bf16" "gemv_fusions and bf16_gemv"; then
    AB_DTYPE=bfloat16 switch_ab bf16_gemv METAINFER_WGMMA_GEMV_BF16 "0 1" bg
    METAINFER_WGMMA_GEMV_BF16=1 timeout 150 python -m metainfer.cli verify \
      --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype bfloat16 --device cuda --suite full \
      --json $OUT/verify_bf16_gemv.json 2>&1 | grep -E "verdict" | head -1
  else
    echo "[bf16gemv] GPU tests failed: no A/B (see bf16gemv_tests.log)"
  fi
fi
if has fusverify; then  # the oracle (FP8) with ON's switches at 1, then the batch-1 step's wall time by kernel and
  # batch 8 with them, ~3 min
  sw=(); for v in ${ON:-METAINFER_WGMMA_GEMV_GDN METAINFER_WGMMA_GEMV_MOE_DOWN}; do sw+=("$v=1"); done
  env "${sw[@]}" timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_fusions.json 2>&1 | grep -E "verdict" | head -1
  env "${sw[@]}" timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8 --gen 32 \
    --out $OUT/fusions_exposed 2>&1 | sed -n '/wall time by kernel/,$p' | head -14 | sed "s/^/[fusions exposed] /"
  python -m metainfer.bench.critical_path $OUT/fusions_exposed/decode_bench_fp8.json | sed "s/^/[fusions layers] /"
fi
if has fusedboth; then  # (after gdnfuse and moedown passed) both fusions on against both off, alternating x REPS
  # (2), then the exposed profile (batch 1) and batch 8 with both, ~5 min
  for r in $(seq ${REPS:-2}); do
    for m in 0 1; do
      env METAINFER_WGMMA_GEMV_MOE_DOWN=$m METAINFER_WGMMA_GEMV_GDN=$m timeout 90 python benchmarks/decode_bench.py \
        --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/both_${m}_$r 2>&1 | grep -E "^\| 1 " \
        | sed "s/^/[both $m $r] /"
    done
  done
  METAINFER_WGMMA_GEMV_MOE_DOWN=1 METAINFER_WGMMA_GEMV_GDN=1 timeout 100 python benchmarks/decode_bench.py \
    --dtype fp8 --batches 1,8 --gen 32 --out $OUT/both_exposed 2>&1 | sed -n '/wall time by kernel/,$p' \
    | head -12 | sed "s/^/[both exposed] /"
fi
if has exposed; then  # (2026-12-04g) the FP8 batch-1 step's wall time by kernel with PDL on
  # (decode_bench's exposed_bs1: each kernel's time past every earlier kernel's end), at decode_bench's
  # max_model_len and the server's 8,192; the kernels' durations PDL-off beside it, ~2 min
  for mml in 0 8192; do
    timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --max-model-len $mml \
      --out $OUT/exposed_$mml 2>&1 | sed -n '/wall time by kernel/,$p' | head -18 | sed "s/^/[mml $mml] /"
  done
fi
if has reduce; then  # (2026-12-04g: the default now, KB-0101) the decode attention reduce over the splits with keys
  # only (METAINFER_ATTN_REDUCE_ACTIVE 0 / 1, reduce_chunk 16 / 32): its GPU tests, then FP8 batch 1 at the server's
  # max_model_len (8,192: 128 splits, 17 with keys at 1k) and at decode_bench's (1,120: 18 splits), ~5 min
  timeout 150 python -m pytest -q tests/gpu/test_kernels_a_gpu.py -p no:cacheprovider \
    -k "paged_attention or decode_configs or compile" 2>&1 | tail -2
  for r in $(seq ${REPS:-2}); do
    for mode in "0 reduce_chunk=16" "1 reduce_chunk=16" "1 "; do  # the old reduce; active, chunk 16; the defaults
      set -- $mode
      for mml in 8192 0; do
        METAINFER_ATTN_REDUCE_ACTIVE=$1 METAINFER_ATTN_DECODE=${2:-} timeout 90 python benchmarks/decode_bench.py \
          --dtype fp8 --batches 1 --gen 32 --no-profile --max-model-len $mml \
          --out $OUT/reduce_${1}_${2:+c16}_${mml}_$r 2>&1 | grep -E "^\| 1 " | sed "s/^/[reduce $mode mml $mml $r] /"
      done
    done
  done
  (cd $OUT && tar czf reduce.tgz reduce_* && rm -rf reduce_*)  # 12 JSONs: one file back
fi
if has downsweep; then  # (2026-12-04f) the experts' down at batch 1 over DOWNS (PRELOAD_BLOCK_H:DOWN_WARPS; "table": the
  # committed one), alternating x REPS (2); the oracle (FP8) with the best where it beats the table's by > 0.5 %, ~5 min
  for r in $(seq ${REPS:-2}); do
    for dn in ${DOWNS:-table 128:4 128:8 64:8}; do
      [[ $dn != table ]] && down_table $dn /tmp/down_$dn.json
      env METAINFER_MOE_TUNED=$([[ $dn != table ]] && echo /tmp/down_$dn.json) timeout 90 python \
        benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/dsw_${dn/:/_}_$r 2>&1 \
        | grep -E "^\| 1 " | sed "s/^/[down $dn $r] /"
    done
  done
  best=$(python3 -c "
import glob, json, statistics as st
med = {f.split('/')[-2][4:-2]: [] for f in glob.glob('$OUT/dsw_*/*.json')}
for f in glob.glob('$OUT/dsw_*/*.json'):
    med[f.split('/')[-2][4:-2]].append(json.load(open(f))['decode'][0]['decode_tok_s'])
med = {k: st.median(v) for k, v in med.items()}
print({k: round(v, 1) for k, v in med.items()}, file=__import__('sys').stderr)
k = max(med, key=med.get)
print(k.replace('_', ':') if k != 'table' and med[k] > 1.005 * med['table'] else '')")
  if [[ -n $best ]]; then
    echo "[down] best $best: the oracle with it"
    METAINFER_MOE_TUNED=/tmp/down_$best.json timeout 150 python -m metainfer.cli verify \
      --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
      --json $OUT/verify_fp8_down_${best/:/_}.json 2>&1 | grep -E "verdict" | head -1
  fi
fi
if has downab; then  # (2026-12-04f) the experts' down at batch 1, PRELOAD_BLOCK_H:DOWN_WARPS = $DOWN (64:4) against
  # the table's (32:2), alternating x REPS (3); where it wins by > 0.5 % (medians), METAINFER_MOE_TUNED stays set
  # for the phases after it (final1: the oracle and the defaults' table with it), ~3 min
  down_table ${DOWN:-64:4} /tmp/down.json
  for r in $(seq ${REPS:-3}); do
    for m in 0 1; do
      env METAINFER_MOE_TUNED=$([[ $m == 1 ]] && echo /tmp/down.json) timeout 90 python benchmarks/decode_bench.py \
        --dtype fp8 --batches 1 --gen 32 --no-profile --out $OUT/downab_${m}_$r 2>&1 | grep -E "^\| 1 " \
        | sed "s/^/[down ${DOWN:-64:4} $m $r] /"
    done
  done
  if python3 -c "
import glob, json, statistics as st
med = [st.median(json.load(open(f))['decode'][0]['decode_tok_s'] for f in glob.glob('$OUT/downab_%d_*/*.json' % m))
       for m in (0, 1)]
print('down medians', med)
raise SystemExit(0 if med[1] > 1.005 * med[0] else 1)"; then
    export METAINFER_MOE_TUNED=/tmp/down.json && cp /tmp/down.json $OUT/down_table.json && echo "[down] kept for what follows"
  fi
fi
if has final1; then
  [[ ${FINAL_GEMV:-0} == 1 ]] && timeout 200 python -m pytest -q tests/gpu/test_gemv_gpu.py tests/gpu/test_kernels_b_gpu.py \
    -p no:cacheprovider -k "gemv or moe_routed_rows or conv" 2>&1 | tail -2
  [[ ${FINAL_TESTS:-1} == 1 ]] && timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "pdl_equals or graph_replay_equals_eager" 2>&1 | tee $OUT/gpu_tests_final1.log | tail -2
  for dt in fp8 bfloat16; do
    timeout 200 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype $dt \
      --device cuda --suite full --json $OUT/verify_$dt.json 2>&1 | grep -v "falling back" > $OUT/verify_$dt.log
    tail -3 $OUT/verify_$dt.log | sed "s/^/[$dt oracle] /"
  done
  timeout 150 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,32,64,128 --gen 32 --out $OUT/final1 2>&1 \
    | grep -v "falling back" | grep -E "^\|" | head -40
  timeout 150 python benchmarks/decode_bench.py --dtype bfloat16 --batches ${FINAL_BF16_BATCHES:-1} --gen 32 --no-profile \
    --out $OUT/final1 2>&1 | grep -E "^\|" | grep -v batch  # FINAL_BF16_BATCHES=1,8,32,64,128: all (~2 min)
fi

if has prof1; then
  for dt in fp8 bfloat16; do
    METAINFER_PDL=0 timeout 80 python benchmarks/decode_bench.py --dtype $dt --batches 1 --gen 32 --out $OUT/prof1_pdl0 \
      2>&1 | grep -E "^\|" | head -24 | sed "s/^/[$dt PDL off] /"
  done
fi

if has head; then
  HD=$OUT/sweep_head
  timeout 200 python benchmarks/sweep_decode_kernels.py --space base --linears lm_head --moe= --tokens 1,8 \
    --out $HD/base 2>&1 | grep -v "falling back\|skip" | tail -3 | sed "s/^/[lm_head base] /"
  METAINFER_FP8_TUNED=$HD/base/fp8_skinny_tuned.json timeout 200 python benchmarks/sweep_decode_kernels.py \
    --space gemv --linears lm_head --moe= --tokens 1,8 --out $HD/gemv 2>&1 | grep -v "falling back\|skip" | tail -3 \
    | sed "s/^/[lm_head gemv] /"
  python - $HD <<'PY'
import json, sys
d = sys.argv[1]
base, gemv = (json.load(open(f"{d}/{s}/fp8_skinny_tuned.json")) for s in ("base", "gemv"))
json.dump(dict(base, configs={**base["configs"], **gemv["configs"]}), open(f"{d}/head_tuned.json", "w"), indent=1)
print("[lm_head table]", sorted({**base["configs"], **gemv["configs"]}))
PY
  for mode in bf16 swept heur bf16 swept; do
      sw=(); [[ $mode != bf16 ]] && sw=(METAINFER_FP8_LM_HEAD=1)
      [[ $mode == swept ]] && sw+=(METAINFER_FP8_TUNED=$HD/head_tuned.json)
      env "${sw[@]}" timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,32 --gen 32 --no-profile \
        --out $OUT/head_${mode}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[head $mode] /"
  done
  METAINFER_FP8_LM_HEAD=1 METAINFER_FP8_TUNED=$HD/head_tuned.json timeout 200 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_head.json 2>&1 | grep -E "verdict|decode" | tail -3 | sed "s/^/[fp8 head swept] /"
fi
if has gprof; then
  for m in 1 16; do
    METAINFER_PDL=0 METAINFER_GNORM_MAX_T=$m timeout 100 python benchmarks/decode_bench.py --dtype fp8 --batches 4 \
      --profile-batch 4 --gen 32 --out $OUT/gprof_decode4_$m 2>&1 | grep -E "^\|" | head -14 | sed "s/^/[bs4 gnorm $m] /"
    METAINFER_PDL=0 METAINFER_GNORM_MAX_T=$m timeout 100 python benchmarks/spec_bench.py --dtype fp8 --gen 128 \
      --modes script --script-k 4 --reps 1 --profile script-4 --profile-gen 128 --out $OUT/gprof_verify_$m 2>&1 \
      | grep -A14 "^\[script-4\] kernels" | sed "s/^/[verify gnorm $m] /"
  done
fi
if has gnorm2b; then
  timeout 100 python -m pytest -q tests/gpu -p no:cacheprovider -k "gated_norm_linear" 2>&1 | tail -1
  for m in 1 16 1 16; do
    METAINFER_GNORM_MAX_T=$m timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,2,4,8 --gen 32 \
      --no-profile --out $OUT/gnorm2b_${m}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[gnorm $m] /"
  done
  for m in 1 16; do
    METAINFER_GNORM_MAX_T=$m timeout 100 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --reps 2 --modes script \
      --script-k 4 --out $OUT/gnorm2b_spec_$m 2>&1 | grep -E "^\| script" | sed "s/^/[gnorm $m] /"
  done
  METAINFER_GNORM_MAX_T=16 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_gnorm16.json 2>&1 | grep -E "verdict" | head -1 \
    | sed "s/^/[fp8 gnorm 16] /"
fi
if has gnorm2; then
  timeout 240 python -m pytest -q tests/gpu -p no:cacheprovider -k "gated_norm_linear or compiles" 2>&1 \
    | tee $OUT/gpu_tests_gnorm2.log | tail -3
  for run in "fp8 1 - 1,2,4,8,16" "fp8 16 - 1,2,4,8,16" "fp8 1 - 1,2,4,8,16" "fp8 16 - 1,2,4,8,16" \
             "fp8 16 16,8,8 2,4,8" "fp8 16 32,16,8 2,4,8" "bfloat16 1 - 1,2,8" "bfloat16 16 - 1,2,8"; do
    set -- $run
    cfg=$3; [[ $cfg == - ]] && cfg=""
    METAINFER_GNORM_MAX_T=$2 METAINFER_GNORM_CFG=$cfg timeout 90 python benchmarks/decode_bench.py --dtype $1 \
      --batches $4 --gen 32 --no-profile --out $OUT/gnorm2_${1}_${2}_$(echo ${cfg:-default} | tr , _) \
      2>&1 | grep -E "^\|" | grep -v "batch" | sed "s/^/[$1 gnorm $2 cfg ${cfg:-default}] /"
  done
  for m in 1 16; do
    METAINFER_GNORM_MAX_T=$m timeout 150 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --reps 2 --modes script \
      --script-k 4 --out $OUT/gnorm2_spec_$m 2>&1 | grep -E "^\| script|lone-prefill" | sed "s/^/[gnorm $m] /"
  done
fi
if has probe; then  # batch-1 routed experts against a plain read of the same bytes (benchmarks/moe_bs1_probe.py), ~4 min
  timeout 420 python benchmarks/moe_bs1_probe.py --out $OUT/probe 2>&1 | grep -vE "^gate_up route|^down BLOCK" | tail -30
fi
if has mtp4; then  # the MTP / speculative GPU tests at today's defaults, then MTP forced acceptance K = 4 over 32k ids
  # with the FP8 lm_head (its draft slice: e4m3 rows + scale blocks, KB-0067) against the BF16 head, ~4 min
  timeout 220 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "mtp or speculative" 2>&1 | tail -2
  for head in 0 1; do
    METAINFER_FP8_LM_HEAD=$head timeout 150 python benchmarks/spec_bench.py --dtype fp8 --gen 128 --modes mtp-script \
      --script-k 4 --reps 2 --draft-vocab 32768 --out $OUT/mtp4_head$head 2>&1 \
      | grep -E "^\| (plain/r|mtp)|script-.*: " | sed "s/^/[fp8 head $head] /"
  done
  for head in 0 1; do  # plain decode at the committed tables, BF16 and FP8 lm_head
    METAINFER_FP8_LM_HEAD=$head timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,2,4,8 --gen 32 \
      --no-profile --out $OUT/mtp4_decode_head$head 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[head $head] /"
  done
fi
if has topk; then  # METAINFER_ROUTE_TOPK 0 / 1: the routing's picks by argmax rounds or one bitonic top-k of packed keys:
  # the probe's gate/up + down (base tiles; the gate/up tile sweep with top-k), FP8 decode batches 1-8 alternating, the
  # FP8 oracle with top-k, ~6 min
  METAINFER_ROUTE_TOPK=0 timeout 100 python benchmarks/moe_bs1_probe.py --parts gate_up,down --quick \
    --out $OUT/topk_probe_0 2>&1 | tail -7 | sed "s/^/[topk 0] /"
  METAINFER_ROUTE_TOPK=1 timeout 200 python benchmarks/moe_bs1_probe.py --parts gate_up,down \
    --out $OUT/topk_probe_1 2>&1 | tail -7 | sed "s/^/[topk 1] /"
  for m in 0 1 0 1; do
    METAINFER_ROUTE_TOPK=$m timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,2,4,8 --gen 32 \
      --no-profile --out $OUT/topk_${m}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[topk $m] /"
  done
  METAINFER_ROUTE_TOPK=1 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_topk.json 2>&1 | grep -E "verdict" | head -1 \
    | sed "s/^/[fp8 topk] /"
fi
if has epick; then  # the routing's picks on the softmax numerators (any warp count picks the same experts): the probe's
  # gate/up + down tile sweep at batch 1 (its best as the "fp8,1" pair config, the down kernel's warps its own), FP8
  # decode batches 1 / 4 with the defaults and with that config alternating, the FP8 oracle with both, ~6 min
  timeout 200 python benchmarks/moe_bs1_probe.py --parts gate_up,down --out $OUT/epick_probe 2>&1 | tail -7
  T1=$OUT/epick_probe/moe_pair_tuned.json
  for m in def tuned def tuned; do
    sw=(); [[ $m == tuned ]] && sw=(METAINFER_MOE_TUNED=$T1)
    env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,4 --gen 32 --no-profile \
      --out $OUT/epick_${m}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[$m] /"
  done
  for m in ${VERIFY:-def tuned}; do
    sw=(); [[ $m == tuned ]] && sw=(METAINFER_MOE_TUNED=$T1)
    env "${sw[@]}" timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
      --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_epick_$m.json 2>&1 | grep -E "verdict" | head -1 \
      | sed "s/^/[fp8 $m] /"
  done
fi
if has rtiles; then  # KB-0071's sweep at 2-4 tokens (FP8 decode batches 2-4 and the MTP drafter's chains run the routed
  # rows there on the heuristic tiles): the probe's gate/up + down sweep at T = 2, 3, 4 (its best as "fp8,T"), FP8 decode
  # batches 1-4 with the defaults and with that table alternating, the FP8 oracle with it, ~7 min
  timeout 300 python benchmarks/moe_bs1_probe.py --parts gate_up,down --tokens 2,3,4 --out $OUT/rtiles_probe 2>&1 \
    | grep -A7 "^| T = "
  T1=$OUT/rtiles_probe/moe_pair_tuned.json
  for m in def tuned def tuned; do
    sw=(); [[ $m == tuned ]] && sw=(METAINFER_MOE_TUNED=$T1)
    env "${sw[@]}" timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,2,3,4 --gen 32 --no-profile \
      --out $OUT/rtiles_${m}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[$m] /"
  done
  METAINFER_MOE_TUNED=$T1 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_rtiles.json 2>&1 | grep -E "verdict" | head -1
fi
if has aprologue; then  # METAINFER_ATTN_PROLOGUE 0 / 1: decode-only steps fold the qk_norm_rope launch (q/k norm, partial
  # RoPE, the cache write) into the attention split kernel (10 launches fewer per step): its GPU tests, the engine GPU tests
  # with it, FP8 decode batches 1 / 8 / 64 alternating, the FP8 oracle with it, ~7 min
  timeout 200 python -m pytest -q tests/gpu/test_kernels_a_gpu.py -p no:cacheprovider -k "prologue or compile or graph" \
    2>&1 | tail -2
  METAINFER_ATTN_PROLOGUE=1 timeout 220 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider \
    -k "graph or mtp or speculative or prologue" 2>&1 | tail -2
  for m in 0 1 0 1; do
    METAINFER_ATTN_PROLOGUE=$m timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1,8,64 --gen 32 \
      --no-profile --out $OUT/aprologue_${m}_$SECONDS 2>&1 | grep -E "^\|" | grep -v batch | sed "s/^/[prologue $m] /"
  done
  METAINFER_ATTN_PROLOGUE=1 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_aprologue.json 2>&1 | grep -E "verdict" | head -1
fi
build_chain() { nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/stream_chain benchmarks/stream_chain.cu; }
if has chain; then
  build_chain && timeout 150 /tmp/stream_chain $OUT/stream_chain.json 2>&1 | tee $OUT/stream_chain.log
  timeout 150 python -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider -k "graph_replay_equals_eager" \
    2>&1 | tail -3
  METAINFER_FP8_LM_HEAD=1 timeout 170 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_fp8head.json 2>&1 | grep -E "verdict" | head -1 \
    | sed "s/^/[fp8, FP8 lm_head] /"
fi
if has chain2; then
  build_chain || exit 1
  [[ ${NCU:-1} == 1 ]] && timeout 120 ncu --clock-control none -k regex:chain_kernel -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats /tmp/stream_chain /tmp/one.json one \
    > $OUT/ncu_chain.txt 2>&1 && grep -E "DRAM Throughput|Duration|Warp Cycles" $OUT/ncu_chain.txt | head -8
  timeout 60 /tmp/stream_chain $OUT/stream_chain_single.json single 2>&1 | tee $OUT/stream_chain_single.log
  timeout 150 /tmp/stream_chain $OUT/stream_chain2.json 2>&1 | tee $OUT/stream_chain2.log
fi
if has chain3; then
  build_chain || exit 1
  timeout 90 /tmp/stream_chain $OUT/stream_chain_single.json single 2>&1 | tee $OUT/stream_chain_single.log
  timeout 200 /tmp/stream_chain $OUT/stream_chain_v2.json v2 2>&1 | tee $OUT/stream_chain_v2.log
  timeout 200 /tmp/stream_chain $OUT/stream_chain_v3.json v3 2>&1 | tee $OUT/stream_chain_v3.log
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
if has wgmoe; then  # KB-0096: one token's experts' gate/up on gemv.cu (METAINFER_WGMMA_GEMV_MOE): gemv GPU tests, the engine's
  # graph test with it, FP8 batch 1 off / on alternating x REPS (2), the oracle with it, a PDL-off profile with it, ~7 min
  timeout 200 python -m pytest -q tests/gpu/test_gemv_gpu.py -p no:cacheprovider 2>&1 | tail -4
  [[ ${WGMOE_ENGINE:-1} == 1 ]] && METAINFER_WGMMA_GEMV_MOE=1 timeout 150 python -m pytest -q tests/gpu/test_engine_gpu.py \
    -p no:cacheprovider -k "graph_replay_equals_eager" 2>&1 | tail -2
  ab_bs1 METAINFER_WGMMA_GEMV_MOE wgmoe ${REPS:-2}
  [[ ${WGMOE_VERIFY:-1} == 1 ]] && METAINFER_WGMMA_GEMV_MOE=1 timeout 150 python -m metainfer.cli verify \
    --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 --device cuda --suite full \
    --json $OUT/verify_fp8_wgmoe.json 2>&1 | grep -E "verdict" | head -1
  (( SECONDS < 480 )) && prof_bs1 METAINFER_WGMMA_GEMV_MOE wgmoe
fi
if has wgpre; then  # (KB-0097, run 2026-12-04f) the input norm as qkv's / in_proj's x prologue on gemv.cu
  # (METAINFER_WGMMA_GEMV_PRE=1: 39 _moe_add_rms_norm launches fewer a batch-1 step): gemv GPU tests, the engine's
  # graph / PDL tests with it, FP8 batch 1 off / on alternating x REPS (3), the oracle (FP8) with it, a PDL-off
  # profile with it, ~8 min
  timeout 200 python -m pytest -q tests/gpu/test_gemv_gpu.py -p no:cacheprovider 2>&1 | tail -4
  METAINFER_WGMMA_GEMV_PRE=1 timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "pdl_equals or graph_replay_equals_eager" 2>&1 | tail -2
  ab_bs1 METAINFER_WGMMA_GEMV_PRE wgpre ${REPS:-3}
  METAINFER_WGMMA_GEMV_PRE=1 timeout 150 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json \
    --dtype fp8 --device cuda --suite full --json $OUT/verify_fp8_wgpre.json 2>&1 | grep -E "verdict" | head -1
  (( SECONDS < 500 )) && prof_bs1 METAINFER_WGMMA_GEMV_PRE wgpre
fi
if has attn; then  # the attention split kernel's preload and tiles; the experts' down tiles (2026-12-04f)
  timeout 200 python -m pytest -q tests/gpu/test_kernels_a_gpu.py -p no:cacheprovider \
    -k "paged_attention or decode_preload or compiles or graph_replay" 2>&1 | tail -2
  METAINFER_ATTN_PRELOAD=1 timeout 200 python -m pytest -q tests/gpu -p no:cacheprovider \
    -k "pdl_equals or graph_replay_equals_eager" 2>&1 | tail -2
  ab_bs1 METAINFER_ATTN_PRELOAD apre ${REPS:-2}
  for cfg in block_n=32,min_split_tokens=32 block_n=16,min_split_tokens=16; do
    METAINFER_ATTN_PRELOAD=1 METAINFER_ATTN_DECODE=$cfg timeout 90 python benchmarks/decode_bench.py --dtype fp8 \
      --batches 1 --gen 32 --no-profile --out $OUT/acfg_$(echo $cfg | tr =, __) 2>&1 | grep -E "^\| 1 " \
      | sed "s/^/[attn $cfg] /"
  done
  for dn in 16:1 16:2 64:2 64:4; do  # the experts' down at batch 1: PRELOAD_BLOCK_H rows : DOWN_WARPS
    down_table $dn /tmp/down.json
    METAINFER_MOE_TUNED=/tmp/down.json timeout 90 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --gen 32 \
      --no-profile --out $OUT/down_${dn/:/_} 2>&1 | grep -E "^\| 1 " | sed "s/^/[down $dn] /"
  done
fi
if has mega; then
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -o /tmp/mega.cubin \
    metainfer/kernels/mega/mega.cu 2>&1 | grep -E "registers|spill" | tail -2
  timeout 240 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -4 $OUT/mega_tests.log
  if [[ ${MEGA_STEP:-1} == 1 ]]; then
    timeout 200 python benchmarks/mega_step.py --json $OUT/mega_step_bf16head.json 2>&1 | tail -12
    timeout 200 python benchmarks/mega_step.py --fp8-lm-head --json $OUT/mega_step_fp8head.json 2>&1 | tail -12
  fi
  timeout 150 python benchmarks/mega_bench.py --json $OUT/mega_bench_fp8.json 2>&1 | tail -5
fi
if has megaprof; then  # the megakernel's GPU tests, then the full step checked, timed and profiled (profile.py)
  timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -3 $OUT/mega_tests.log
  timeout 240 python benchmarks/mega_step.py --prof --reps 30 --leads 0 ${MEGA_ARGS:-} \
    --json $OUT/mega_step.json 2>&1 | grep -v Warn | tail -32
fi
if has megacode; then  # KB-0076's next step: is the megakernel bound by instruction fetch (its code: 224 KB)?
  timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -3 $OUT/mega_tests.log
  timeout 300 python benchmarks/mega_step.py --prof --reps 20 --leads ${MEGA_LEADS:-0} --inflight 6 --mma ${MEGA_MMAS:-0,1} \
    --variants "${MEGA_VARIANTS:-;-DMEGA_FETCH_GROUP=2}" --json $OUT/mega_step.json 2>&1 | grep -v Warn | tail -40
  if [[ ${NCU:-0} == 1 ]]; then
    timeout 200 ncu --clock-control none -k regex:mega_step -c 1 --section WarpStateStats --section SchedulerStats \
      --section InstructionStats python benchmarks/mega_step.py --reps 1 --leads 0 --mma 0 > $OUT/ncu_mega.txt 2>&1
    grep -iE "no instruction|stall|warp cycles|issued" $OUT/ncu_mega.txt | head -16
  fi
fi
if has megawg; then  # (2026-12-02e) the K = 2048 GEMVs on FP8 wgmma: GPU tests of both builds, then the step's time
  timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
  tail -3 $OUT/mega_tests.log
  METAINFER_MEGA_DEFINES="-DMEGA_WGMMA=0" timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py \
    -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests_wg.log
  tail -3 $OUT/mega_tests_wg.log
  timeout 300 python benchmarks/mega_step.py --prof --reps 20 --leads 0 --inflight 6 --mma 0 \
    --variants="${MEGA_VARIANTS:--DMEGA_WGMMA=0;}" --json $OUT/mega_step.json 2>&1 | grep -v Warn | tail -40
fi
if has megapoll; then  # (2026-12-03) the x prologues' polls: the megakernel's GPU tests, then mega_step.py --prof
  # of MEGA_VARIANTS against REF_SRC (an older tree's sources: `git archive <rev> metainfer/kernels/mega | tar -x
  # -C out/refsrc`, carried), L2 leads MEGA_LEADS, MEGA_ROUNDS interleaved rounds; MEGA_TESTS=0: no tests,
  # MEGA_PROF_FLAG=: no profiles, ~3 min
  if [ "${MEGA_TESTS:-1}" != 0 ]; then
    timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests.log
    tail -3 $OUT/mega_tests.log
  fi
  timeout 420 python benchmarks/mega_step.py ${MEGA_PROF_FLAG---prof} --reps 20 --rounds "${MEGA_ROUNDS:-1}" \
    --leads "${MEGA_LEADS:-0}" --inflight 6 --mma 0 \
    --variants="${MEGA_VARIANTS:-}" --ref-src "${REF_SRC:-out/refsrc/metainfer/kernels/mega}" \
    --json $OUT/mega_step.json 2>&1 | grep -v Warn | tail -45
  [ "${L2_BENCH:-1}" = 0 ] || timeout 120 python benchmarks/l2_broadcast_bench.py --json $OUT/l2_broadcast.json 2>&1 | tail -12
fi
if has megaroute; then  # (2026-12-03c) a -D variant of the routing against the default; the L2 lead too
  METAINFER_MEGA_DEFINES="${MEGA_ROUTE_DEFINES:?a -D list}" timeout 150 python -m pytest -q tests/gpu/test_mega_gpu.py \
    -p no:cacheprovider 2>&1 | tail -25 > $OUT/mega_tests_route_all.log
  tail -3 $OUT/mega_tests_route_all.log
  timeout 420 python benchmarks/mega_step.py --reps 20 --rounds 4 --leads 0,131072 --inflight 6 --mma 0 \
    --variants=";$MEGA_ROUTE_DEFINES" --json $OUT/mega_step_route.json 2>&1 | grep -v Warn | tail -12
fi
if has megasrc; then  # where the megakernel's warps stall, per SASS instruction (ncu's source counters), ~2 min
  timeout 240 ncu --clock-control none -k regex:mega_step -c 1 --section SourceCounters --section WarpStateStats \
    -o $OUT/mega_src python benchmarks/mega_step.py --reps 1 --leads 0 --mma 0 > $OUT/ncu_src.log 2>&1
  tail -3 $OUT/ncu_src.log
  ncu --import $OUT/mega_src.ncu-rep --page source --csv --print-source sass > $OUT/mega_source.csv 2>&1
  ncu --import $OUT/mega_src.ncu-rep --page raw --csv > $OUT/mega_raw.csv 2>&1
  wc -c $OUT/mega_source.csv $OUT/mega_raw.csv; head -c 600 $OUT/mega_source.csv
fi
if has chunkbench; then  # the consumers' rate on one ring slot: CUDA cores, tensor cores, the ring, FP8 wgmma
  timeout 240 python benchmarks/mega_chunk_bench.py --wgmma --variants "${CHUNK_VARIANTS:-}" \
    --json $OUT/chunk_bench.json 2>&1 | grep -v Warn | tail -12
fi
if has megaeng; then  # the engine with --megakernel: FP8 batch 1 decode, then the oracle (only if the tests passed)
  timeout 240 python benchmarks/decode_bench.py --dtype fp8 --batches 1 --no-profile --megakernel \
    --out $OUT/megaeng 2>&1 | grep -E "decode_tok_s|megakernel|Error|Traceback" | head -6
  # (one sequence at a time: the megakernel serves only batch-1 decode steps)
  timeout 300 python -m metainfer.cli verify --model dummy:metainfer/configs/qwen3.6-35b-a3b.json --dtype fp8 \
    --megakernel --max-num-seqs 1 --device cuda --suite full --json $OUT/verify_fp8_mega.json 2>&1 \
    | grep -E "verdict|FAIL|Error" | head -8
fi
