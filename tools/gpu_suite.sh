#!/usr/bin/env bash
# The `cuda` suite on one GPU in parallel shards (the device tool allows ten minutes a command; run one after
# the other the files take longer), then one line per shard:
#
#     bash tools/gpu_suite.sh [SHARDS] [PER_SHARD_TIMEOUT_S]      # defaults 7 and 280; logs in ${OUT:-/tmp}/suite
#
# The files come from pytest's own collection (every file with a `cuda` test), dealt round-robin from the
# slowest down; the graph files, whose GPU halves run under MEMRA_TEST_DEVICE=cuda without the mark, are one
# more shard. Each shard's log is pytest -v, so a shard stopped at its timeout still shows what passed.
set -u
shards=${1:-7}; limit=${2:-280}
logs=${OUT:-/tmp}/suite; mkdir -p "$logs"
export MEMRA_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
pytest=(python3 -m pytest -v --tb=short -o addopts= -p no:cacheprovider)
# slowest first (the serving soak, the gates, the exactness battery), then the rest as pytest lists them
files=$(python3 -m pytest -q -o addopts= -p no:cacheprovider --collect-only -m cuda 2>/dev/null | grep '::' | cut -d: -f1 | uniq -c | sort -rn \
        | awk '{print $2}')
first="tests/test_cuda_serve.py tests/test_cuda_gates.py tests/test_cuda_exact.py"
files="$first $(echo "$files" | grep -v -x -F -e "${first// /$'\n'}" | tr '\n' ' ')"
declare -a shard
i=0
for f in $files; do shard[$((i % shards))]+="$f "; i=$((i + 1)); done
start=$(date +%s)
for k in "${!shard[@]}"; do
  { echo "shard $k: ${shard[$k]}"; timeout "$limit" "${pytest[@]}" -m cuda ${shard[$k]}; } > "$logs/shard$k" 2>&1 &
done
timeout "$limit" "${pytest[@]}" -m "not slow" tests/test_graphs.py tests/test_mixed_graphs.py tests/test_gpu_twins.py \
  > "$logs/graphs" 2>&1 &
wait
echo "cuda suite: $(( $(date +%s) - start )) s wall, $shards shards + graphs"
for f in "$logs"/*; do
  end=$(grep -E '^=+ .* in [0-9.]+s' "$f" | tail -1)
  echo "$(basename "$f"): ${end:-stopped at ${limit} s} ($(grep -c ' PASSED' "$f") PASSED, $(grep -c ' FAILED' "$f") FAILED)"
  grep -E '^FAILED|^ERROR' "$f" | head -5
done
