# shellcheck shell=bash
# Shared by launchers/serve_*.sh (sourced, not run): parse the options, print the exact command,
# then exec an unmodified `vllm serve`. The flags and their order are those of
# launchers/commands.py (`vlm-reward-proxy up`); tests/launchers checks that both agree.
#
# The sourcing script sets: SCRIPT_NAME, MODEL_LABEL, MODEL_PATH_ENV, DEFAULT_SERVED_NAME,
# DEFAULT_PORT, DEFAULT_LIMIT_MM, LAYOUT_NOTE.

MEDIA_IO_KWARGS='{"video": {"num_frames": -1}}'
# --cpu: launchers/commands.py CPU_ARGS (a CPU build of vLLM; the reasons are written there).
CPU_ARGS=(--enforce-eager --max-num-batched-tokens 16384 --dtype float32 --kv-cache-memory-bytes 128M)
# Flags this script owns; repeating them among the pass-through flags would override the plan.
MANAGED_FLAGS=" --served-model-name --tensor-parallel-size -tp --max-model-len
 --gpu-memory-utilization --limit-mm-per-prompt --media-io-kwargs --trust-request-mm-kwargs
 --host --port --seed "

_usage() {
    cat <<EOF
Usage: $SCRIPT_NAME [MODEL_PATH] (--gpus LIST | --cpu) [options] [extra vllm flags] [-- extra vllm flags]

Start an unmodified \`vllm serve MODEL_PATH\` for
  $MODEL_LABEL
with the flags the VLM reward proxy relies on. The exact command is printed before it runs.

Model:
  MODEL_PATH, --model-path PATH   weights directory or Hugging Face repo id
                                  (default: \$$MODEL_PATH_ENV; one of them is required)
  --served-model-name NAME        must equal the proxy config's backend \`model\`
                                  (default: $DEFAULT_SERVED_NAME)
GPUs and network:
  --gpus LIST                     GPU indices, e.g. 0,1: sets CUDA_VISIBLE_DEVICES=0,1 (or --cpu)
  --cpu                           a CPU build of vLLM (docs/stack.md "On a CPU"): no GPU, and
                                  ${CPU_ARGS[*]}
                                  before the extra flags (which may override them)
  --tensor-parallel-size N, -tp N default: the number of GPUs in --gpus (must equal it)
  --host HOST                     default 127.0.0.1 (the proxy is the only client)
  --port PORT                     default $DEFAULT_PORT (the proxy endpoint http://HOST:PORT/v1)
Engine:
  --max-model-len N               default 16384 (the seed's, and PRIMO-R1's evaluation's)
  --gpu-memory-utilization F      fraction of each GPU's memory, default 0.9
  --limit-mm-per-prompt JSON      default '$DEFAULT_LIMIT_MM' ($LAYOUT_NOTE)
  --seed N                        default 0
Always set (not options):
  --media-io-kwargs '$MEDIA_IO_KWARGS'
                                  keep every frame of a video (vLLM keeps only 32 otherwise)
  --trust-request-mm-kwargs       accept the proxy's per-request media_io_kwargs (stock vLLM
                                  answers 400 without it)
Other:
  --dry-run                       print the command, do not run it
  -h, --help                      this help
  Any other argument, and everything after --, goes to vllm serve unchanged and in order,
  e.g. --enforce-eager --max-num-seqs 16.
Environment:
  $MODEL_PATH_ENV  the model path when none is given
  VLLM_BIN  the vllm executable (default: vllm on PATH)
Example (Qwen on GPUs 0,1 with TP=2 / PRIMO-R1 on GPU 2):
  $SCRIPT_NAME /models/model-dir --gpus 0,1 --port 8001
EOF
}

_die() {
    echo "$SCRIPT_NAME: error: $*" >&2
    echo "Try '$SCRIPT_NAME --help'." >&2
    exit 2
}

# Quote one word exactly as Python's shlex.quote does, so both launchers print the same line.
_quote() {
    local word=$1 squote="'\"'\"'" LC_ALL=C
    if [[ -z $word ]]; then
        printf "''"
    elif [[ $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
        printf '%s' "$word"
    else
        printf "'%s'" "${word//\'/$squote}"
    fi
}

serve_vllm() {
    local model_path="" gpus="" tp="" host="127.0.0.1" port=$DEFAULT_PORT
    local served_name=$DEFAULT_SERVED_NAME max_model_len=16384 gpu_mem=0.9
    local limit_mm=$DEFAULT_LIMIT_MM seed=0 dry_run=0 cpu=0
    local -a extra=()
    if [[ $# -gt 0 && $1 != -* ]]; then
        model_path=$1
        shift
    fi
    while [[ $# -gt 0 ]]; do
        local arg=$1 opt=$1 value="" inline=0
        if [[ $arg == --*=* ]]; then
            opt=${arg%%=*} value=${arg#*=} inline=1
        fi
        case $opt in
            --model-path | --gpus | --tensor-parallel-size | -tp | --host | --port | \
                --served-model-name | --max-model-len | --gpu-memory-utilization | \
                --limit-mm-per-prompt | --seed)
                if [[ $inline == 0 ]]; then
                    [[ $# -ge 2 ]] || _die "$opt needs a value"
                    value=$2
                    shift
                fi
                shift
                case $opt in
                    --model-path) model_path=$value ;;
                    --gpus) gpus=$value ;;
                    --tensor-parallel-size | -tp) tp=$value ;;
                    --host) host=$value ;;
                    --port) port=$value ;;
                    --served-model-name) served_name=$value ;;
                    --max-model-len) max_model_len=$value ;;
                    --gpu-memory-utilization) gpu_mem=$value ;;
                    --limit-mm-per-prompt) limit_mm=$value ;;
                    --seed) seed=$value ;;
                esac
                ;;
            --media-io-kwargs | --trust-request-mm-kwargs)
                _die "$opt is always set by this script" ;;
            --dry-run) dry_run=1; shift ;;
            --cpu) cpu=1; shift ;;
            -h | --help) _usage; exit 0 ;;
            --) shift; extra+=("$@"); break ;;
            *) extra+=("$arg"); shift ;;
        esac
    done

    local flag
    for flag in "${extra[@]}"; do
        [[ $MANAGED_FLAGS == *" ${flag%%=*}"[[:space:]]* ]] &&
            _die "${flag%%=*} among the extra vllm flags: use this script's own option instead"
    done
    if [[ -z $model_path ]]; then
        model_path=${!MODEL_PATH_ENV:-}
        [[ -n $model_path ]] || _die "no model path: give MODEL_PATH or --model-path, or set $MODEL_PATH_ENV"
    fi
    if [[ $cpu == 1 ]]; then
        [[ -z $gpus ]] || _die "--cpu uses no GPU: drop --gpus $gpus"
        tp=${tp:-1}
        [[ $tp == 1 ]] || _die "--cpu runs one process: --tensor-parallel-size must be 1 (got '$tp')"
    else
        [[ -n $gpus ]] || _die "--gpus is required, e.g. --gpus 0 or --gpus 0,1 (or --cpu)"
        [[ $gpus =~ ^[0-9]+(,[0-9]+)*$ ]] || _die "--gpus must be comma-separated GPU indices like 0,1 (got '$gpus')"
        local -a gpu_list
        IFS=, read -r -a gpu_list <<<"$gpus"
        [[ $(printf '%s\n' "${gpu_list[@]}" | sort -u | wc -l) -eq ${#gpu_list[@]} ]] ||
            _die "--gpus lists a GPU twice ($gpus)"
        tp=${tp:-${#gpu_list[@]}}
        [[ $tp =~ ^[1-9][0-9]*$ ]] || _die "--tensor-parallel-size must be a positive integer (got '$tp')"
        [[ $tp -eq ${#gpu_list[@]} ]] ||
            _die "--tensor-parallel-size $tp but --gpus $gpus lists ${#gpu_list[@]} GPU(s); they must match"
    fi
    [[ $port =~ ^[0-9]+$ ]] && ((10#$port >= 1 && 10#$port <= 65535)) || _die "--port must be 1-65535 (got '$port')"
    [[ $max_model_len =~ ^[1-9][0-9]*$ ]] || _die "--max-model-len must be a positive integer (got '$max_model_len')"
    [[ $seed =~ ^-?[0-9]+$ ]] || _die "--seed must be an integer (got '$seed')"
    [[ $gpu_mem =~ ^[0-9]*\.?[0-9]+$ ]] && awk -v x="$gpu_mem" 'BEGIN { exit !(x > 0 && x <= 1) }' ||
        _die "--gpu-memory-utilization must be in (0, 1] (got '$gpu_mem')"
    [[ $limit_mm == \{*\} ]] || _die "--limit-mm-per-prompt must be a JSON object like '$DEFAULT_LIMIT_MM'"

    local vllm=${VLLM_BIN:-vllm}
    local -a cmd=(
        "$vllm" serve "$model_path"
        --served-model-name "$served_name"
        --tensor-parallel-size "$tp"
        --max-model-len "$max_model_len"
        --gpu-memory-utilization "$gpu_mem"
        --limit-mm-per-prompt "$limit_mm"
        --media-io-kwargs "$MEDIA_IO_KWARGS"
        --trust-request-mm-kwargs
        --host "$host"
        --port "$port"
        --seed "$seed"
    )
    [[ $cpu == 1 ]] && cmd+=("${CPU_ARGS[@]}")
    cmd+=("${extra[@]}")
    local line="" word
    [[ $cpu == 1 ]] || line="CUDA_VISIBLE_DEVICES=$(_quote "$gpus") "
    for word in "${cmd[@]}"; do
        line+="$(_quote "$word") "
    done
    echo "${line% }"
    [[ $dry_run == 1 ]] && exit 0
    command -v "$vllm" >/dev/null ||
        _die "'$vllm' not found: activate the vLLM environment or set VLLM_BIN=/path/to/vllm"
    [[ $cpu == 1 ]] || export CUDA_VISIBLE_DEVICES=$gpus
    exec "${cmd[@]}"
}
