#!/usr/bin/env bash
# The throughput issue's acceptance table on one GPU, in parts that each fit one device call (ten minutes):
#
#     bash tools/gpu_acceptance.sh PART [LIMIT_S]       # PART: suite | throughput | models | moe | serve | doors | all
#
# suite       the `cuda` suite (tools/gpu_suite.sh), which the first call of a device session runs
# throughput  `memra bench throughput` for both dense shapes, then one decode and one mixed step profiled each
# models      `memra bench model`: B=1 and B=64 of both dense shapes beside HF's static cache (Llama), and the
#             Qwen3.5-35B-A3B at 36 of its 40 layers (B=1, B=16, prefill, time to first token), which `moe`
#             runs alone (the dense step's HF Qwen peer, on torch's GDN, can take the whole call)
# serve       `memra bench serve` at concurrency 64 on Llama-3-8B
# doors       the padding doors beside their shut arm in the same call: the GDN decode step's tiles and warps in
#             fp32 and bf16 and its graph buckets' padding, with and without the inert rows' programs skipped
#             (tools/gpu_tune_gdn_step.py), then Qwen3.5-9B's `bench throughput` as it is and with
#             MEMRA_INERT_SKIP=0; the decode attention as a mixed step launches it, its four-split call taken apart
#             (tools/gpu_tune_attention.py --mixed), then Llama-3-8B's `bench throughput` as it is and with
#             MEMRA_ATTN_SPLIT_WALK=0, then with MEMRA_ATTN_SHORT_ROWS=1 (the walk's short rows end in their output)
#             and with MEMRA_ATTN_WALK_COMBINE=1 (the walk merges its splits itself); not part of `all`; doors_gdn
#             (about 280 s) and doors_attn (about 470 s) are its two halves
#
# Each step's whole output goes to ${OUT:-/tmp/acceptance}/STEP.log; the last lines printed are the table's
# cells, one per step, grepped from those logs. A step starts only with time left before LIMIT_S (default 580),
# and is stopped at the time it was given. Wheels the machine lacks: a .whl folder beside (tools/offline_wheels.sh)
# is installed first.
set -u
part=${1:?"PART: suite | throughput | models | moe | serve | doors | all"}; limit=${2:-580}
out=${OUT:-/tmp/acceptance}; mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
t0=$(date +%s); cells=""
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

# step NAME SECONDS PATTERN CMD...: run CMD with at most SECONDS (less where the limit is nearer), keep the lines
# of its log matching PATTERN (grep -E) as its cells
step() {
  local name=$1 secs=$2 pattern=$3; shift 3
  local left=$(( limit - ($(date +%s) - t0) - 5 ))
  (( secs > left )) && secs=$left
  if (( secs < 20 )); then cells+="$name: not run (no time left)"$'\n'; return; fi
  local start=$(date +%s)
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  cells+="$name (rc $rc, $(( $(date +%s) - start )) s):"$'\n'"$(grep -E "$pattern" "$out/$name.log" | head -12)"$'\n'
}

tp="python3 -m memra bench throughput --num-prompts 1000 --check 1"
tp_cells="output tokens/s|decode steps  |mixed steps  |exactness|floor on|device time a step"
prof_cells="step: |linears"
run_part() {
  case $1 in
    suite) step suite 330 "^(graphs|shard)|FAILED|cuda suite" bash tools/gpu_suite.sh 7 270 ;;
    throughput)
      step throughput_llama 110 "$tp_cells" $tp random:llama-3-8b
      step throughput_qwen 130 "$tp_cells" $tp random:qwen3.5-9b
      prof="python3 tools/gpu_profile_steps.py --rows 256 --steps 4 --model"
      step profile_llama 80 "$prof_cells" $prof random:llama-3-8b
      step profile_qwen 90 "$prof_cells" $prof random:qwen3.5-9b ;;
    models)
      step model_dense 330 "^(llama|qwen)|probes" python3 -m memra bench model --models llama-3-8b,qwen3.5-9b \
        --batches 1,64 --modes exact,engine --peer hf-static --steps 32
      run_part moe ;;
    moe)
      step model_moe 200 "^qwen|probes" python3 -m memra bench model --models qwen3.5-35b-a3b --layers 36 \
        --batches 1,16 --modes exact,engine --no-hf --steps 32 ;;
    serve)
      step serve_llama 300 "tok/s|TTFT|steady|lost|requests" python3 -m memra bench serve --launch random:llama-3-8b \
        --device cuda --max-batch 64 --max-ctx 1024 --requests 384 --concurrency 64 --min-tokens 128 --max-tokens 256 \
        --max-prompt-words 40 --stream-fraction 1 --cancel-fraction 0 ;;
    doors) run_part doors_gdn; run_part doors_attn ;;
    doors_gdn)
      step gdn_step 50 "read probe|^ +(64|180|256|304) " python3 tools/gpu_tune_gdn_step.py
      # Qwen3.5-9B's throughput as it is, then with the inert padding rows' GDN programs stepping a zero state
      qwen="bench throughput random:qwen3.5-9b --num-prompts 1000 --check 1"
      step gdn_defaults 110 "$tp_cells" python3 -m memra $qwen
      MEMRA_INERT_SKIP=0 step inert_skip_off 110 "$tp_cells" python3 -m memra $qwen ;;
    doors_attn)
      # the decode attention as a mixed step launches it, taken apart (with the walked splits' column), then
      # Llama-3-8B as it is and with MEMRA_ATTN_SPLIT_WALK=0 (a program a split)
      step attention_mixed 45 "^[0-9]+x|taken apart" python3 tools/gpu_tune_attention.py --mixed
      llama="bench throughput random:llama-3-8b --num-prompts 1000 --check 1"
      step llama_defaults 105 "$tp_cells" python3 -m memra $llama
      MEMRA_ATTN_SPLIT_WALK=0 step split_walk_off 105 "$tp_cells" python3 -m memra $llama
      MEMRA_ATTN_SHORT_ROWS=1 step short_rows 105 "$tp_cells" python3 -m memra $llama
      MEMRA_ATTN_WALK_COMBINE=1 step walk_combine 105 "$tp_cells" python3 -m memra $llama ;;
    *) echo "unknown part $1: suite | throughput | models | moe | serve | doors | all"; exit 2 ;;
  esac
}
if [ "$part" = all ]; then for p in suite throughput models serve; do run_part $p; done; else run_part "$part"; fi
echo "=== acceptance: $part, $(( $(date +%s) - t0 )) s (logs in $out)"
echo -n "$cells"
