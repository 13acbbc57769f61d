#!/usr/bin/env bash
# The CUDA checks of what 2026-12-05 landed untested on a GPU: the prefix and score gate arms, batched
# speculation through memra.LLM, sliding-window models (Mistral, Gemma 4, Step) and the packed NVFP4
# kernel, every answer bit-checked. Run through the device tool: bash tools/gpu_check_new_arms.sh
# (carry a folder .whl1 holding the gguf and llguidance wheels for Python 3.12); results in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl1/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/results.txt; : > $R
gate() { # name, then memra gate args
  local name=$1; shift
  timeout 150 python3 -m memra gate "$@" --device cuda > $OUT/gate_$name.txt 2>&1; rc=$?
  echo "gate $name rc=$rc $(grep -E 'ALL GREEN|FAIL' $OUT/gate_$name.txt | tail -1 | cut -c1-90)" | tee -a $R
}
if python3 -m memra gate --help | grep -q prefix; then
  for arch in qwen3_5; do gate prefix_$arch tests/fixtures/hf/$arch --mode prefix; done
fi
for arch in qwen3_5; do gate score_$arch tests/fixtures/hf/$arch --mode score; done
timeout 100 python3 - <<'PY' 2>&1 | tail -3 | sed 's/^/spec LLM cuda: /' | tee -a $R
import memra
prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed", "KING LEAR:\nBlow, winds,"] * 4
sps = [memra.SamplingParams(max_tokens=48, logprobs=0, temperature=t, seed=i) for i, t in enumerate([0.0, 0.8] * 8)]
plain = memra.LLM("demo", device="cuda", max_batch=8, max_model_len=256).generate(prompts, sps, use_tqdm=False)
for spec in ("mtp", "ngram"):
    got = memra.LLM("demo", device="cuda", max_batch=8, max_model_len=256, speculative=spec).generate(prompts, sps, use_tqdm=False)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
               for a, b in zip(plain, got))
    print(spec, "16 requests at max_batch 8, tokens and logprobs equal to plain:", same)
PY
gate window_config tests/fixtures/hf/mistral --mode config --plen 24
for a in gemma4 step3p7 step3p5; do [ -d tests/fixtures/hf/$a ] && gate cfg_$a tests/fixtures/hf/$a --mode config --plen 24; done
for f in nvfp4-modelopt; do
  timeout 60 python3 tools/make_fixture_quant.py --arch qwen3_5 --format $f /tmp/q_$f > /dev/null 2>&1 && gate $f /tmp/q_$f --mode config
done
MEMRA_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -o addopts='' -m cuda tests/test_fp_kernel.py tests/test_fp_checkpoints.py 2>&1 | tail -1 | sed 's/^/fp kernel cuda: /' | tee -a $R
echo "=== summary"; cat $R
