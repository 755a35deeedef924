#!/usr/bin/env bash
# The GPU-host runs behind bench/results/, one step per device call (each under the
# 10-minute call limit). Assumes the staged vLLM (/opt/vllm-site) and fixture payload
# (/opt/smollm2-fixture: GGUF + prompt sets) of docs/benchmarks.md; writes to $OUT.
# Another GPU host: DDTREE_VLLM_SITE (the directory holding the vllm package the series
# is applied to), DDTREE_FIXTURE (GGUF + data/), DDTREE_TARGET (where the converted
# target goes) and DDTREE_STATE (a writable directory for the fused-kernel verdict).
# DDTREE_DRAFTER: another drafter for the benchmark pair (a directory, e.g. one
# bench.fixture.export_drafter wrote), for every step.
#
# Steps run in the order given; several may share one device call (each keeps its own
# timeouts). CHECKS_ALGOS=0 leaves the kernel timings out of `checks`.
# DDTREE_COMPILE_CACHE / COMPILE_CACHE_SAVE=1 restore / return the compile caches
# (bench/compile_cache.sh), so that a new loan does not compile every engine again.
#
#   bash bench/gpu_session.sh checks   # convert target, apply series, GPU kernel tests,
#                                      # greedy equivalence on the real pair (float32, eager)
#   bash bench/gpu_session.sh bench    # bench/run.py --suite fixture (CUDA graphs) + plots;
#                                      # ddtree-b15 verifies as many tokens as the chain;
#                                      # BENCH_PROFILE=1 also records DDTree's step profile
#                                      # (its events cost DDTree host time: off by default)
#                                      # BENCH_CONFIGS, BENCH_BATCH_SIZES pick engines and sizes;
#                                      # BENCH_REPEATS, BENCH_MIN_REQUESTS fight the noise;
#                                      # BENCH_ENGINE_ROUNDS starts every engine N times
#   bash bench/gpu_session.sh context-graphs  # the context store graphs' GPU tests (also in checks)
#   bash bench/gpu_session.sh online   # greedy equivalence with the online budget switching
#   bash bench/gpu_session.sh goals    # plain / chain / DDTree on the held-out sharegpt-untrained
#                                      # set (GOALS_CONFIGS order, GOALS_TAG names the run;
#                                      # GOALS_MODE=steady: constant concurrency)
#   bash bench/gpu_session.sh serve    # bench/serve_e2e.py (OpenAI server end to end); with
#                                      # VLLM_BATCH_INVARIANT=1 the server and the offline
#                                      # reference both use vLLM's batch-invariant kernels;
#                                      # SERVE_STRICT=1: a token difference fails unless
#                                      # plain decoding offline finds it a near tie (with
#                                      # SERVE_DTYPE=float32); SERVE_PLAIN=1 also serves
#                                      # plain decoding (no speculation, same flags) and
#                                      # compares the two servers' answers; SERVE_DEFAULTS=1
#                                      # first starts `vllm serve` with nothing but
#                                      # --speculative-config (vLLM's defaults, CUDA graphs);
#                                      # SERVE_ENTRYPOINT=1 first starts the image's
#                                      # entrypoint with the Kubernetes base's ddtree.env
#   bash bench/gpu_session.sh cost     # the cost model's GPU timer test, then bench/run.py
#                                      # --suite cost8b (Qwen3-8B shape, dummy); COST_CONFIGS,
#                                      # COST_REPEATS, COST_ENGINE_ROUNDS, COST_BATCH_SIZES,
#                                      # COST_PROFILE=0
#   bash bench/gpu_session.sh algos    # bench/bench_algorithms.py kernel timings
#   bash bench/gpu_session.sh graphs   # greedy equivalence, real pair, float32, CUDA graphs
#   bash bench/gpu_session.sh lossless # greedy and seeded T>0 equivalence, real pair, float32
#   bash bench/gpu_session.sh shapes   # the same on tiny random Qwen3 / Llama-3 / Qwen3-MoE targets
#                                      # (SHAPES_DRAFTER=dflash2: a DFlash2 drafter, vLLM 0.33.0)
#                                      # (LOSSLESS_MODES="eager graphs", LOSSLESS_VARIANTS, ...)
#   bash bench/gpu_session.sh ci       # bench/run.py --suite ci -> the regression baseline
#   bash bench/gpu_session.sh tp       # greedy equivalence with tensor parallelism 2 (2 GPUs,
#                                      # tiny random Qwen3 pair: SmolLM2 has 9 heads)
#   bash bench/gpu_session.sh tp-real  # TP=2 float32 equivalence on the benchmark pair padded for
#                                      # it (eager and graphs, online budget, batch-aware budget,
#                                      # aborts, preemption, ranks' traces compared; 2 GPUs)
#   bash bench/gpu_session.sh tp-bench # TP=2 bf16 tokens/s: plain, chain, DDTree (2 GPUs)
#   bash bench/gpu_session.sh tp-ray   # TP=2 on vLLM's Ray executor, two Ray nodes started by the
#                                      # multi-node overlay's commands, OpenAI server (2 GPUs)
#   bash bench/gpu_session.sh exact    # greedy equivalence with vLLM's batch-invariant kernels
#                                      # (VLLM_BATCH_INVARIANT=1), CUDA graphs, EXACT_DTYPES
#                                      # (float32; "float32 bfloat16" splits the time),
#                                      # with the no-speculation batch-shape control
#   bash bench/gpu_session.sh gap-profile  # cProfile: a plain and a drafting-off step, batch 16
#                                          # (GAP_PROFILE_BATCH, GAP_PROFILE_CONFIGS;
#                                          # GAP_PROFILE_STEADY=N: a steady cell of N
#                                          # requests; GAP_PROFILE_TRACE=1: Chrome traces;
#                                          # GAP_PROFILE_SYNC=1: where the host waits for the GPU;
#                                          # GAP_PROFILE_TEMPERATURE: seeded T > 0;
#                                          # GAP_PROFILE_ROUNDS=N: engines N times, alternating)
#   bash bench/gpu_session.sh flashtests   # GPU tests of trees on FlashAttention (opt-in route)
#   bash bench/gpu_session.sh attention-kernel  # Triton attention with / without the tree
#                                               # bias, or on its 2D / 3D grid
#                                               # (ATTENTION_KERNEL_ARGS), same inputs,
#                                               # no engine (~1 min)
#   bash bench/gpu_session.sh drafter-data   # the drafter's training sequences through vLLM
#                                      # (kept on the machine for the loan's later steps)
#   bash bench/gpu_session.sh drafter-speed  # ms a training step, each way the step can run
#   bash bench/gpu_session.sh drafter-train  # one resumable training run on them
#                                      # (DRAFTER_SEQUENCES, DRAFTER_RESUME, DRAFTER_TRAIN_ARGS)
#   bash bench/gpu_session.sh drafter-eval   # tau against the budget, batch 1 (DDTREE_DRAFTER)
#   bash bench/gpu_session.sh profile  # fused-kernel tests, then where a batch-1 step's host and
#                                      # GPU time goes (bench/profile_step.py; engine core in
#                                      # its own process, traced by vLLM's profiler)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/ddtree-out}"
mkdir -p "$OUT"
VLLM_SITE="${DDTREE_VLLM_SITE:-/opt/vllm-site}"
# A runtime that carries its own torch (vLLM 0.33.0's, tools/gpu-runtime) ships the
# environment the host needs for it (PYTHONPATH, LD_LIBRARY_PATH, cuDNN check).
# shellcheck disable=SC1091  # the staged runtime's file
if [ -f "$VLLM_SITE/ddtree-env.sh" ]; then . "$VLLM_SITE/ddtree-env.sh" || exit 1; fi
FIXTURE="${DDTREE_FIXTURE:-/opt/smollm2-fixture}"
STATE="${DDTREE_STATE:-/opt}"
FUSED_VERDICT="$STATE/ddtree-fused-kernels"
export PYTHONPATH=".:$VLLM_SITE" HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TARGET="${DDTREE_TARGET:-/opt/smollm2-hf}" DATA="$FIXTURE/data"
DRAFTER="${DDTREE_DRAFTER:-bench/fixture/smollm2-dflash}"

