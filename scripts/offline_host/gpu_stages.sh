# Sourced or run on a GPU host (after `source scripts/offline_host/activate.sh`), in the repository root:
#   bash scripts/offline_host/gpu_stages.sh STAGE COMMIT [OUT]
# runs one stage of the GPU checks, each sized to finish within a 10-minute call, and writes its results
# (JSON, logs) under OUT (default: $OUT, else ./gpu_out). COMMIT is recorded in the results (the copy on
# the host may carry an older git history). Stages:
#   suite-kernels-1  GPU tests of the shrink and expand kernels
#   suite-kernels-2  GPU tests of the fused LoRA and quantized matmul kernels
#   suite-rest       every other GPU test (engine, services, SmolLM2 end to end; ~8 minutes on an H200)
#   suite-rest-a     its compute-service and tensor-parallel part, and suite-rest-b the rest: the same tests in
#                    two calls, where one would come near the 10-minute limit
#   suite-rest-b1    suite-rest-b's kernel-file and engine part, and suite-rest-b2 the rest of it (suite-rest-b with
#                    the SmolLM2 tests came near the 10-minute limit)
#   suite-kernels-3, suite-engine-quant, suite-engine-other, suite-smollm2: suite-rest-b1 in four calls (it overran
#                    330 s without its kernel files and SmolLM2 files at 1fde228 on a fresh host): the other kernel
#                    files in worker processes (73 s at 1fde228), the engine's test_quant*.py files, the rest of the
#                    engine's files, and the files that read the default model (carry its parts first)
#   serve-load       bench/serve_load.py, overlapped steps (the default), then --no-async-scheduling (both sides)
#   cold             bench/cold_adapter.py, and bench/cold_adapter_burst.py with 0 and 4 conversion workers
#   host-step        bench/engine_host_step.py on the GPU, plain and overlapped steps
#   swap             bench/adapter_swap.py
#   quant-decode     bench/quant_decode.py (issue 16's engine benchmark: 4-bit 8B against bf16, batch 1-64)
#   gemv-sweep       bench/quant_kernel_sweep.py --only 8b --rows 1: every one-row config of the 8B's shapes (and
#                    16-row tensor-core tiles at one row, split 1-8), for pick_config (~2 minutes)
#   layer-probe      bench/quant_layer_probe.py: a step's words read by one persistent launch (grid barriers, with and
#                    without early reads) against a chain of launches (~3 minutes); layer-probe-pipelined: its
#                    software-pipelined mode over stages, beside the best chain and barrier configs (~2 minutes)
#   probe-staged     bench/quant_gemv_probe.py --staged on gate/up and q/k/v: the one-row kernel's reads as TMA
#                    boxes or pipelined pointer loads, 2-6 stages (not run yet; 144 cases, a few minutes)
#   tma-sweep        bench/quant_kernel_sweep.py --only 8b --rows 1 --tma: pick_config's one-row choice against the
#                    TMA-read kernel (kernels/quant_gemv_tma.py) over programs, splits, stages (~3 minutes)
#   tma-decode       bench/quant_decode.py --batches 1 with LORAPLEX_H2_TMA unset, then set to each of
#                    $TMA_VARIANTS (default "4 4,1"): the engine at batch 1 on either one-row kernel
#   tile-tma-sweep   bench/quant_kernel_sweep.py --only 8b --rows $ROWS (default 16,32,64,128) --tma: pick_config's
#                    tiles against the tiles whose words are read by TMA a half block a step (kernels/quant_mma_tma.py,
#                    splits 1-4, 2-5 stages; not picked by pick_config until this has run; ~2-3 minutes)
#   tile-tma-decode  bench/quant_decode.py at batches $BATCHES (default 32,64) with LORAPLEX_TILE_TMA unset, then set to
#                    each of $TILE_TMA_VARIANTS (default "3 4"): the engine on the register-set tiles or the TMA-read
#                    ones (~3 minutes)
#   overlap-tokens   bench/quant_decode.py at batches $BATCHES (default 32,64) with LORAPLEX_LORA_OVERLAP_TOKENS
#                    unset (16), then set to each of $OVERLAP_VARIANTS (default 64): the LoRA of 17-64 tokens
#                    beside the base projection in the decode graphs, or after it (~4 minutes)
#   tma-checks       the GPU tests of the TMA-read one-row kernel, in the kernels and in the engine (~1 minute;
#                    suite-rest runs them too)
#   compile-pool-specs  tests/compute_service/test_compile_pool.py's cold start once, then the LoRA kernels'
#                    programs' signatures (their specialisations) counted: which programs the warm-up compiled
#                    beside the pool's (the test itself names a program looked up that the pool was not handed;
#                    programs on disk beyond the pool's mean another cache key: docs/performance.md; ~1 minute)
#   async-dots       the asynchronous-dot 4-bit kernel (kernels/quant_wgmma.py): its GPU tests and the engine's
#                    (tests/engine/test_quant_async_dots_gpu.py), then bench/quant_async_dots.py at rows $ROWS
#                    (default 1,8,16,32,64): pick_config's choice without and with it, its variants, and the best
#                    three of those with SYNC 1 and 2 and on 128 features (~6 minutes with the tests, which now
#                    run 3 syncs x 2 widths; SKIP_TESTS=1 for the sweep alone, e.g. over two calls by ROWS)
#   async-dots-decode  bench/quant_decode.py, the 4-bit engine only at batches $BATCHES (default 8,16,32), with
#                    LORAPLEX_ASYNC_DOTS=1 then 0: an A/B of the kernel on one lease (~3 minutes)
#   gemv-stalls      bench/quant_gemv_stalls.py: the GPU profiler's stall reasons and hot machine-code lines of the
#                    one-row 4-bit kernel on gate/up, down and q/k/v (~1 minute; needs `ncu` on the host); ROWS=64
#                    (2-64): the tensor-core tile kernel at that many rows instead (quant_gemv_stalls_rows64.json)
#   async-sync-decode  bench/quant_decode.py, the 4-bit engine only at batches $BATCHES (default 8,16,32), with
#                    LORAPLEX_ASYNC_DOTS_SYNC set to each of $SYNCS (default "0 1 2"): the kernel's half-block
#                    synchronisation as measured, barrier before fence, and the early refill (kernels/quant_wgmma.py),
#                    an A/B on one lease (~4 minutes)
#   async-one-row-decode  bench/quant_decode.py, the 4-bit engine only at batches $BATCHES (default 1,2), with
#                    LORAPLEX_ASYNC_DOTS_ONE_ROW=0 then 1: one row on the one-row kernels or on the asynchronous-dot
#                    kernel's 8-row tile (where no LoRA launch runs beside it), an A/B on one lease (~2 minutes;
#                    add LORAPLEX_ASYNC_DOTS_SYNC=... to the environment to A/B with another synchronisation)
#   async-stalls     bench/quant_gemv_stalls.py --async-dots at rows $ROWS (default "8 32"): the profiler's stall
#                    reasons and hot machine-code lines of the asynchronous-dot kernel on gate/up, down and q/k/v
#                    (quant_async_stalls_rows<R>.json; ~2 minutes, needs `ncu`)
#   wide-sweep       bench/quant_kernel_sweep.py --only 8b --rows $ROWS (default 128,192,256,384,512) --wide: pick_config's
#                    choice against the asynchronous-dot kernel's 128- and 256-row tiles (DEQ), the GEMM and bf16
#                    (quant_kernel_wide.json; ~4 minutes), then bench/quant_decode.py --labels int4 at batches
#                    128,256 (quant_decode_wide.json; ~1 minute)
#   defer-sweep      bench/quant_kernel_sweep.py --only 8b --rows 1 --defer: every one-row config of the 8B shapes with
#                    its partials left to the reader after it (SwiGLU, the norm) and that reader timed with it, as the
#                    engine runs them (quant_kernel_defer.json; pick_config's one-row rule was swept with the sum in the
#                    launch; SWEEP_TIMEOUT, default 420 s)
#   w4-trace-1       bench/step_profile.py on the 4-bit 8B at batch 1, base and rank 16 on every module, with a trace of
#                    each step's first kernels (step_profile_w4_b1.json: each projection's span from its x; ~2 minutes)
#   split-cost       bench/quant_split_cost.py: pick_config's one-row launches of the 8B shapes after a norm, summing
#                    their split-K partials in the launch or leaving them to the next kernel (quant_split_cost.json; ~1 minute; 4614e1a: 52.0 -> 43.6 us a
#                    layer, which the deferred sum of 6714be1 took, kernels/split_sum.py)
#   sweep-after-norm bench/quant_kernel_sweep.py --only 8b --rows $ROWS (default 64,128,192,256) --wide --after-norm:
#                    every launch after an RMSNorm that writes its x and x's sums, as in a decode step
#                    (quant_kernel_after_norm.json; ~1 minute, run at 4614e1a): whether pick_config's choice between the
#                    pair-codes tiles and the wide tiles holds where a short kernel, not a launch of itself, comes before
#   w4-profile       bench/step_profile.py on the 4-bit 8B: base and rank 16 on every module (each request its
#                    own adapter) at batch 1 and 64, with a trace of each step's first kernels; then gemv-stalls
#                    (where the 4-bit steps' time goes, for the next kernel round; ~3 minutes)
#   lora-rank-pad    bench/lora_rank_pad.py: the LoRA decode step of rank-16 / rank-64 adapters in pools of largest
#                    rank 16, 64 and 256 (~1.5 minutes); with another commit's kernels unpacked under ab_kernels/
#                    (`git archive C kernels | tar -x -C ab_kernels`: ignored, name it in the call's carry) the same
#                    with those, both in one JSON (an A/B on one lease)
#   lora-step-sweep  bench/lora_step_sweep.py --focused at 32 and 64 tokens, each launch kind of a LoRA decode step
#                    alone at its configuration and the combinations around it, for rank:pool pairs $SWEEP_CASES
#                    (default 16:256,64:256: ~1 minute a pair; the one-knob sweep of every pair overran 600 s)
#   w4-trace-8       bench/step_profile.py on the 4-bit 8B at batch 8, base and rank 16 on every module, with a
#                    trace of each step's first kernels (what lies on the path between a norm and the tile kernel
#                    after it: the half sums' launch; ~2 minutes)
#   quant-decode-ab  bench/quant_decode.py at batches $BATCHES (default 8,32,64) in this tree, then in another
#                    commit's whole tree unpacked under ab_tree/ (`git archive C | tar -x -C ab_tree`: ignored, name
#                    it in the call's carry; ~17 MB): an engine A/B on one lease (~4 minutes); AB_ARGS: more
#                    arguments for both (e.g. "--labels int4 --no-kernels --act-order"), AB_ROUNDS="1 2": the
#                    two trees twice, in opposite orders
#   serve-8b-w4      bench/serve_load.py on a random 8B kept 4-bit, then the same model in bf16 (~6 minutes
#                    with the model made in /tmp; both JSONs hold served_start_stages). Making the random
#                    model reads the default model's tokenizer: install the default model first (on an
#                    offline host, its parts, as for suite-rest). QUANT_GROUP=32 in the environment:
#                    the 4-bit side in groups of 32 (serve_load_8b_w4g32.json; the bf16 side's name as before)
#                    MAX_LORA_RANK=256: both sides with the pool of a server's default largest rank instead of the
#                    adapters' (64); the JSONs' names end in _r256. TEMPERATURE=0.8 (and TOP_P=0.9): every request
#                    sampled so, both sides (names end in _t0.8, _p0.9); unset, greedy as in every committed run
#   serve-8b-act-order  bench/serve_load.py, served figures only (--skip-engine), on a random 8B kept 4-bit as GPTQ
#                    (groups of 128), its channels in the model's order, then in an act-order layout
#                    (--act-order-seed 1): streams $CONCURRENCY (default 1,8,64), base, shared and distinct
#                    adapters; ORDERS=act-order (or stored) runs one side only (~4 minutes a side with the model made)
set -u
stage=${1:?stage}; commit=${2:?commit}; out=${3:-${OUT:-gpu_out}}
mkdir -p "$out"
kernels1="tests/kernels/test_shrink.py tests/kernels/test_expand.py"
kernels2="tests/kernels/test_fused.py tests/kernels/test_quant_matmul.py"
ignore="--ignore=tests/deploy --ignore=tests/gateway/test_http_openai.py --ignore=tests/gateway/test_tls.py"
pytest_gpu() {      # the 20 slowest tests are logged too; the log is written as the tests run (a call that
  local rc          # runs out of time still brings back how far they got); a test that hangs fails after
                    # GPU_TEST_TIMEOUT seconds (default 300; the slowest took ~60 s on an H200) instead of the call
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=20 --timeout="${GPU_TEST_TIMEOUT:-300}" "$@" \
    > "$out/$stage.log" 2>&1
  rc=$?; tail -60 "$out/$stage.log"; return $rc
}
# The kernel suites should be mostly Triton compiling a program per parametrized case, one core at a time:
# spread over worker processes (pytest-xdist, in the bundle) sharing the GPU. Their tests are independent
# (no files, ports or memory sizing); the rest stays serial (its engines size their KV cache from free memory).
# H200 with 16 cores, 14 workers, 2026-11-28: suite-kernels-1 240 s, suite-kernels-2 177 s, suite-rest 320 s
# (2026-11-29, ec9eb97: 250 s, 183 s, 407 s).
not_kernels=""                                       # the rest: every test file but the kernel suites' files
for f in $kernels1 $kernels2; do not_kernels="$not_kernels --ignore=$f"; done
# The engine's test files that read the default model (SmolLM2), and --ignore for each of them
model_files=$(grep -l "default_model_path\|smollm2\|SmolLM2" tests/engine/test_*.py | tr '\n' ' ')
not_model=""
for f in $model_files; do not_model="$not_model --ignore=$f"; done
not_quant=""                                         # and for each of its test_quant*.py files
for f in tests/engine/test_quant*.py; do not_quant="$not_quant --ignore=$f"; done
workers=""
python3 -c "import xdist" 2>/dev/null && workers="-n ${GPU_TEST_WORKERS:-14}"
# The 4-bit engine alone at batches $BATCHES (default $4, else 8,16,32) with switch $1 set to each of $2 in turn
# (one lease): quant_decode_$3_<value>.json each
int4_decode_ab() {
  for flag in $2; do
    env "$1=$flag" python3 bench/quant_decode.py --labels int4 --batches "${BATCHES:-${4:-8,16,32}}" \
      --commit "$commit" --out "$out/quant_decode_$3_$flag.json" 2>&1 | grep "^engine" | tee -a "$out/$stage.log"
  done
}
case "$stage" in
  suite-kernels-1) pytest_gpu $workers $kernels1 ;;
  suite-kernels-2) pytest_gpu $workers $kernels2 ;;
  suite-rest) pytest_gpu tests $ignore $not_kernels ;;
  suite-rest-a) pytest_gpu tests/compute_service tests/parallel ;;
  suite-rest-b) pytest_gpu tests $ignore $not_kernels --ignore=tests/compute_service --ignore=tests/parallel ;;
  suite-rest-b1) pytest_gpu tests/kernels tests/engine $not_kernels ;;
  suite-kernels-3) pytest_gpu $workers tests/kernels $not_kernels ;;
  suite-engine-quant) pytest_gpu tests/engine/test_quant*.py $not_model ;;
  suite-engine-other) pytest_gpu tests/engine $not_model $not_quant ;;
  suite-smollm2) pytest_gpu $model_files ;;
  suite-rest-b2) pytest_gpu tests $ignore $not_kernels --ignore=tests/compute_service --ignore=tests/parallel \
                   --ignore=tests/kernels --ignore=tests/engine ;;
  serve-load)
    python3 bench/serve_load.py --commit "$commit" --out "$out/serve_load.json" > "$out/serve_load.log" 2>&1
    python3 bench/serve_load.py --commit "$commit" --no-async-scheduling --out "$out/serve_load_plain.json" \
      > "$out/serve_load_plain.log" 2>&1
    tail -n 5 "$out/serve_load.log" "$out/serve_load_plain.log" ;;
  cold)
    python3 bench/cold_adapter.py --commit "$commit" --out "$out/cold_adapter.json" > "$out/cold.log" 2>&1
    for n in 0 4; do
      python3 bench/cold_adapter_burst.py --num 16 --cache-flags "--convert-processes $n" \
        --out "$out/cold_burst_p$n.json" >> "$out/cold.log" 2>&1
    done
    tail -12 "$out/cold.log" ;;
  host-step)
    for flag in "" --no-async-scheduling; do
      python3 bench/engine_host_step.py --device cuda --commit "$commit" $flag \
        --out "$out/host_step${flag:+_plain}.json" 2>&1 | tail -1
    done ;;
  swap) python3 bench/adapter_swap.py --commit "$commit" --out "$out/adapter_swap.json" 2>&1 | tail -12 ;;
  quant-decode)
    python3 bench/quant_decode.py --commit "$commit" --out "$out/quant_decode.json" --plot "$out/quant_decode.png" \
      2>&1 | tail -30 | tee "$out/quant_decode.log" ;;
  serve-8b-w4)
    common="--make-random-model /tmp/llama8b --shape 8b --lora-root /tmp/lora8b --num-adapters 32 --arrivals burst
            --host-cache-bytes 17179869184 --lora-gpu-cache-bytes 17179869184 --commit $commit
            ${MAX_LORA_RANK:+--max-lora-rank $MAX_LORA_RANK} ${TEMPERATURE:+--temperature $TEMPERATURE}
            ${TOP_P:+--top-p $TOP_P}"
    sampled=${TEMPERATURE:+_t$TEMPERATURE}${TOP_P:+_p$TOP_P}
    w4=serve_load_8b_w4${QUANT_GROUP:+g$QUANT_GROUP}${MAX_LORA_RANK:+_r$MAX_LORA_RANK}$sampled
    python3 bench/serve_load.py $common --quantize-bits 4 ${QUANT_GROUP:+--quantize-group-size $QUANT_GROUP} \
      --out "$out/$w4.json" --plot "$out/$w4.png" > "$out/serve_8b_w4.log" 2>&1
    bf=serve_load_8b_w4_bf16${MAX_LORA_RANK:+_r$MAX_LORA_RANK}$sampled
    python3 bench/serve_load.py $common --out "$out/$bf.json" --plot "$out/$bf.png" > "$out/serve_8b_bf16.log" 2>&1
    tail -n 8 "$out/serve_8b_w4.log" "$out/serve_8b_bf16.log" ;;
  serve-8b-act-order)
    common="--make-random-model /tmp/llama8b --shape 8b --lora-root /tmp/lora8b --num-adapters 32 --arrivals burst
            --host-cache-bytes 17179869184 --lora-gpu-cache-bytes 17179869184 --commit $commit --quantize-bits 4
            --quantize-format gptq --concurrency ${CONCURRENCY:-1,8,64} --skip-engine"
    for order in ${ORDERS:-stored act-order}; do
      seed=""; [ "$order" = act-order ] && seed="--act-order-seed 1"
      name=serve_load_8b_w4_gptq${seed:+_act_order}
      python3 bench/serve_load.py $common $seed --out "$out/$name.json" > "$out/serve_8b_$order.log" 2>&1
      tail -n 6 "$out/serve_8b_$order.log"
    done ;;
  sampler)          # the sampler's GPU tests, then bench/sampler_cost.py
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sample_nucleus.py \
      tests/kernels/test_sample_threshold.py tests/kernels/test_sample.py 2>&1 | tail -3 | tee "$out/$stage.log"
    python3 bench/sampler_cost.py --commit "$commit" --out "$out/sampler_cost.json" 2>&1 | tail -16 \
      | tee -a "$out/$stage.log" ;;
  gemv-sweep)
    python3 bench/quant_kernel_sweep.py --out "$out/quant_sweep_8b_rows1.json" --only 8b --rows 1 2>&1 \
      | cut -c1-150 | tee "$out/$stage.log" ;;
  tile-tma-sweep)
    python3 bench/quant_kernel_sweep.py --out "$out/quant_tile_tma_sweep.json" --only 8b --tma \
      --rows "${ROWS:-16,32,64,128}" 2>&1 | cut -c1-220 | tee "$out/$stage.log" ;;
  tma-sweep)
    python3 bench/quant_kernel_sweep.py --out "$out/quant_sweep_tma.json" --only 8b --rows 1 --tma \
      ${TMA_SHAPES:+--shapes $TMA_SHAPES} 2>&1 \
      | cut -c1-200 | tee "$out/$stage.log" ;;
  defer-sweep)
    timeout "${SWEEP_TIMEOUT:-420}" python3 bench/quant_kernel_sweep.py --out "$out/quant_kernel_defer.json" --only 8b \
      --rows 1 --defer 2>&1 | cut -c1-150 | tee "$out/$stage.log" ;;
  w4-trace-1)
    timeout 300 python3 bench/step_profile.py --bits 4 --cases base:1,distinct_r16_all:1 --steps 10 --trace 60 \
      --commit "$commit" --out "$out/step_profile_w4_b1.json" 2>&1 | tail -40 | tee "$out/$stage.log" ;;
  decode-env-ab)   # bench/quant_decode.py --labels int4 [AB_ARGS] once per value of AB_ENV in AB_VALUES ("-": unset)
    i=0
    for v in ${AB_VALUES:?}; do
      i=$((i + 1)); [ "$v" = "-" ] && v=""
      env "${AB_ENV:?}=$v" timeout "${AB_TIMEOUT:-200}" python3 bench/quant_decode.py --labels int4 \
        --commit "$commit $AB_ENV=$v" --batches "${BATCHES:-1,8}" ${AB_ARGS:-} \
        --out "$out/decode_ab_${i}_${v:-unset}.json" 2>&1 \
        | grep -E "tpot|T=   1 |rror" | tail -12 | tee -a "$out/$stage.log"
    done ;;
  tma-decode)
    for v in "" ${TMA_VARIANTS:-4 4,1}; do
      LORAPLEX_H2_TMA="$v" timeout 200 python3 bench/quant_decode.py --commit "$commit${v:+ LORAPLEX_H2_TMA=$v}" \
        --batches 1 --out "$out/quant_decode_tma${v:+_$v}.json" 2>&1 | tail -12 | tee -a "$out/$stage.log"
    done ;;
  overlap-tokens)
    for v in "" ${OVERLAP_VARIANTS:-64}; do
      LORAPLEX_LORA_OVERLAP_TOKENS="$v" timeout 280 python3 bench/quant_decode.py \
        --commit "$commit${v:+ LORAPLEX_LORA_OVERLAP_TOKENS=$v}" --batches "${BATCHES:-32,64}" \
        --out "$out/quant_decode_overlap${v:+_$v}.json" 2>&1 | tail -12 | tee -a "$out/$stage.log"
    done ;;
  tile-tma-decode)
    for v in "" ${TILE_TMA_VARIANTS:-3 4}; do
      LORAPLEX_TILE_TMA="$v" timeout 200 python3 bench/quant_decode.py --commit "$commit${v:+ LORAPLEX_TILE_TMA=$v}" \
        --batches "${BATCHES:-32,64}" --out "$out/quant_decode_tile_tma${v:+_$v}.json" 2>&1 | tail -12 \
        | tee -a "$out/$stage.log"
    done ;;
  tma-checks)
    # the GPU tests of the TMA-read one-row kernel (kernels and engine) and of the shared mid-sized model
    pytest_gpu tests/kernels/test_quant_gemv_tma.py tests/engine/test_quant_tma_gpu.py \
      tests/engine/test_lora_first_gpu.py ;;
  compile-pool-specs)
    # the cold-start compile-pool test once, then, per LoRA kernel, each program's signature line (its
    # specialisation) with how many programs share it: a program the warm-up compiled beside the pool's shows
    # as a signature the recording did not produce
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compute_service/test_compile_pool.py \
      -k "cold_start and tiny" --basetemp=/tmp/cps --log-level=INFO > "$out/$stage.full.log" 2>&1   # + warm-up's log
    grep -E "passed|failed|recording pass stopped|warm-up:" "$out/$stage.full.log" | cut -c1-300 | tee "$out/$stage.log"
    for k in _shrink_kernel _fused_kernel _expand_kernel; do
      echo "== $k" >> "$out/$stage.log"
      find /tmp/cps -name "$k.ttir" | while read -r f; do grep -m1 "tt.func" "$f" | sed 's/loc([^)]*)//g'; done \
        | sort | uniq -c >> "$out/$stage.log"
      find /tmp/cps -name "$k.json" | while read -r f; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print({x: d[x] for x in sorted(d) if x not in ('hash', 'name', 'target', 'shared', 'tmem_size')})" "$f"; done \
        | sort | uniq -c >> "$out/$stage.log"
    done
    cp -r /tmp/cps "$out/cps" 2>/dev/null; find "$out/cps" -name "*.cubin" -delete -o -name "*.ptx" -delete \
      -o -name "*.llir" -delete -o -name "*.ttgir" -delete 2>/dev/null ;;
  layer-probe-pipelined)      # the pipelined structure over its stages, beside the best chain and barrier configs
    timeout 250 python3 bench/quant_layer_probe.py --commit "$commit" --modes pipelined \
      --configs "1,128,8,16,0,0;1,128,4,16,0,0;1,64,8,8,0,0;2,64,8,8,0,0;1,128,12,16,0,0;1,128,8,32,0,0;\
2,128,4,16,0,0" \
      --out "$out/quant_layer_probe_pipelined.json" 2>&1 | tail -40 | tee "$out/$stage.log"
    timeout 200 python3 bench/quant_layer_probe.py --commit "$commit" --modes launches_early,preload_split,stream \
      --configs "4,64,2,8,0,2;1,128,4,32,0,4" --out "$out/quant_layer_probe_pipelined_base.json" 2>&1 | tail -20 \
      | tee -a "$out/$stage.log" ;;
  layer-probe)
    timeout 500 python3 bench/quant_layer_probe.py --commit "$commit" --out "$out/quant_layer_probe.json" 2>&1 \
      | tail -90 | tee "$out/$stage.log" ;;
  probe-staged)
    timeout 400 python3 bench/quant_gemv_probe.py --staged --only gate_up,qkv --commit "$commit" \
      --out "$out/quant_gemv_probe_staged.json" 2>&1 | tail -40 | tee "$out/$stage.log" ;;
  wide-sweep)
    python3 bench/quant_kernel_sweep.py --only 8b --rows "${ROWS:-128,192,256,384,512}" --wide \
      --out "$out/quant_kernel_wide.json" 2>&1 | grep "^8b" | tee "$out/$stage.log"
    python3 bench/quant_decode.py --labels int4 --batches 128,256 --commit "$commit" \
      --out "$out/quant_decode_wide.json" 2>&1 | grep "^engine" | tee -a "$out/$stage.log" ;;
  split-cost)
    python3 bench/quant_split_cost.py --commit "$commit" --out "$out/quant_split_cost.json" 2>&1 \
      | tee "$out/$stage.log" ;;
  sweep-after-norm)
    python3 bench/quant_kernel_sweep.py --only 8b --rows "${ROWS:-64,128,192,256}" --after-norm --wide \
      --out "$out/quant_kernel_after_norm.json" 2>&1 | grep "^8b" | tee "$out/$stage.log" ;;
  lora-rank-pad)
    python3 bench/lora_rank_pad.py --commit "$commit" --out "$out/lora_rank_pad.json" 2>&1 | tee "$out/$stage.log"
    if [ -d ab_kernels/kernels ]; then
      KERNELS_ROOT="$PWD/ab_kernels" python3 bench/lora_rank_pad.py --commit "$commit" --label ab_kernels \
        --merge "$out/lora_rank_pad.json" --out "$out/lora_rank_pad.json" 2>&1 | tee -a "$out/$stage.log"
    fi ;;
  quant-decode-ab)
    [ -d ab_tree/kernels ] || { echo "quant-decode-ab needs another commit's tree in ab_tree/" >&2; exit 2; }
    abs_out=$(cd "$out" && pwd)
    for round in ${AB_ROUNDS:-1}; do     # AB_ROUNDS="1 2": the two trees twice, in opposite orders
      trees="tree ab_tree"; [ "$round" = 2 ] && trees="ab_tree tree"
      for t in $trees; do
        dir=.; [ "$t" = ab_tree ] && dir=ab_tree
        (cd "$dir" && python3 bench/quant_decode.py --batches "${BATCHES:-8,32,64}" ${AB_ARGS:-} \
          --commit "$([ "$t" = tree ] && echo "$commit" || echo ab_tree)" \
          --out "$abs_out/quant_decode_${t}_$round.json") 2>&1 | grep -E "tpot|T= |rror" | tail -40 \
          | sed "s/^/$t $round: /" | tee -a "$out/$stage.log"
      done
    done ;;
  lora-step-sweep)
    python3 bench/lora_step_sweep.py --focused --cases "${SWEEP_CASES:-16:256,64:256}" --batches 32,64 \
      --commit "$commit" --out "$out/lora_step_sweep.json" 2>&1 | tail -5 | tee "$out/$stage.log" ;;
  w4-trace-8)
    timeout 300 python3 bench/step_profile.py --bits 4 --cases base:8,distinct_r16_all:8 --steps 10 --trace 60 \
      --commit "$commit" --out "$out/step_profile_w4_b8.json" 2>&1 | tail -40 | tee "$out/$stage.log" ;;
  w4-profile)
    timeout 300 python3 bench/step_profile.py --bits 4 --cases base:1,distinct_r16_all:1,base:64,distinct_r16_all:64 \
      --steps 10 --trace 60 --commit "$commit" --out "$out/step_profile_w4.json" 2>&1 | tail -60 | tee "$out/$stage.log"
    bash "$0" gemv-stalls "$commit" "$out" ;;
  async-dots)
    [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_quant_wgmma.py \
      tests/engine/test_quant_async_dots_gpu.py 2>&1 | tail -15 | tee "$out/$stage.log"
    rows=${ROWS:-1,8,16,32,64}
    python3 bench/quant_async_dots.py --rows "$rows" --commit "$commit" \
      --out "$out/quant_async_dots_rows${rows//,/_}.json" 2>&1 | cut -c1-420 | tee -a "$out/$stage.log" ;;
  async-dots-decode) int4_decode_ab LORAPLEX_ASYNC_DOTS "1 0" async_dots ;;
  gemv-stalls)
    python3 bench/quant_gemv_stalls.py --shapes gate_up,down,qkv --commit "$commit" --rows "${ROWS:-1}" \
      --out "$out/quant_gemv_stalls${ROWS:+_rows$ROWS}.json" --raw /tmp/quant_gemv_stalls_raw${ROWS:+_$ROWS} 2>&1 \
      | tee "$out/gemv_stalls${ROWS:+_rows$ROWS}.log" ;;
  async-sync-decode) int4_decode_ab LORAPLEX_ASYNC_DOTS_SYNC "${SYNCS:-0 1 2}" sync ;;
  async-one-row-decode) int4_decode_ab LORAPLEX_ASYNC_DOTS_ONE_ROW "0 1" one_row 1,2 ;;
  async-stalls)
    for rows in ${ROWS:-8 32}; do
      python3 bench/quant_gemv_stalls.py --shapes gate_up,down,qkv --commit "$commit" --rows "$rows" --async-dots \
        --out "$out/quant_async_stalls_rows$rows.json" --raw "/tmp/quant_async_stalls_raw_$rows" 2>&1 \
        | tee -a "$out/async_stalls.log"
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
