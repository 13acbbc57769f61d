"""Cross-request prefill (memra.step.prime_batch): several prompts' pieces in one forward.

The exact promise — a prompt's logits and cache bits do not depend on which prompts share its
forwards — holds where every row-wise op is a batch-invariant kernel; the CUDA tests check it to the
bit and show the gate's canary failing. On CPU (torch's kernels, not batch-invariant) the exact path
primes each prompt alone (exact by construction: bits checked), and the fast path batches: there
the numbers agree with the solo prime to fp32 rounding (1e-4 relative: the same arithmetic summed in
another order by the CPU's matmul blocking), which checks the bookkeeping of the shared forward —
positions, each sequence's KV rows and GDN states.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, HYBRID_ARCHS, hf_dir, rel_err
from cuda_marks import cuda_only
from memra import counters, step
from memra.errors import ContextOverflowError, MemraError
from memra.gate.battery import Ledger
from memra.gate.prime_batch_arm import cache_bits, prime_batch_prompts, run_prime_batch_arm

LENGTHS = [5, 70, 1, 130]  # a single token, one and three 64-token pieces, uneven positions


def _prompts(model) -> list[list[int]]:
    return [[(3 * i + 7 * j + 1) % model.cfg.vocab_size for j in range(n)] for i, n in enumerate(LENGTHS)]


def _alone(model, prompts, ctx: int = 256):
    out = []
    for p in prompts:
        c = model.new_cache(ctx)
        out.append((model.prime(p, c), c))
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma4", "step3p5", *HYBRID_ARCHS])
def test_fast_path_batches_the_prompts_and_keeps_each_sequence_its_own(load_model, arch):
    model = load_model(hf_dir(arch)).with_doors(MEMRA_EXACT="0")
    prompts = _prompts(model)
    alone = _alone(model, prompts)
    caches = [model.new_cache(256) for _ in prompts]
    before = counters.snapshot()
    logits = model.prime_batch(prompts, caches)
    live = counters.delta(before)
    assert (live["prime_batches"], live["prime_batch_segments"]) == (1, len(prompts))  # one shared forward
    assert [c.pos for c in caches] == LENGTHS
    for (ref, ref_cache), row, c in zip(alone, logits, caches):
        assert rel_err(row, ref) < 1e-4
        for got, want in zip(cache_bits(c, model.cfg.n_layers), cache_bits(ref_cache, model.cfg.n_layers)):
            assert rel_err(got, want) < 1e-4 if want.abs().max() > 0 else torch.equal(got, want)
        assert rel_err(model.decode_step(3, c), model.decode_step(3, ref_cache)) < 1e-4


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU's exact path: no invariant prefill kernels there; "
                    "the CUDA twin is test_cuda_batched_prime_is_bit_identical_to_alone_and_the_canary_fails")
def test_exact_path_without_invariant_kernels_primes_each_prompt_alone(load_model):
    model = load_model(hf_dir("qwen3_5"))
    assert model.settings.exact and not step.batching_prime(model, True)
    prompts = _prompts(model)
    alone = _alone(model, prompts)
    caches = [model.new_cache(256) for _ in prompts]
    before = counters.snapshot()
    logits = model.prime_batch(prompts, caches)
    assert counters.delta(before)["prime_batches"] == 0
    for (ref, ref_cache), row, c in zip(alone, logits, caches):
        assert torch.equal(row, ref)
        trunk = model.cfg.n_layers
        assert all(torch.equal(a, b) for a, b in zip(cache_bits(c, trunk), cache_bits(ref_cache, trunk)))


def test_waves_respect_the_token_budget_and_cut_long_prompts_like_prime(load_model):
    model = load_model(hf_dir("llama")).with_doors(MEMRA_EXACT="0")
    prompts = [[1 + j % 50 for j in range(n)] for n in (300, 200, 3)]
    caches = [model.new_cache(320) for _ in prompts]
    before = counters.snapshot()
    # pieces of 64: [64 x4, 44], [64 x3, 8], [3]; waves of at most 128 tokens:
    # [64, 64] + [3] alone, [64, 64], [64, 64], [64, 8], [44] alone
    logits = model.prime_batch(prompts, caches, chunk_size=64, wave_tokens=128)
    live = counters.delta(before)
    assert (live["prime_batches"], live["prime_batch_segments"], live["prime_pieces"]) == (4, 8, 10)
    assert [c.pos for c in caches] == [300, 200, 3]
    for (ref, _), row in zip(_alone(model, prompts, 320), logits):
        assert rel_err(row, ref) < 1e-4
    assert step._token_groups([0, 1, 2, 3], [3000, 1000, 97, 1], 4096) == [[0, 1], [2, 3]]


def test_refusals_come_before_any_position_moves(load_model):
    model = load_model(hf_dir("llama"))
    a, b = model.new_cache(16), model.new_cache(8)
    with pytest.raises(MemraError, match="2 prompts for 1 caches"):
        model.prime_batch([[1], [2]], [a])
    with pytest.raises(MemraError, match="same cache twice"):
        model.prime_batch([[1], [2]], [a, a])
    with pytest.raises(MemraError, match="outside the vocabulary"):
        model.prime_batch([[1], [model.cfg.vocab_size]], [a, b])
    with pytest.raises(ContextOverflowError):
        model.prime_batch([[1, 2], list(range(1, 12))], [a, b])
    assert (a.pos, b.pos) == (0, 0)


def test_the_batched_prime_walks_the_stage_split(load_model):
    split = load_model(hf_dir("qwen3_5")).with_doors(MEMRA_EXACT="0", MEMRA_PP_STAGES="2")
    unsplit = split.with_doors(MEMRA_PP_STAGES=None)
    prompts = _prompts(split)
    caches = [split.new_cache(256) for _ in prompts]
    before = counters.snapshot()
    logits = split.prime_batch(prompts, caches)
    live = counters.delta(before)
    assert live["prime_batches"] == 1 and live["prime_batch_splits"] == 1 and live["pp_split_walks"] == 1
    ref = unsplit.prime_batch(prompts, [unsplit.new_cache(256) for _ in prompts])
    assert all(torch.equal(x, y) for x, y in zip(logits, ref))  # same forward, split: the same bits (E2)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU's exact path: no invariant prefill kernels there; "
                    "the CUDA twin is test_cuda_batched_prime_is_bit_identical_to_alone_and_the_canary_fails")
def test_gate_arm_skips_where_not_live_and_fails_on_the_fast_path(load_model):
    """On CPU's exact path the arm cannot run (and says so, it does not pass); on the fast path it runs —
    the liveness counter moves — and must FAIL, since torch's CPU kernels are not batch-invariant."""
    model = load_model(hf_dir("qwen3_5"))
    lines: list[str] = []
    led = Ledger(lines.append)
    assert run_prime_batch_arm(model, prime_batch_prompts(20, 0, model.cfg.vocab_size), 200, False, led) is False
    assert "skipped" in lines[-1] and not led.failed
    led = Ledger(lines.append)
    assert run_prime_batch_arm(model.with_doors(MEMRA_EXACT="0"), prime_batch_prompts(20, 0, model.cfg.vocab_size),
                               200, False, led)
    assert led.failed.get("prime-batch") and "liveness" not in led.failed


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma4", "step3p5", *HYBRID_ARCHS])
def test_cuda_batched_prime_is_bit_identical_to_alone_and_the_canary_fails(load_model, arch):
    model = load_model(hf_dir(arch), dtype="bfloat16", device=DEVICE)
    assert step.batching_prime(model, True), "prime batching should be live on the invariant kernels"
    prompts = prime_batch_prompts(20, 0, model.cfg.vocab_size)
    led = Ledger(print)
    assert run_prime_batch_arm(model, prompts, 200, False, led) and not led.failed
    led = Ledger(print)
    run_prime_batch_arm(model, prompts, 200, True, led)
    assert led.failed.get("prime-batch"), "the canary (one wrong token) must make the arm FAIL"