# vLLM's torch.compile and Triton's kernel caches from an earlier loan
# (bench/compile_cache.sh): DDTREE_COMPILE_CACHE, a carried compile-cache.tar.gz (or its
# parts .00, .01) that COMPILE_CACHE_SAVE=1 returned, is unpacked once per machine
# before the steps.
if [ -n "${DDTREE_COMPILE_CACHE:-}" ]; then
  COMPILE_CACHE_MARKER="$STATE/ddtree-compile-cache-restored" \
    bash bench/compile_cache.sh restore "$DDTREE_COMPILE_CACHE"
fi

# The series applied to the staged vLLM (every step); `prepare` also converts the
# benchmark target (needs the fixture payload; the 8B cost mode does not).
apply_series() {
  ./apply.sh --site "$VLLM_SITE" > "$OUT/apply.log" 2>&1 || { echo "apply failed"; tail -20 "$OUT/apply.log"; exit 1; }
  # A GPU kernel failure (recorded by `checks`) switches to the unfused paths.
  if [ -f "$FUSED_VERDICT" ]; then
    VLLM_DDTREE_FUSED_KERNELS="$(cat "$FUSED_VERDICT")"; export VLLM_DDTREE_FUSED_KERNELS
  fi
}

# The benchmark target converted from the fixture's GGUF (once per machine). The
# drafter's trainer needs nothing else: it runs without vLLM, so a loan that only trains
# stages the fixture alone and carries the sequences.
convert_target() {
  if [ ! -f "$TARGET/config.json" ]; then
    python3 -m bench.fixture.convert_smollm2 --gguf "$FIXTURE/SmolLM2-135M-Instruct.Q4_1.gguf" \
      --out "$TARGET" > "$OUT/convert.log" 2>&1 || { echo "convert failed"; tail -20 "$OUT/convert.log"; exit 1; }
  fi
}

prepare() {
  convert_target
  apply_series
}

# The benchmark pair padded for tensor parallelism 2 (bench/fixture/pad_heads.py).
TP_TARGET="${DDTREE_TP_TARGET:-/opt/smollm2-hf-tp2}" TP_DRAFTER="${DDTREE_TP_DRAFTER:-/opt/smollm2-dflash-tp2}"
pad_for_tp() {
  for pair in "$TARGET:$TP_TARGET" "$DRAFTER:$TP_DRAFTER"; do
    if [ ! -f "${pair#*:}/config.json" ]; then
      python3 -m bench.fixture.pad_heads --tp 2 --model "${pair%%:*}" --out "${pair#*:}" \
        >> "$OUT/pad-heads.log" 2>&1 || { echo "pad_heads failed"; tail -5 "$OUT/pad-heads.log"; exit 1; }
    fi
  done
}

FUSED_TESTS="tests/unit/test_tree_walk_fused.py tests/unit/test_tree_bias_fused.py
  tests/unit/test_kv_compaction_fused.py tests/unit/test_tree_positions_fused.py
  tests/unit/test_tree_store_fused.py tests/unit/test_speculator_compaction.py
  tests/unit/test_tree_sampler.py"

# The drafter context store's CUDA graphs, GPU tests: a replayed store (the speculator's
# own, and the deferred context's flush copied into its buffers) equals the eager one.
context_graph_tests() {
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_context_store_graphs.py \
    > "$OUT/gpu-context-store-graph-tests.log" 2>&1
  echo "context-store graph tests rc=$?"; tail -2 "$OUT/gpu-context-store-graph-tests.log"
}

