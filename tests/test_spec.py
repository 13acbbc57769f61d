"""Speculative decoding (promise E4): the verify forward's columns are decode_step's logits to the
bit, rollback restores the state a plain run would have, and speculative generation (MTP or n-gram,
any K, greedy or seeded sampling) emits exactly the plain stream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, HF_ARCHS, hf_dir
from memra import counters
from memra.errors import ContextOverflowError, MemraError
from memra.generate import GenerationStats, generate_tokens
from memra.sampling import SamplingParams
from memra.spec import MtpDrafter, NgramDrafter, SpecConfig
from memra.state_trail import StateTrail

@pytest.fixture(scope="module")
def demo():
    import memra

    return memra.load("demo", device=DEVICE, dtype="float32")


PROMPT = [5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 5, 17, 99]  # repeats, so prompt lookup has something to find
CHUNK = [12, 40, 41, 300, 2, 77, 78, 79, 80]  # T = 9 (K = 8)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _state(cache, model):
    layers = model.cfg.gdn_layers
    return [cache.conv_state(i).clone() for i in layers] + [cache.ssm_state(i).clone() for i in layers]


def _primed(model, ctx=96):
    c = model.new_cache(ctx)
    model.prime(PROMPT, c)
    return c


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_verify_columns_are_decode_steps_to_the_bit(load_model, arch):
    model = load_model(hf_dir(arch))
    plain = _primed(model)
    ref = [model.decode_step(t, plain) for t in CHUNK]
    c = _primed(model)
    before = counters.snapshot()
    logits, h_seed = model.decode_step_t(CHUNK, c.pos, c, StateTrail())
    assert counters.delta(before)["spec_verify_columns"] == len(CHUNK)
    assert logits.shape == (len(CHUNK), model.cfg.vocab_size) and h_seed.shape == (len(CHUNK), model.cfg.hidden_size)
    for j, row in enumerate(ref):
        assert _bits(logits[j], row), f"{arch}: verify column {j} differs from decode_step"
    assert c.pos == plain.pos
    for a, b in zip(_state(c, model), _state(plain, model)):
        assert _bits(a, b)
    # h_seed is the final-normed hidden decode would have produced: its logits are the column's
    assert _bits(model.logits(h_seed[-1:])[0], logits[-1])


@pytest.mark.parametrize("keep", [1, 3, len(CHUNK)])
@pytest.mark.parametrize("mode", ["trail", "replay"])
def test_rollback_restores_the_plain_state(load_model, keep, mode):
    model = load_model(hf_dir("qwen3_5"))
    c = _primed(model)
    pos0, trail = c.pos, StateTrail()
    snap = c.snapshot()
    model.decode_step_t(CHUNK, pos0, c, trail if mode == "trail" else None)
    if keep < len(CHUNK):
        if mode == "trail":
            c.rollback(pos0, keep, trail)
        else:
            c.restore(snap)
            model.decode_step_t(CHUNK[:keep], pos0, c)
    plain = _primed(model)
    for t in CHUNK[:keep]:
        model.decode_step(t, plain)
    assert c.pos == plain.pos == pos0 + keep
    for a, b in zip(_state(c, model), _state(plain, model)):
        assert _bits(a, b)
    # the next step (which overwrites the dropped KV rows) matches too
    assert _bits(model.decode_step(1, c), model.decode_step(1, plain))


def test_verify_refuses_before_anything_moves(load_model):
    model = load_model(hf_dir("qwen3_5"))
    c = _primed(model, ctx=len(PROMPT) + 4)
    pos, state = c.pos, _state(c, model)
    with pytest.raises(MemraError, match="stands at"):
        model.decode_step_t([1, 2], pos + 1, c)
    with pytest.raises(ContextOverflowError):
        model.decode_step_t(CHUNK, pos, c)  # 9 tokens into 4 free positions
    with pytest.raises(MemraError, match="outside the vocabulary"):
        model.decode_step_t([1, model.cfg.vocab_size], pos, c)
    with pytest.raises(MemraError, match="keeps"):
        c.rollback(pos, 1, StateTrail())  # nothing was verified from pos
    with pytest.raises(MemraError, match="no verify body"):
        model.with_doors(MEMRA_DECODE_PLAN="bucket").decode_step_t([1], pos, c)
    assert c.pos == pos and all(_bits(a, b) for a, b in zip(_state(c, model), state))


def _plain_and_spec(model, params, spec, prompt=PROMPT):
    plain = list(generate_tokens(model, prompt, params))
    stats = GenerationStats()
    got = list(generate_tokens(model, prompt, params, stats, speculative=spec))
    return plain, got, stats


SPEC_ARCHS = [a for a in HF_ARCHS if a != "llama_tied"]  # llama_tied is llama's network with a tied head


@pytest.mark.parametrize("arch", SPEC_ARCHS)
def test_greedy_speculation_is_token_identical(load_model, arch):
    """64 greedy tokens, every drafter the checkpoint has, K in {1, 4, 8}: the plain stream exactly."""
    model = load_model(hf_dir(arch))
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = list(generate_tokens(model, PROMPT, params))
    methods = ["ngram"] + (["mtp"] if model.mtp else [])
    for method in methods:
        for k in (1, 4, 8):
            stats = GenerationStats()
            got = list(generate_tokens(model, PROMPT, params, stats, speculative=SpecConfig(method, k=k)))
            assert got == plain, f"{arch} {method} K={k}"
            s = stats.spec
            assert s.verifies > 0 and s.emitted == len(plain) - 1 and s.accepted <= s.drafted
            assert s.tokens_per_verify == pytest.approx(s.emitted / s.verifies)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_demo_model_speculation_is_token_identical_and_accepts(demo, method):
    ids = demo.tokenizer.encode("ROMEO: But soft, what light through yonder window breaks?", add_special=True)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for k in (1, 4, 8):
        plain, got, stats = _plain_and_spec(demo, params, SpecConfig(method, k=k), ids)
        assert got == plain, f"demo {method} K={k}"
        if method == "mtp" and k == 1:  # the demo's MTP head is trained: its draft is right more often than not
            assert stats.spec.acceptance > 0.5, stats.spec.summary()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 1.0, 0), (1.0, 0.9, 40)])
def test_seeded_sampling_is_identical_with_and_without_speculation(load_model, arch, temperature, top_p, top_k):
    model = load_model(hf_dir(arch))
    for seed in (1, 2):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=48)
        for method in (["mtp"] if model.mtp else []) + ["ngram"]:
            plain, got, _ = _plain_and_spec(model, params, SpecConfig(method, k=4))
            assert got == plain, f"{arch} {method} seed {seed}"


def test_penalties_stops_dynamic_k_and_replay_keep_the_stream(load_model):
    model = load_model(hf_dir("qwen3_5"))
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5,
                            logit_bias={7: 5.0})
    for spec in (SpecConfig("mtp", k=6, dynamic_k=True), SpecConfig("ngram", k=3, rollback="replay"),
                 SpecConfig("mtp", k=4, rollback="replay")):
        plain, got, _ = _plain_and_spec(model, params, spec)
        assert got == plain, spec
    # an end-of-sequence id inside an accepted run ends the stream at the same token
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    stream = list(generate_tokens(model, PROMPT, greedy))
    eos = stream[11]
    plain = list(generate_tokens(model, PROMPT, greedy, eos_ids=[eos]))
    stats = GenerationStats()
    got = list(generate_tokens(model, PROMPT, greedy, stats, eos_ids=[eos], speculative=SpecConfig("mtp", k=8)))
    assert got == plain and got[-1] == eos and stats.finish_reason == "stop"


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(SpecConfig("ngram", k=3, ngram_max=3, ngram_min=1))
    d.start([1, 2, 3, 4, 9, 2, 3, 5, 6], None, 2)  # history ... 5 6 2: suffix "2" last seen before "3 5 6"
    assert d.propose(3, 0) == [3, 5, 6]
    d.advance([2, 3], None, 4)  # kept "2 3" (the 2 was already emitted), then chose 4: suffix "2 3 4"
    assert d.history[-3:] == [2, 3, 4] and d.propose(2, 0) == [9, 2]
    d.start([7, 8], None, 9)
    assert d.propose(4, 0) == []  # nothing repeats


def test_mtp_drafter_refuses_a_model_without_mtp(load_model):
    model = load_model(hf_dir("llama"))
    with pytest.raises(MemraError, match="no MTP block; use --speculative ngram"):
        MtpDrafter(model, model.new_cache(16), SamplingParams(temperature=0.0, max_tokens=128))
    with pytest.raises(MemraError):
        SpecConfig("medusa")
    with pytest.raises(MemraError):
        SpecConfig("mtp", k=0)


def test_stacked_verify_body_follows_decode_order(load_model):
    """The stacked verify (the GPU plan) on CPU's torch kernels, which are not batch-invariant, so
    the bits are the GPU's business (MEMRA_TEST_DEVICE=cuda); here: the same numbers up to fp32
    rounding, i.e. KV order, GDN sequencing and the trail are those of decode."""
    from memra.runner import bodies

    model = load_model(hf_dir("qwen3_5_moe"))
    a, b = _primed(model), _primed(model)
    with torch.inference_mode():
        ref = []
        for t in CHUNK:
            a.reserve(1)
            ref.append(bodies.decode_stacked(model, torch.tensor([t], device=model.device), [a])[0])
        b.reserve(len(CHUNK))
        trail = StateTrail()
        h = bodies.verify_layers(model, model.embed_tokens(torch.tensor(CHUNK, device=model.device)), b, b.pos,
                                 "stacked", trail=trail)
        logits, _ = bodies.verify_head(model, h, "stacked")
    for j, row in enumerate(ref):
        assert (logits[j] - row).abs().max().item() < 1e-4 * row.abs().max().item()
    for i in model.cfg.gdn_layers:
        assert (trail.ssm[i][len(CHUNK) - 1] - a.ssm_state(i)).abs().max().item() < 1e-5
        assert (trail.conv[i][len(CHUNK) - 1] - a.conv_state(i)).abs().max().item() < 1e-5
        assert torch.equal(trail.conv[i][len(CHUNK) - 1], b.conv_state(i))  # the trail's last column is the state


@pytest.mark.parametrize("stages", [2, 3])
def test_ppspec_gate_all_green(load_model, stages):
    from memra.gate.ppspec_battery import run_ppspec_battery

    lines: list[str] = []
    model = load_model(hf_dir("qwen3_5"))
    assert run_ppspec_battery(model, stages=stages, ts=(2, 5, 9), rounds=4, reps=2, out=lines.append), "\n".join(lines)
    assert f"ALL GREEN: spec-verify PP-{stages}" in lines[-1]
    assert any(line.startswith("spec stream PASS") for line in lines)


def test_ppspec_gate_canary_fails(load_model):
    from memra.gate.ppspec_battery import run_ppspec_battery

    lines: list[str] = []
    model = load_model(hf_dir("qwen3_next")).with_doors(MEMRA_GATE_CANARY="1")
    assert not run_ppspec_battery(model, stages=2, ts=(3,), rounds=3, reps=1, out=lines.append)
    assert any("arm1" in line and "FAIL" in line for line in lines)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CLI test runs on CPU")
def test_cli_generate_speculative_reports_acceptance():
    run = lambda *extra: subprocess.run([sys.executable, "-m", "memra", "generate", "ROMEO:", "--max-tokens", "24", *extra],
                                        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    plain = run()
    spec = run("--speculative", "mtp", "--draft-k", "2")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "drafts accepted" in spec.stderr and "tokens per verify" in spec.stderr
    bad = run("--speculative", "mtp", "--draft-k", "0")
    assert bad.returncode != 0 and "draft k must be" in bad.stderr and "Traceback" not in bad.stderr