def test_the_engine_prefills_a_steps_requests_in_shared_forwards():
    """Requests admitted in one step share their prefill forwards (the fast path on CPU, where
    batching is live), and each still gets the tokens the reference loop gives it alone — greedy tokens,
    which fp32 rounding differences of this size do not flip on the demo model."""
    import memra
    from memra.generate import generate_tokens
    from memra.sampling import SamplingParams

    llm = memra.LLM(memra.load("demo", device=DEVICE).with_doors(MEMRA_EXACT="0"), max_batch=4, max_ctx=128)
    prompts = ["ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be, or not to be"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = counters.snapshot()
    outs = llm.generate(prompts, params)
    live = counters.delta(before)
    assert live["prime_batches"] >= 1 and live["prime_batch_segments"] >= len(prompts)
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt, add_special=True)
        assert out.outputs[0].token_ids == list(generate_tokens(llm.model, ids, params, eos_ids=llm.tokenizer.eos_ids))


def test_the_warm_up_runs_the_engines_shared_prefill():
    """Engine.warm_up primes through the engine's own prefill path (several prompts in shared forwards
    where batching is live), so the kernels a step's wave runs are compiled before the first request,
    and leaves every block and slot free."""
    import memra

    llm = memra.LLM(memra.load("demo", device=DEVICE).with_doors(MEMRA_EXACT="0"), max_batch=4, max_ctx=128,
                    warm_up=False)
    kv, rec = llm.engine.backend.kv, llm.engine.backend.rec
    free = (sorted(kv.free), sorted(rec.free))
    before = counters.snapshot()
    llm.engine.warm_up()
    live = counters.delta(before)
    assert live["prime_batches"] >= 1 and live["prime_batch_segments"] >= 2
    assert (sorted(kv.free), sorted(rec.free)) == free


def test_the_gpu_warm_up_meets_every_prefill_size_class():
    """On a GPU the warm-up runs a prefill wave in each size class up to the step's token budget (each
    of the projections' tile buckets compiles before a request meets it): sizes by factors of four,
    split over prompts that fit the context, at least two where the pools allow a shared forward."""
    from memra.engine.warmup import wave_prompts, wave_sizes

    assert wave_sizes(2048) == [2, 8, 32, 128, 512, 2048]
    assert wave_sizes(100) == [2, 8, 32, 100] and wave_sizes(2) == [2]
    for tokens, ctx, most in ((2, 1024, 64), (512, 1024, 64), (2048, 1024, 64), (2048, 300, 64), (9, 1024, 1)):
        prompts = wave_prompts(tokens, ctx, most, vocab=50)
        assert sum(map(len, prompts)) == tokens and all(0 < len(p) < ctx for p in prompts)
        assert min(2, most) <= len(prompts) <= most
        assert all(0 <= t < 50 for p in prompts for t in p)
    assert wave_prompts(2048, 300, 4, vocab=50) == []  # needs 7 prompts of the context: more than the pools hold