# The fused kernels' GPU tests (through the direct launcher, the default); a failure
# switches later steps to the unfused paths. Then the same tests again through Triton's
# own launch path (VLLM_DDTREE_DIRECT_LAUNCH=0): reported, deciding nothing later.
fused_tests() {
  # shellcheck disable=SC2086  # FUSED_TESTS is a list of paths
  if timeout 150 python3 -m pytest -q -x -p no:cacheprovider $FUSED_TESTS > "$OUT/gpu-fused-kernel-tests.log" 2>&1; then
    echo 1 > "$FUSED_VERDICT"
  else
    echo 0 > "$FUSED_VERDICT"; echo "FUSED KERNEL TESTS FAILED: unfused paths from now on"
  fi
  tail -3 "$OUT/gpu-fused-kernel-tests.log"
  VLLM_DDTREE_FUSED_KERNELS="$(cat "$FUSED_VERDICT")"; export VLLM_DDTREE_FUSED_KERNELS
  # shellcheck disable=SC2086
  VLLM_DDTREE_DIRECT_LAUNCH=0 timeout 150 python3 -m pytest -q -p no:cacheprovider $FUSED_TESTS \
    tests/unit/test_direct_launch.py > "$OUT/gpu-triton-launch-tests.log" 2>&1
  echo "triton-launch tests rc=$?"; tail -2 "$OUT/gpu-triton-launch-tests.log"
}

# fixture_bench NAME LIMIT_S [bench/run.py arguments]: the fixture suite on the
# converted pair, results in $OUT/bench-NAME.json, log in $OUT/bench-NAME.log, the
# result lines (and any skipped or failed engine) echoed.
fixture_bench() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 bench/run.py --suite fixture --target "$TARGET" --drafter "$DRAFTER" \
    --data "$DATA" --out "$OUT/bench-$name.json" "$@" > "$OUT/bench-$name.log" 2>&1
  echo "$name bench rc=$?"; grep '^{\|skip\|failed\|cost model' "$OUT/bench-$name.log" | cut -c1-300
}

# sequence_args: one --sequences per directory of DRAFTER_SEQUENCES (separated by
# spaces) into the array seqargs.
sequence_args() {
  local dirs d
  read -r -a dirs <<< "${DRAFTER_SEQUENCES:?DRAFTER_SEQUENCES: the training sequences}"
  seqargs=()
  for d in "${dirs[@]}"; do seqargs+=(--sequences "$d"); done
}

# The device tool returns at most 8 files per call: leave the JSON results loose and
# put everything else (logs, plots, server logs) into one tarball.
pack_out() {
  (
    cd "$OUT" || exit 0
    shopt -s nullglob
    rest=()
    for f in *; do
      case "$f" in *.json|*.tar.gz|compile-cache.tar.gz.[0-9][0-9]|drafter-sequences|drafter-checkpoint) ;; *) rest+=("$f") ;; esac
    done
    if [ "${#rest[@]}" -gt 0 ]; then tar -czf "logs-${STEP}.tar.gz" "${rest[@]}" && rm -rf "${rest[@]}"; fi
    json=(*.json)
    if [ "$(find . -mindepth 1 -maxdepth 1 | wc -l)" -gt 8 ]; then tar -czf "results-${STEP}.tar.gz" "${json[@]}" && rm -f "${json[@]}"; fi
  )
}
[ "$#" -gt 0 ] || set -- none
STEP="$(IFS=-; echo "$*")"
trap pack_out EXIT

# refuse_running_benchmark STEP: stop before STEP when a program of an earlier call's
# step still runs (an outer `timeout` stops this shell, not its python3), which holds
# GPU memory: this step's engines would fail to start. Bound steps with their own
# budgets (BENCH_BUDGET_S, the *_TIMEOUT_S variables) instead.
refuse_running_benchmark() {
  local stray
  stray=$(pgrep -f "python3 (bench/|-m )" | tr '\n' ' ' || true)
  if [ -n "$stray" ]; then
    echo "$1: a benchmark is still running (pids $stray), not starting another" \
      "on the same GPU; wait for it or kill it" >&2
    exit 1
  fi
}

