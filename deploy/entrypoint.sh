#!/usr/bin/env bash
# Entrypoint of the vllm-ddtree image: turns environment variables into one
# `vllm serve` command line and execs it. Arguments given to the container are
# appended to that command line.
#
#   MODEL                   target model: a directory (checked to exist) or a hub id   (required)
#   DDTREE_DRAFTER          DFlash drafter directory or hub id; enables DDTree
#   DDTREE_BUDGET           tree node budget B = num_speculative_tokens    (required with DDTREE_DRAFTER)
#   DDTREE_MAX_DEPTH        optional tree depth limit (default: drafter block size - 1)
#   DDTREE_TOKENS_PER_STEP  optional: verified tokens per forward to aim for; the budget then
#                           shrinks as the batch grows (ddtree_tokens_per_step, >= 2, or
#                           auto: measured by the engine at start-up)
#   DDTREE_DISABLE_BY_BATCH_SIZE  optional: from this many running requests on, decode
#                           without drafts (ddtree_disable_by_batch_size, >= 2)
#   SPECULATIVE_CONFIG      raw JSON for --speculative-config, instead of the DDTREE_* variables
#   TENSOR_PARALLEL_SIZE    GPUs per model replica
#   PIPELINE_PARALLEL_SIZE  pipeline stages (DDTree does not support more than 1 yet)
#   DISTRIBUTED_EXECUTOR_BACKEND  mp | ray | uni | external_launcher
#   MAX_MODEL_LEN           context length
#   GPU_MEMORY_UTILIZATION  fraction of GPU memory vLLM may use, in (0, 1]
#   SERVED_MODEL_NAME       name clients use in requests
#   HOST, PORT              listen address (default 0.0.0.0:8000)
#   EXTRA_ARGS              more `vllm serve` arguments, split like a shell would (quotes work)
#
# `entrypoint.sh --print ...` or DRY_RUN=1 validates and prints the command instead of running it.
# Invalid settings print one line naming the variable and exit with status 2.
set -euo pipefail

die() {
    printf 'entrypoint: error: %s\n' "$*" >&2
    exit 2
}

is_positive_int() {
    [[ $1 =~ ^[1-9][0-9]*$ ]]
}

# require_positive_int NAME: the variable NAME, if set and non-empty, must be a positive integer.
require_positive_int() {
    local name=$1 value=${!1:-}
    if [[ -n $value ]] && ! is_positive_int "$value"; then
        die "$name must be a positive integer, got '$value'"
    fi
}

