"""The engine's step in one forward (memra.step.mixed_step): a decode step's rows and a prefill wave's
pieces share the projections, and each kind attends and steps its recurrent state as its own forward.
By default it runs eagerly where decode steps are not graphed and, where they are, only as a captured
graph (MEMRA_MIXED_STEP=auto; tests/test_mixed_graphs.py); the CUDA tests here open the door (=1) to
hold the eager mixed forward to the bits of the graphed decode and the prefill it would replace.

Exact where every row-wise op is a batch-invariant kernel (CUDA): the mixed step's logits and cache
bits are the two separate calls' (decode_step_batch, prime_batch), bit for bit. On CPU the exact path
does not mix (torch's kernels are not batch-invariant; the two calls run, bits equal), and the fast
path mixes: there the numbers agree with the two calls to fp32 rounding (1e-4 relative, the same
arithmetic summed in another order by the CPU's matmul blocking), which checks the bookkeeping —
which rows are whose, positions, KV rows and recurrent states.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, HYBRID_ARCHS, hf_dir, rel_err
from memra import counters, step
from memra.errors import MemraError
from memra.settings import Settings
from memra.gate.prime_batch_arm import cache_bits

RUNNING = [9, 70, 3]  # the decoding sequences' prompt lengths
NEW = [5, 130, 1, 64]  # the prompts the step prefills: a single token, several 64-token tiles, one whole tile


def _ids(n: int, salt: int, vocab: int) -> list[int]:
    return [(5 * salt + 11 * j + 2) % vocab for j in range(n)]


def _step(model, mixed: bool):
    """Prime RUNNING, decode one token each, then one step that decodes them again and prefills NEW.
    -> (decode logits, prefill logits, every cache) of that step."""
    vocab = model.cfg.vocab_size
    running = [model.new_cache(256) for _ in RUNNING]
    model.prime_batch([_ids(n, i, vocab) for i, n in enumerate(RUNNING)], running)
    model.decode_step_batch([7, 8, 9], running)
    new = [model.new_cache(256) for _ in NEW]
    prompts = [_ids(n, 10 + i, vocab) for i, n in enumerate(NEW)]
    tokens = [4, 5, 6]
    if mixed:
        decoded, lasts = step.mixed_step(model, tokens, running, prompts, new)
    else:
        decoded, lasts = model.decode_step_batch(tokens, running), model.prime_batch(prompts, new)
    return decoded, lasts, running + new


def _compare(model, exact: bool) -> None:
    before = counters.snapshot()
    decoded, lasts, caches = _step(model, mixed=True)
    mixed_steps = counters.delta(before)["mixed_steps"]
    want_decoded, want_lasts, want_caches = _step(model, mixed=False)
    assert mixed_steps == (1 if step.mixes(model, exact, caches[:3], caches[3:]) else 0)
    assert [c.pos for c in caches] == [c.pos for c in want_caches] == [n + 2 for n in RUNNING] + NEW
    pairs = [(decoded, want_decoded), *zip(lasts, want_lasts)]
    trunk = model.cfg.n_layers
    pairs += [p for c, w in zip(caches, want_caches) for p in zip(cache_bits(c, trunk), cache_bits(w, trunk))]
    if exact:
        assert all(torch.equal(got, want) for got, want in pairs)
    else:
        assert all(rel_err(got, want) < 1e-4 if want.abs().max() > 0 else torch.equal(got, want) for got, want in pairs)
    # the caches go on as the separate calls' do
    after = model.decode_step_batch([1] * len(caches), caches)
    want_after = model.decode_step_batch([1] * len(caches), want_caches)
    assert torch.equal(after, want_after) if exact else rel_err(after, want_after) < 1e-4
    for c in caches + want_caches:
        c.free()


@pytest.mark.parametrize("arch", ["llama", *HYBRID_ARCHS])
def test_the_fast_path_mixes_and_keeps_each_row_its_own(load_model, arch):
    model = load_model(hf_dir(arch)).with_doors(MEMRA_EXACT="0", MEMRA_MIXED_STEP="1")
    caches = [model.new_cache(64) for _ in range(2)]
    assert step.mixes(model, False, caches[:1], caches[1:])
    _compare(model, exact=False)


@pytest.mark.parametrize("arch", ["llama", *HYBRID_ARCHS])
def test_the_exact_path_mixes_only_where_it_keeps_the_bits(load_model, arch):
    """On CUDA the invariant kernels make the mixed step exact, and it runs (bits equal); on CPU the
    exact path runs the two calls instead (bits equal by construction)."""
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    model = load_model(hf_dir(arch), dtype=dtype).with_doors(MEMRA_MIXED_STEP="1")
    caches = [model.new_cache(64) for _ in range(2)]
    assert step.mixes(model, True, caches[:1], caches[1:]) == (DEVICE == "cuda")
    _compare(model, exact=True)


def test_the_door_decides_where_steps_mix(load_model):
    model = load_model(hf_dir("llama")).with_doors(MEMRA_EXACT="0")
    caches = [model.new_cache(64) for _ in range(2)]
    graphed = DEVICE == "cuda"  # auto: where decode is graphed, only a captured mixed step (memra.mixed_graphs)
    assert model.executor.mixes_steps and step.mixes(model, False, caches[:1], caches[1:])
    assert model.executor.mixes_eagerly != graphed
    shut = model.with_doors(MEMRA_MIXED_STEP="0")
    caches = [shut.new_cache(64) for _ in range(2)]
    assert not step.mixes(shut, False, caches[:1], caches[1:])
    assert Settings().mixes_steps() and not Settings(mixed_step="0").mixes_steps()
    assert Settings().mixes_eagerly("cpu") and not Settings().mixes_eagerly("cuda")  # graphed decode: not eagerly
    assert Settings(cuda_graphs=False).mixes_eagerly("cuda") and Settings(mixed_step="1").mixes_eagerly("cuda")
    with pytest.raises(MemraError, match="MEMRA_MIXED_STEP='sometimes' is not auto, 1 or 0"):
        Settings.from_env({"MEMRA_MIXED_STEP": "sometimes"})
    assert Settings.from_env({"MEMRA_MIXED_STEP": "on"}).mixed_step == "1"


def test_a_cache_cannot_both_decode_and_prefill(load_model):
    for doors in ("1", "0"):  # mixed or as two calls, the same refusal
        model = load_model(hf_dir("llama")).with_doors(MEMRA_EXACT="0", MEMRA_MIXED_STEP=doors)
        a, b = model.new_cache(64), model.new_cache(64)
        model.prime([1, 2, 3], a)
        with pytest.raises(MemraError, match="both to decode and to prefill"):
            step.mixed_step(model, [4], [a], [[5, 6], [7]], [b, a])
        assert (a.pos, b.pos) == (3, 0)  # refused before any position moved


def test_the_engine_mixes_steps_and_each_request_keeps_its_tokens():
    """Requests that start while others decode share those steps' forwards; each still gets the tokens
    the reference loop gives it alone (the fast path on CPU: greedy tokens, which fp32 rounding
    differences of this size do not flip on the demo model; exact on CUDA)."""
    import memra
    from memra.generate import generate_tokens
    from memra.sampling import SamplingParams

    model = memra.load("demo", device=DEVICE)
    doors = {"MEMRA_MIXED_STEP": "1"} if DEVICE == "cuda" else {"MEMRA_EXACT": "0"}
    llm = memra.LLM(model.with_doors(**doors), max_batch=2, max_ctx=128,
                    prefill_wait_steps=0)  # a request starts as soon as a place is free
    prompts = ["ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be, or not to be", "KING:"]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (9, 3, 6, 4)]
    before = counters.snapshot()
    outs = llm.generate(prompts, params)
    assert counters.delta(before)["mixed_steps"] >= 1  # a request started beside a running one
    for prompt, p, out in zip(prompts, params, outs):
        ids = llm.tokenizer.encode(prompt, add_special=True)
        assert out.outputs[0].token_ids == list(generate_tokens(llm.model, ids, p, eos_ids=llm.tokenizer.eos_ids))