# Several steps may share one device call: `bash bench/gpu_session.sh checks profile`.
for step in "$@"; do
refuse_running_benchmark "$step"
case "$step" in
  checks)
    prepare
    fused_tests
    context_graph_tests
    if [ "${CHECKS_ALGOS:-1}" != 0 ]; then
      timeout 150 python3 bench/bench_algorithms.py --layers 30 --hidden 576 > "$OUT/gpu-bench-algorithms.log" 2>&1
      echo "algos rc=$?"; tail -17 "$OUT/gpu-bench-algorithms.log"
    fi
    timeout 400 python3 bench/gpu_checks.py equiv-real --target "$TARGET" --drafter "$DRAFTER" \
      --data "$DATA" --out "$OUT/gpu-equiv-real-fp32-eager.json" --dtype float32 --num-prompts 16 \
      --max-tokens 64 --budgets 32 --batch-sizes 1 16 > "$OUT/gpu-equiv-real.log" 2>&1
    echo "equiv-real rc=$?"; grep '^{' "$OUT/gpu-equiv-real.log" | cut -c1-400
    ;;
  bench)
    prepare
    read -r -a configs <<< "${BENCH_CONFIGS:-no-spec dflash ddtree-b32 ddtree-b64-t512 dflash-t512 ddtree-b15 ddtree-b16}"
    fixture_bench fixture 560 --plots "$OUT" ${BENCH_PROFILE:+--profile-dir "$OUT"} \
      --configs "${configs[@]}" ${BENCH_BATCH_SIZES:+--batch-sizes $BENCH_BATCH_SIZES} \
      ${BENCH_REPEATS:+--repeats $BENCH_REPEATS} ${BENCH_MIN_REQUESTS:+--min-requests $BENCH_MIN_REQUESTS} \
      ${BENCH_ENGINE_ROUNDS:+--engine-rounds $BENCH_ENGINE_ROUNDS} \
      --time-budget-s "${BENCH_BUDGET_S:-500}" --engine-estimate-s 70
    ;;
  context-graphs)
    context_graph_tests
    ;;
  online)
    # The online budget on the GPU: greedy float32 equivalence with the controller
    # switching budgets (eager, real pair); its log shows the reach-in check and the
    # controller's decisions.
    prepare
    timeout 300 python3 bench/gpu_checks.py equiv-real --target "$TARGET" --drafter "$DRAFTER" \
      --data "$DATA" --out "$OUT/gpu-equiv-real-online-budget-fp32-eager.json" --dtype float32 \
      --num-prompts 16 --max-tokens 96 --budgets 64 --batch-sizes 1 16 > "$OUT/gpu-equiv-online.log" 2>&1
    echo "equiv-real online rc=$?"; grep '^{' "$OUT/gpu-equiv-online.log" | cut -c1-400
    grep -h "DDTree online budget\|ddtree budget:\|reach-in" "$OUT/gpu-equiv-online.log" | head -12 | cut -c1-300
    ;;
  goals)
    # Never slower than plain decoding: plain decoding, the chain (K=15, same cap) and
    # DDTree as the README configures it (online budget on by default), on the held-out
    # sharegpt-untrained set, CUDA graphs, waves; GOALS_CONFIGS orders the engines
    # (alternate it between calls), GOALS_TEMPERATURES, GOALS_BATCH_SIZES;
    # GOALS_ENGINE_ROUNDS=2 runs the engines in both orders within the call (the engine
    # started first ran slow in both orders so far: e.g. GOALS_CONFIGS="no-spec
    # ddtree-b64-t512" GOALS_TEMPERATURES=1 GOALS_ENGINE_ROUNDS=2 fits one call).
    # GOALS_INTERLEAVE=1: every engine alive at once, each cell's repeats taken in turns
    # (bench/run.py --interleave; bench/goals.py then judges on paired runs).
    # GOALS_PROMPT_SETS: another set for a diagnosis (the goal table reads only the
    # held-out sharegpt-untrained, the default).
    prepare
    inter=()
    [ "${GOALS_INTERLEAVE:-0}" = 1 ] && inter=(--interleave)
    read -r -a configs <<< "${GOALS_CONFIGS:-no-spec dflash-t512 ddtree-b64-t512}"
    read -r -a temps <<< "${GOALS_TEMPERATURES:-0 1}"
    read -r -a sizes <<< "${GOALS_BATCH_SIZES:-1 4 16 64}"
    # A steady cell runs GOALS_MIN_WAVES generations of BATCH requests (4): with the
    # suite's 8 requests a cell, batch 16 and 64 ran one generation, 0.5-1.0 s that the
    # controller's first steps and probes dominated
    # (bench/results/2026-12-02-goals-steady-held-out-sharegpt/).
    waves=()
    # Steady cells draw each request's length (0.5-1.5x, the same for every engine,
    # GOALS_LENGTHS=varied): with one length for all, plain decoding's requests finish in
    # the same step and their successors join together, a wave in disguise (8-10
    # prefilling steps a batch-64 cell against DDTree's 109-153,
    # bench/results/2026-12-03-goals-steady-held-out-sharegpt-deferred-context/).
    lengths="${GOALS_LENGTHS:-fixed}"
    if [ "${GOALS_MODE:-waves}" = steady ]; then
      waves=(--min-waves "${GOALS_MIN_WAVES:-4}")
      lengths="${GOALS_LENGTHS:-varied}"
    fi
    fixture_bench "goals-${GOALS_TAG:-r1}" 570 --configs "${configs[@]}" "${waves[@]}" \
      --prompt-sets "${GOALS_PROMPT_SETS:-sharegpt-untrained}" --temperatures "${temps[@]}" \
      --batch-sizes "${sizes[@]}" --repeats "${GOALS_REPEATS:-3}" \
      --engine-rounds "${GOALS_ENGINE_ROUNDS:-1}" \
      --max-tokens "${GOALS_MAX_TOKENS:-192}" --cell-mode "${GOALS_MODE:-waves}" "${inter[@]}" \
      --output-lengths "$lengths" \
      --time-budget-s "${BENCH_BUDGET_S:-540}" --engine-estimate-s 80
    ;;
  serve)
    prepare
    timeout 500 python3 bench/serve_e2e.py --target "$TARGET" --drafter "$DRAFTER" \
      --dtype "${SERVE_DTYPE:-auto}" ${SERVE_STRICT:+--strict-greedy} \
      ${SERVE_PLAIN:+--plain-server} ${SERVE_DEFAULTS:+--server-defaults} \
      ${SERVE_ENTRYPOINT:+--server-entrypoint deploy/k8s/base/ddtree.env} \
      --out "$OUT/serve-e2e.json" --log-dir "$OUT" --time-budget 460 > "$OUT/serve-e2e.log" 2>&1
    echo "serve rc=$?"; tail -40 "$OUT/serve-e2e.log" | cut -c1-300
    ;;
  cost)
    apply_series
    # The start-up cost model's timer ("auto") against CUDA-graph replays first.
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/unit/test_cost_model_gpu.py \
      > "$OUT/gpu-cost-model-timer-tests.log" 2>&1
    echo "cost-model timer tests rc=$?"; tail -2 "$OUT/gpu-cost-model-timer-tests.log"
    # COST_PROFILE=0: no step profile (its events cost DDTree host time; goal runs);
    # COST_REPEATS (3: one repeat a cell is one 64-step wave, in which the controller
    # is still learning), COST_ENGINE_ROUNDS (alternating engine order), COST_MAX_TOKENS,
    # COST_BATCH_SIZES (default: the suite's 1 4 16 64).
    cost_profile=(--profile-dir "$OUT")
    [ "${COST_PROFILE:-1}" = 0 ] && cost_profile=()
    # COST_INTERLEAVE=1: the engines alive at once, repeats in turns (bench/run.py --interleave).
    [ "${COST_INTERLEAVE:-0}" = 1 ] && cost_profile+=(--interleave)
    # shellcheck disable=SC2086  # lists of words
    timeout "${COST_TIMEOUT_S:-500}" python3 bench/run.py --suite cost8b --out "$OUT/bench-cost8b.json" \
      "${cost_profile[@]}" \
      ${COST_CONFIGS:+--configs $COST_CONFIGS} --repeats "${COST_REPEATS:-3}" \
      ${COST_ENGINE_ROUNDS:+--engine-rounds $COST_ENGINE_ROUNDS} \
      ${COST_MAX_TOKENS:+--max-tokens $COST_MAX_TOKENS} \
      ${COST_BATCH_SIZES:+--batch-sizes $COST_BATCH_SIZES} \
      --time-budget-s "${BENCH_BUDGET_S:-440}" --engine-estimate-s "${COST_ENGINE_ESTIMATE_S:-120}" \
      > "$OUT/bench-cost8b.log" 2>&1
    echo "cost rc=$?"; grep '^{\|skip\|failed' "$OUT/bench-cost8b.log" | cut -c1-300
    ;;
  algos)
    prepare
    timeout 300 python3 bench/bench_algorithms.py --layers 30 --hidden 576 > "$OUT/gpu-bench-algorithms.log" 2>&1
    echo "algos rc=$?"; tail -20 "$OUT/gpu-bench-algorithms.log"
    ;;
  lossless)
    # DDTree == decoding without speculation, greedy and seeded T > 0, float32, on the
    # real pair: LOSSLESS_MODES (eager, graphs), LOSSLESS_VARIANTS, LOSSLESS_SAMPLING,
    # LOSSLESS_PROMPT_SET, LOSSLESS_MAX_TOKENS; one result file per graph mode.
    # LOSSLESS_SAMPLING=seeded-features: requests decoded without drafts (penalties, bad
    # words, a JSON grammar) mixed with tree requests in each batch; seeded-logprobs:
    # the tree sampler's logprobs against plain decoding's (max_logprob_abs_diff).
    # seeded-prompt-logprobs: prompt logprobs (max_prompt_logprob_abs_diff).
    prepare
    read -r -a lmodes <<< "${LOSSLESS_MODES:-eager}"
    for m in "${lmodes[@]}"; do
      # shellcheck disable=SC2086  # lists of words
      timeout "${LOSSLESS_TIMEOUT_S:-540}" python3 bench/gpu_checks.py equiv-real --target "$TARGET" \
        --drafter "$DRAFTER" --data "$DATA" --out "$OUT/equiv-smollm2-fp32-$m.json" --dtype float32 \
        --num-prompts 16 --max-tokens "${LOSSLESS_MAX_TOKENS:-128}" --budgets 32 --batch-sizes 1 16 \
        --eager-modes "$m" --prompt-set "${LOSSLESS_PROMPT_SET:-sharegpt}" --target-name smollm2-135m \
        --sampling ${LOSSLESS_SAMPLING:-greedy seeded seeded-topk-topp seeded-min-tokens} --near-ties \
        ${LOSSLESS_VARIANTS:+--variants $LOSSLESS_VARIANTS} > "$OUT/equiv-$m.log" 2>&1
      echo "lossless $m rc=$?"; grep '^{' "$OUT/equiv-$m.log" | cut -c1-600
    done
    ;;
  shapes)
    # Tiny random targets of the families public DFlash drafters serve (dummy weights,
    # float32, eager): SHAPES (qwen3 llama3 qwen3-moe; qwen3-moe needs vLLM's MoE kernels).
    # SHAPES_DRAFTER=dflash2: a tiny random DFlash2 drafter (block 8; vLLM 0.33.0).
    # SHAPES_NO_CHAIN=1: DDTree only (vLLM's chain engine left out).
    apply_series
    sdrafter="${SHAPES_DRAFTER:-dflash}"
    # shellcheck disable=SC2086  # a list of shapes
    timeout "${SHAPES_TIMEOUT_S:-300}" python3 bench/gpu_checks.py equiv --out "$OUT/equiv-tiny-shapes-$sdrafter-fp32-eager.json" \
      --dtype float32 --num-prompts 16 --max-tokens 64 --budgets 32 --batch-sizes 1 16 \
      --drafter-kind "$sdrafter" --target-shapes ${SHAPES:-qwen3 llama3 qwen3-moe} \
      --sampling greedy seeded ${SHAPES_NO_CHAIN:+--no-chain} > "$OUT/equiv-shapes.log" 2>&1
    echo "shapes rc=$?"; grep '^{' "$OUT/equiv-shapes.log" | cut -c1-300
    ;;
  graphs)
    prepare
    timeout 560 python3 bench/gpu_checks.py equiv-real --target "$TARGET" --drafter "$DRAFTER" \
      --data "$DATA" --out "$OUT/gpu-equiv-real-fp32-graphs.json" --dtype float32 --num-prompts 16 \
      --max-tokens 64 --budgets 32 --batch-sizes 1 16 --eager-modes graphs \
      ${EQUIV_VARIANTS:+--variants $EQUIV_VARIANTS} > "$OUT/gpu-equiv-real-graphs.log" 2>&1
    echo "equiv-real graphs rc=$?"; grep '^{' "$OUT/gpu-equiv-real-graphs.log" | cut -c1-400
    ;;
  ci)
    prepare
    timeout 560 python3 bench/run.py --suite ci --target "$TARGET" --drafter "$DRAFTER" --data "$DATA" \
      --out "$OUT/ci-latest.json" > "$OUT/ci-latest.log" 2>&1
    echo "ci rc=$?"; grep '^{\|failed' "$OUT/ci-latest.log" | cut -c1-300
    ;;
  tp)
    # SmolLM2-135M has 9 attention heads (not divisible by 2): tensor parallelism is
    # checked on the tiny random Qwen3 pair (4 heads, 2 KV heads; dummy weights,
    # float32), eager and with CUDA graphs, batch 1 and 16, against TP=2 without
    # speculation. Diverging trees on the two ranks would hang or break the match.
    apply_series
    DDTREE_CHECK_TP=2 timeout 560 python3 bench/gpu_checks.py equiv --out "$OUT/gpu-equiv-tiny-tp2.json" \
      --dtype float32 --num-prompts 16 --max-tokens 64 --budgets 32 --batch-sizes 1 16 \
      --eager-modes eager graphs > "$OUT/gpu-equiv-tiny-tp2.log" 2>&1
    echo "tp rc=$?"; grep '^{' "$OUT/gpu-equiv-tiny-tp2.log" | cut -c1-400
    ;;
  tp-real)
    # Tensor parallelism 2 on the benchmark pair itself: SmolLM2 and its drafter have 9
    # query / 3 KV heads, so both are padded with zero heads that change no output
    # (bench/fixture/pad_heads.py: 12 / 4), and the trained drafter accepts as on one GPU.
    # Float32, greedy and seeded, TP_MODES (eager graphs), against TP=2 without
    # speculation; the online budget controller on (ddtree-async), the batch-aware
    # budget (ddtree-tokens-per-step), aborts, preemption; each DDTree engine's ranks
    # trace what they verified every step (VLLM_DDTREE_RANK_TRACE) and must agree.
    prepare
    pad_for_tp
    read -r -a tmodes <<< "${TP_MODES:-eager graphs}"
    for m in "${tmodes[@]}"; do
      # shellcheck disable=SC2086  # lists of words
      DDTREE_CHECK_TP=2 timeout "${TP_TIMEOUT_S:-540}" python3 bench/gpu_checks.py equiv-real \
        --target "$TP_TARGET" --drafter "$TP_DRAFTER" --data "$DATA" \
        --out "$OUT/equiv-smollm2-padded-tp2-fp32-$m.json" --dtype float32 --num-prompts 16 \
        --max-tokens "${TP_MAX_TOKENS:-96}" --budgets 32 --batch-sizes 1 16 --eager-modes "$m" \
        --prompt-set sharegpt --target-name smollm2-135m-padded-tp2 --near-ties \
        --sampling ${TP_SAMPLING:-greedy seeded} \
        --variants ${TP_VARIANTS:-ddtree-async ddtree-tokens-per-step ddtree-preempt no-spec-preempt} \
        > "$OUT/equiv-tp2-$m.log" 2>&1
      echo "tp-real $m rc=$?"; grep '^{' "$OUT/equiv-tp2-$m.log" | cut -c1-400
    done
    ;;
  tp-bench)
    # Tokens/s with tensor parallelism 2, bf16, CUDA graphs: plain decoding, the chain
    # and DDTree on the padded benchmark pair (tp-real), held-out sharegpt-untrained,
    # engines interleaved (TP_BENCH_CONFIGS, TP_BENCH_BATCH_SIZES, TP_BENCH_TEMPERATURES).
    prepare
    pad_for_tp
    read -r -a configs <<< "${TP_BENCH_CONFIGS:-no-spec dflash-t512 ddtree-b64-t512}"
    # shellcheck disable=SC2086  # lists of words
    TARGET="$TP_TARGET" DRAFTER="$TP_DRAFTER" fixture_bench tp2 570 --configs "${configs[@]}" \
      --tensor-parallel-size 2 --interleave --prompt-sets sharegpt-untrained \
      --temperatures ${TP_BENCH_TEMPERATURES:-0} --batch-sizes ${TP_BENCH_BATCH_SIZES:-1 16} \
      --repeats "${TP_BENCH_REPEATS:-3}" --max-tokens 192 --cell-mode steady --min-waves 4 \
      --output-lengths varied --time-budget-s "${BENCH_BUDGET_S:-540}" --engine-estimate-s 120
    ;;
  tp-ray)
    # vLLM's Ray executor, TP=2, as the multi-node overlay starts it: the
    # LeaderWorkerSet's leader command (Ray head, then the image's entrypoint) on GPU 0,
    # its worker command (joins the head) on GPU 1, two Ray nodes on one host; DDTree
    # served through the OpenAI server, float32, greedy and seeded answers against the
    # same cluster serving without speculation (bench/serve_ray.py).
    prepare
    pad_for_tp
    timeout 560 python3 bench/serve_ray.py --target "$TP_TARGET" --drafter "$TP_DRAFTER" \
      --overlay deploy/k8s/overlays/multi-node-ray --out "$OUT/serve-ray-tp2.json" \
      --log-dir "$OUT/serve-ray" --time-budget 520 > "$OUT/serve-ray.log" 2>&1
    echo "tp-ray rc=$?"; tail -30 "$OUT/serve-ray.log" | cut -c1-300
    ;;
  exact)
    prepare
    # One dtype per device call by default: a float32 engine took 99 s to start in
    # this mode (76 s of compilation) and both dtypes ran past 285 s each
    # (bench/results/exact/).
    read -r -a dtypes <<< "${EXACT_DTYPES:-float32}"
    for dt in "${dtypes[@]}"; do
      VLLM_BATCH_INVARIANT=1 timeout $((560 / ${#dtypes[@]})) python3 bench/gpu_checks.py equiv-real --target "$TARGET" \
        --drafter "$DRAFTER" --data "$DATA" --out "$OUT/gpu-equiv-real-$dt-graphs-batch-invariant.json" \
        --dtype "$dt" --num-prompts 16 --max-tokens 64 --budgets 32 --batch-sizes 1 16 --eager-modes graphs \
        --variants no-spec-batch-shape ddtree-async ddtree-preempt dflash-chain \
        > "$OUT/gpu-equiv-real-$dt-batch-invariant.log" 2>&1
      echo "exact $dt rc=$?"; grep '^{' "$OUT/gpu-equiv-real-$dt-batch-invariant.log" | cut -c1-300
    done
    ;;
  flashtests)
    # Trees verified on FlashAttention (VLLM_DDTREE_TREE_ATTENTION=flash, opt-in): the
    # GPU tests against the dense reference.
    prepare
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_tree_attention_flash.py \
      tests/unit/test_tree_attention_split.py > "$OUT/gpu-flash-tree-tests.log" 2>&1
    echo "flash tree tests rc=$?"; tail -3 "$OUT/gpu-flash-tree-tests.log"
    ;;
  gap-profile)
    # cProfile and torch.profiler of plain decoding beside DDTree with drafting off, at
    # GAP_PROFILE_BATCH requests (in the engine rounds a drafting-off step cost what a
    # plain one did at batch 4 and 0.3-0.6 ms more at 16); one cProfile table per config
    # in profile.tar.gz (with GAP_PROFILE_ROUNDS, round R's in profile-round-R.tar.gz).
    prepare
    mkdir -p "$OUT/profile"
    read -r -a pconfigs <<< "${GAP_PROFILE_CONFIGS:-no-spec ddtree-b64-t512-d4}"
    # GAP_PROFILE_STEADY=N: a constant-concurrency cell of N requests instead of one
    # wave (steps that prefill a joining request cost 4-9x a decode step,
    # bench/results/2026-11-30-steady-concurrency-cost8b-auto/).
    # One process per engine: a second engine with FULL graphs in a process that
    # held one failed its capture (CUDACachingAllocator use_count assert,
    # bench/results/2026-11-30-steady-full-graphs-host-profile/).
    # GAP_PROFILE_ROUNDS=N: every engine N times, in alternating order (A B, B A, ...),
    # each round's files in profile/round-R/: one pass per engine cannot tell the
    # engines apart from engine-to-engine noise (+-20 %).
    # GAP_PROFILE_SUITE=cost8b: Qwen3-8B's shape with dummy weights and random prompts
    # (a budget-0 step cost ~1.05x a plain one at batch 16 there); compare two engines'
    # kernels per step afterwards with bench/profile_step.py --compare-kernels A B.
    rounds="${GAP_PROFILE_ROUNDS:-1}"
    for ((r = 1; r <= rounds; r++)); do
      order=("${pconfigs[@]}")
      if ((r % 2 == 0)); then
        order=()
        for ((k = ${#pconfigs[@]} - 1; k >= 0; k--)); do order+=("${pconfigs[k]}"); done
      fi
      pdir="$OUT/profile"
      if ((rounds > 1)); then pdir="$OUT/profile/round-$r"; fi
      mkdir -p "$pdir"
      for config in "${order[@]}"; do
        timeout 420 python3 bench/profile_step.py --engine-process inproc --batch-size "${GAP_PROFILE_BATCH:-16}" \
          --configs "$config" --max-tokens 64 --out-dir "$pdir" \
          --temperature "${GAP_PROFILE_TEMPERATURE:-0}" --suite "${GAP_PROFILE_SUITE:-fixture}" \
          ${GAP_PROFILE_STEADY:+--steady-requests "$GAP_PROFILE_STEADY"} ${GAP_PROFILE_TRACE:+--trace} \
          ${GAP_PROFILE_SYNC:+--sync-stacks} \
          >> "$OUT/profile/profile-step.log" 2>&1
        echo "gap profile round $r $config rc=$?"
      done
      # Each finished round in its own tarball at once: a call that runs past its limit
      # keeps the rounds it finished, and the device returns a bounded number of files
      # (a timed-out call once returned 8 of 13 loose ones).
      if ((rounds > 1)); then
        tar -C "$OUT/profile" -czf "$OUT/profile-round-$r.tar.gz" "round-$r" && rm -rf "$pdir"
      fi
    done
    grep '^{' "$OUT/profile/profile-step.log" | cut -c1-400
    tar -C "$OUT" -czf "$OUT/profile.tar.gz" profile && rm -rf "$OUT/profile"
    ;;
  attention-kernel)
    # Triton's unified attention with and without the tree-bias argument on identical
    # decode inputs at Qwen3-8B's attention shape, outside the engine (a budget-0 step's
    # attention ran 18 % longer in DDTree's engine than in plain decoding's on Triton):
    # bench/attention_kernel.py -> $OUT/attention-kernel.json. No engine: ~1 min.
    # ATTENTION_KERNEL_ARGS: its options, e.g. "--compare split --shape smollm2
    # --batch-sizes 16 32 48 64 128" (vLLM's 2D grid against its 3D one on the pair's
    # target; a budget-0 step's attention at batch 64 runs the 2D grid).
    prepare
    # shellcheck disable=SC2086  # a list of options
    timeout 300 python3 bench/attention_kernel.py --out "$OUT/attention-kernel.json" \
      ${ATTENTION_KERNEL_ARGS:-} > "$OUT/attention-kernel.log" 2>&1
    echo "attention-kernel rc=$?"; grep '^{' "$OUT/attention-kernel.log" | cut -c1-300
    ;;
  drafter-data)
    # The drafter's training sequences, generated by the target through vLLM (prompts of
    # the training split only: bench/fixture/generate_drafter_data.py) ->
    # $OUT/drafter-sequences/ (files of at most 14 MiB), and kept on the machine in
    # $STATE/drafter-sequences/DRAFTER_DATA_NAME (default "data"), which later steps of
    # the same loan name in DRAFTER_SEQUENCES without carrying the files back;
    # DRAFTER_DATA_ARGS: its options.
    prepare
    kept="$STATE/drafter-sequences/${DRAFTER_DATA_NAME:-data}"
    rm -rf "$kept"
    # It stops at its deadline (DRAFTER_DATA_DEADLINE_S, before the call's limit) and
    # keeps the answers finished by then.
    # shellcheck disable=SC2086  # a list of options
    timeout 540 python3 -m bench.fixture.generate_drafter_data --target "$TARGET" --data "$DATA" \
      --out "$kept" --deadline-s "${DRAFTER_DATA_DEADLINE_S:-460}" ${DRAFTER_DATA_ARGS:-} \
      > "$OUT/drafter-data.log" 2>&1
    echo "drafter-data rc=$? (kept in $kept)"; tail -3 "$OUT/drafter-data.log" | cut -c1-600
    [ -d "$kept" ] && cp -r "$kept" "$OUT/drafter-sequences"
    ;;
  drafter-speed)
    # Milliseconds a training step for each way the trainer can run it (dense or
    # FlexAttention, eager or compiled), from the same weights over the same batches of
    # DRAFTER_SEQUENCES (bench/drafter_train_speed.py) -> $OUT/drafter-train-speed.json;
    # DRAFTER_SPEED_ARGS: its options (--layers, --variants, --profile VARIANT, ...).
    convert_target
    sequence_args
    # shellcheck disable=SC2086  # a list of options
    timeout 570 python3 bench/drafter_train_speed.py --target "$TARGET" "${seqargs[@]}" \
      --out "$OUT/drafter-train-speed.json" ${DRAFTER_SPEED_ARGS:-} \
      > "$OUT/drafter-speed.log" 2>&1
    echo "drafter-speed rc=$?"; grep '^{' "$OUT/drafter-speed.log" | cut -c1-400
    ;;
  drafter-train)
    # One training run on DRAFTER_SEQUENCES (carried drafter-data output directories,
    # separated by spaces: the trainer reads them all), resuming
    # from DRAFTER_RESUME (a carried checkpoint) when set, or starting a new schedule from
    # DRAFTER_INIT_FROM's weights (a finished checkpoint); the checkpoint comes back in
    # $OUT/drafter-checkpoint (python3 -m bench.fixture.export_drafter makes the vLLM
    # drafter of it). DRAFTER_EVAL_SEQUENCES: the evaluation's target responses from an
    # earlier call (else generated and returned as $OUT/drafter-eval-responses.json.gz).
    # DRAFTER_TRAIN_ARGS: the recipe's options (--layers, --total-steps, ...;
    # --eval-tree-budgets 8 16 32 64 128 also simulates DDTree's trees after training,
    # outside the deadline's --eval-reserve-s).
    convert_target
    sequence_args
    # shellcheck disable=SC2086  # a list of options
    timeout 570 python3 -m bench.fixture.train_dflash_drafter --target "$TARGET" --data "$DATA" \
      --out /opt/drafter-run --checkpoint "$OUT/drafter-checkpoint" "${seqargs[@]}" \
      ${DRAFTER_RESUME:+--resume "$DRAFTER_RESUME"} \
      ${DRAFTER_INIT_FROM:+--init-from "$DRAFTER_INIT_FROM"} --deadline-s "${DRAFTER_DEADLINE_S:-530}" \
      --eval-sequences "${DRAFTER_EVAL_SEQUENCES:-$OUT/drafter-eval-responses.json.gz}" \
      ${DRAFTER_TRAIN_ARGS:-} > "$OUT/drafter-train.log" 2>&1
    echo "drafter-train rc=$?"; tail -4 "$OUT/drafter-train.log" | cut -c1-400
    cp /opt/drafter-run/eval.json "$OUT/drafter-eval.json" 2>/dev/null
    cp /opt/drafter-run/train_log.jsonl "$OUT/drafter-train-log.jsonl" 2>/dev/null
    ;;
  drafter-eval)
    # Tau against the budget at batch 1: the chain and DDTree with fixed budgets
    # (DRAFTER_EVAL_CONFIGS), HumanEval, held-out ShareGPT and sharegpt-untrained, T=0
    # and T=1 -> bench-drafter-eval.json; bench/drafter_report.py makes drafter.json.
    # DRAFTER_EVAL_REQUESTS requests a cell (32; the suite's default of 8 requests of
    # 128 tokens left a cell's tau to a handful of prompts), each answer at most 256
    # tokens and ending at the target's EOS, as in the trainer's offline evaluation
    # (the goal runs' fixed lengths continue past EOS, text no drafter was trained on).
    prepare
    read -r -a configs <<< "${DRAFTER_EVAL_CONFIGS:-dflash ddtree-b8+static ddtree-b32+static ddtree-b128+static}"
    fixture_bench drafter-eval 570 --configs "${configs[@]}" --batch-sizes 1 \
      --min-requests "${DRAFTER_EVAL_REQUESTS:-32}" --max-tokens 256 --output-lengths eos \
      --prompt-sets humaneval sharegpt sharegpt-untrained --temperatures 0 1 --repeats 1 \
      --time-budget-s "${BENCH_BUDGET_S:-540}" --engine-estimate-s 80
    ;;
  profile)
    prepare
    [ -f "$FUSED_VERDICT" ] || fused_tests
    mkdir -p "$OUT/profile"
    read -r -a pconfigs <<< "${PROFILE_CONFIGS:-dflash ddtree-b32}"
    # PROFILE_MODE=inproc: cProfile + torch.profiler in the benchmark's process
    # (bench/results/profile/).
    timeout 420 python3 bench/profile_step.py --engine-process "${PROFILE_MODE:-mp}" \
      --configs "${pconfigs[@]}" --max-tokens 64 ${PROFILE_TRACE:+--trace} \
      --out-dir "$OUT/profile" > "$OUT/profile/profile-step.log" 2>&1
    echo "profile rc=$?"; grep '^{' "$OUT/profile/profile-step.log" | cut -c1-400
    tar -C "$OUT" -czf "$OUT/profile.tar.gz" profile && rm -rf "$OUT/profile"
    ;;
  *) echo "usage: $0 STEP [STEP ...], STEP = checks|bench|online|goals|serve|cost|algos|lossless|shapes|graphs|ci|tp|tp-real|tp-bench|tp-ray|exact|flashtests|gap-profile|attention-kernel|profile|drafter-data|drafter-speed|drafter-train|drafter-eval" >&2; exit 2 ;;
esac
done
# COMPILE_CACHE_SAVE=1: the compile caches back in $OUT (one file of at most 15 MiB, or
# two parts), for DDTREE_COMPILE_CACHE on a later loan.
if [ "${COMPILE_CACHE_SAVE:-0}" = 1 ]; then
  bash bench/compile_cache.sh save "$OUT/compile-cache.tar.gz"
fi