# require_existing_path NAME: a value that looks like a path (starts with / or .) must exist,
# so a missing volume mount fails here with its name rather than deep inside vLLM.
require_existing_path() {
    local name=$1 value=${!1}
    if [[ $value == /* || $value == .* ]] && [[ ! -e $value ]]; then
        die "$name=$value does not exist (is the model volume mounted?)"
    fi
}

dry_run=${DRY_RUN:-0}
if [[ ${1:-} == --print ]]; then
    dry_run=1
    shift
fi
[[ $dry_run == 0 || $dry_run == 1 ]] || die "DRY_RUN must be 0 or 1, got '$dry_run'"

[[ -n ${MODEL:-} ]] || die "MODEL is not set: give the target model's directory (or hub id)"
require_existing_path MODEL

# The settings that shape the DDTree speculative config besides DDTREE_DRAFTER.
ddtree_settings=(DDTREE_BUDGET DDTREE_MAX_DEPTH DDTREE_TOKENS_PER_STEP DDTREE_DISABLE_BY_BATCH_SIZE)

for name in "${ddtree_settings[@]}" TENSOR_PARALLEL_SIZE PIPELINE_PARALLEL_SIZE MAX_MODEL_LEN; do
    [[ $name == DDTREE_TOKENS_PER_STEP ]] || require_positive_int "$name"
done
# DDTREE_TOKENS_PER_STEP=auto: the engine measures the token target at start-up.
if [[ -n ${DDTREE_TOKENS_PER_STEP:-} && $DDTREE_TOKENS_PER_STEP != auto ]]; then
    if ! is_positive_int "$DDTREE_TOKENS_PER_STEP"; then
        die "DDTREE_TOKENS_PER_STEP must be a positive integer or auto, got '$DDTREE_TOKENS_PER_STEP'"
    fi
    if ((DDTREE_TOKENS_PER_STEP < 2)); then
        die "DDTREE_TOKENS_PER_STEP must be at least 2 (verified tokens per forward) or auto, got '$DDTREE_TOKENS_PER_STEP'"
    fi
fi
if [[ -n ${DDTREE_DISABLE_BY_BATCH_SIZE:-} ]] && ((DDTREE_DISABLE_BY_BATCH_SIZE < 2)); then
    die "DDTREE_DISABLE_BY_BATCH_SIZE must be at least 2 (at 1 nothing would be drafted), got '$DDTREE_DISABLE_BY_BATCH_SIZE'"
fi

port=${PORT:-8000}
if ! is_positive_int "$port" || ((port > 65535)); then
    die "PORT must be an integer in 1..65535, got '$port'"
fi

if [[ -n ${GPU_MEMORY_UTILIZATION:-} ]] &&
    ! [[ $GPU_MEMORY_UTILIZATION =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]]; then
    die "GPU_MEMORY_UTILIZATION must be a number in (0, 1], got '$GPU_MEMORY_UTILIZATION'"
fi

case ${DISTRIBUTED_EXECUTOR_BACKEND:-} in
    "" | mp | ray | uni | external_launcher) ;;
    *) die "DISTRIBUTED_EXECUTOR_BACKEND must be one of mp, ray, uni, external_launcher; got '$DISTRIBUTED_EXECUTOR_BACKEND'" ;;
esac

# The speculative config: either built from DDTREE_* or taken verbatim from SPECULATIVE_CONFIG.
speculative_config=""
if [[ -n ${SPECULATIVE_CONFIG:-} ]]; then
    for name in DDTREE_DRAFTER "${ddtree_settings[@]}"; do
        [[ -z ${!name:-} ]] || die "set either SPECULATIVE_CONFIG or $name, not both"
    done
    speculative_config=$(python3 -c '
import json, os, sys
try:
    config = json.loads(os.environ["SPECULATIVE_CONFIG"])
except json.JSONDecodeError as exc:
    sys.exit(f"SPECULATIVE_CONFIG is not valid JSON: {exc}")
if not isinstance(config, dict):
    sys.exit("SPECULATIVE_CONFIG must be a JSON object")
print(json.dumps(config))
' 2>&1) || die "$speculative_config"
elif [[ -n ${DDTREE_DRAFTER:-} ]]; then
    require_existing_path DDTREE_DRAFTER
    [[ -n ${DDTREE_BUDGET:-} ]] ||
        die "DDTREE_BUDGET is not set: give the tree node budget B (num_speculative_tokens) for DDTREE_DRAFTER"
    speculative_config=$(python3 -c '
import json, os
config = {"method": "ddtree", "model": os.environ["DDTREE_DRAFTER"],
          "num_speculative_tokens": int(os.environ["DDTREE_BUDGET"])}
if os.environ.get("DDTREE_MAX_DEPTH"):
    config["ddtree_max_depth"] = int(os.environ["DDTREE_MAX_DEPTH"])
tokens = os.environ.get("DDTREE_TOKENS_PER_STEP")
if tokens:
    config["ddtree_tokens_per_step"] = tokens if tokens == "auto" else int(tokens)
if os.environ.get("DDTREE_DISABLE_BY_BATCH_SIZE"):
    config["ddtree_disable_by_batch_size"] = int(os.environ["DDTREE_DISABLE_BY_BATCH_SIZE"])
print(json.dumps(config))
')
else
    for name in "${ddtree_settings[@]}"; do
        [[ -z ${!name:-} ]] || die "$name is set but DDTREE_DRAFTER is not"
    done
    echo "entrypoint: no DDTREE_DRAFTER or SPECULATIVE_CONFIG: serving without speculative decoding" >&2
fi

# Both branches above print the config with json.dumps, so the method reads the same way.
if [[ ${PIPELINE_PARALLEL_SIZE:-1} != 1 && $speculative_config == *'"method": "ddtree"'* ]]; then
    die "PIPELINE_PARALLEL_SIZE=$PIPELINE_PARALLEL_SIZE: DDTree does not support pipeline parallelism yet; use TENSOR_PARALLEL_SIZE"
fi

cmd=(vllm serve "$MODEL" --host "${HOST:-0.0.0.0}" --port "$port")
[[ -z ${SERVED_MODEL_NAME:-} ]] || cmd+=(--served-model-name "$SERVED_MODEL_NAME")
[[ -z ${TENSOR_PARALLEL_SIZE:-} ]] || cmd+=(--tensor-parallel-size "$TENSOR_PARALLEL_SIZE")
[[ -z ${PIPELINE_PARALLEL_SIZE:-} ]] || cmd+=(--pipeline-parallel-size "$PIPELINE_PARALLEL_SIZE")
[[ -z ${DISTRIBUTED_EXECUTOR_BACKEND:-} ]] || cmd+=(--distributed-executor-backend "$DISTRIBUTED_EXECUTOR_BACKEND")
[[ -z ${MAX_MODEL_LEN:-} ]] || cmd+=(--max-model-len "$MAX_MODEL_LEN")
[[ -z ${GPU_MEMORY_UTILIZATION:-} ]] || cmd+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
[[ -z $speculative_config ]] || cmd+=(--speculative-config "$speculative_config")

if [[ -n ${EXTRA_ARGS:-} ]]; then
    # Split like a shell would, without evaluating anything: NUL-separated words from shlex.
    split_words='import os, shlex, sys; sys.stdout.write("".join(w + "\0" for w in shlex.split(os.environ["EXTRA_ARGS"])))'
    python3 -c "$split_words" >/dev/null 2>&1 ||
        die "EXTRA_ARGS cannot be split into arguments (unbalanced quotes?): $EXTRA_ARGS"
    mapfile -d '' -t extra < <(python3 -c "$split_words")
    cmd+=("${extra[@]}")
fi
cmd+=("$@")

if [[ $dry_run == 1 ]]; then
    printf '%q' "${cmd[0]}"
    printf ' %q' "${cmd[@]:1}"
    printf '\n'
    exit 0
fi
exec "${cmd[@]}"
