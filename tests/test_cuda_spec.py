"""Speculative decoding on the GPU (what tools/gpu_spec_report.py used to print, now pass/fail):

- `memra gate --mode ppspec` on the bundled demo (bf16), PP-2 on one GPU (a stream per stage);
- every speculative run emits the plain run's tokens: the demo (its MTP head is trained: real
  acceptance) with MTP at K = 1, 2, 4, dynamic K, snapshot+replay rollback, n-gram, seeded sampling at
  T=0.8, and an oracle drafter that proposes the plain stream itself (every draft must be accepted);
  and a random-weight Qwen3.5-9B-shaped model (bf16, 4 layers; its MTP head drafts noise).

The oracle also runs on CPU (fp32, a shorter stream); every fixture architecture's columns, rollbacks and
streams, and the demo's drafters, are tests/test_spec.py. Tokens/s and the verify's cost against T: tools/gpu_profile_spec.py.
"""

from __future__ import annotations

import pytest

import memra
import memra.spec
from cuda_marks import cuda_only, needs_cuda
from memra.generate import GenerationStats, generate_tokens
from memra.sampling import SamplingParams
from memra.spec import ReplayDrafter, SpecConfig

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def plain_and_spec(model, ids, params, spec, monkeypatch, oracle: bool = False):
    plain = list(generate_tokens(model, ids, params))
    if oracle:
        monkeypatch.setattr(memra.spec, "make_drafter", lambda *a: ReplayDrafter(plain))
    stats = GenerationStats()
    got = list(generate_tokens(model, ids, params, stats, speculative=spec))
    monkeypatch.undo()
    return plain, got, stats.spec


@cuda_only
def test_ppspec_gate_demo_bf16_pp2():
    from memra.gate.ppspec_battery import run_ppspec_battery

    demo = memra.load("demo", device="cuda", dtype="bfloat16", tokenizer=False)
    lines: list[str] = []
    ok = run_ppspec_battery(demo, stages=2, ts=(2, 5, 9), rounds=6, reps=2, out=lines.append)
    assert ok, "\n".join(lines)


_DEMO: dict = {}


def demo(device: str):
    if device not in _DEMO:
        _DEMO[device] = memra.load("demo", device=device, dtype="bfloat16" if device == "cuda" else "float32")
    return _DEMO[device]


DEMO_CASES = {
    "mtp K=1": (SpecConfig("mtp", k=1), 0.0),
    "mtp K=2": (SpecConfig("mtp", k=2), 0.0),
    "mtp K=4": (SpecConfig("mtp", k=4), 0.0),
    "mtp K=4 dynamic": (SpecConfig("mtp", k=4, dynamic_k=True), 0.0),
    "mtp K=2 replay": (SpecConfig("mtp", k=2, rollback="replay"), 0.0),
    "ngram K=4": (SpecConfig("ngram", k=4), 0.0),
    "mtp K=2 T=0.8": (SpecConfig("mtp", k=2), 0.8),
    "oracle K=4": (SpecConfig("ngram", k=4), 0.0),
}
# Every case on the GPU; on CPU only the oracle (tests/test_spec.py runs the demo's drafters there).
CASES = [pytest.param("cuda", case, marks=needs_cuda, id=f"cuda-{case}") for case in DEMO_CASES] + \
        [pytest.param("cpu", "oracle K=4", id="cpu-oracle K=4")]


@pytest.mark.parametrize("device,case", CASES)
def test_demo_speculation_is_token_identical(device, case, monkeypatch):
    spec, temperature = DEMO_CASES[case]
    model = demo(device)
    n = 192 if device == "cuda" else 64
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=5 if temperature else 0)
    ids = model.tokenizer.encode(PROMPT, add_special=True)
    plain, got, s = plain_and_spec(model, ids, params, spec, monkeypatch, oracle=case.startswith("oracle"))
    assert got == plain, f"{case}: speculation changed the stream ({s.summary()})"
    assert s.verifies > 0 and s.accepted <= s.drafted
    if case.startswith("oracle"):
        assert s.accepted == s.drafted > 0, s.summary()


@cuda_only
@pytest.mark.parametrize("case", ["mtp K=1", "mtp K=2 replay", "oracle K=2", "oracle K=4"])
def test_9b_shape_speculation_is_token_identical(shape_9b, case, monkeypatch):
    spec = {"mtp K=1": SpecConfig("mtp", k=1), "mtp K=2 replay": SpecConfig("mtp", k=2, rollback="replay"),
            "oracle K=2": SpecConfig("ngram", k=2), "oracle K=4": SpecConfig("ngram", k=4)}[case]
    ids = [(7 + 31 * j) % shape_9b.cfg.vocab_size for j in range(32)]
    plain, got, s = plain_and_spec(shape_9b, ids, SamplingParams(temperature=0.0, max_tokens=48), spec, monkeypatch,
                                   oracle=case.startswith("oracle"))
    assert got == plain, f"{case}: speculation changed the stream ({s.summary()})"
    if case.startswith("oracle"):
        assert s.accepted == s.drafted > 0, s.summary()
