"""E11 with MEMRA_CPU_DECODE on: the sampler's CPU norms, SwiGLU and decode attention run in C (memra.kernels.
cpu_decode, other bits than torch's), and the trainer's walk mirrors them (memra.train.ops.TrainOps.mirror):
prompt tokens through the norms / SwiGLU in C and torch's prefill attention, generated tokens through the C
decode attention too, as the sampler ran them (every fixture architecture). The gradient goes through the ops'
torch forms (CKernel)."""

from __future__ import annotations

import pytest
import torch

import memra
from memra import counters
from memra.kernels import cpu_qdot
from memra.train import Trainer

from conftest import hf_dir
from test_train import ARCHS, generated, pack, sampled

pytestmark = pytest.mark.skipif(cpu_qdot.library() is None, reason="the CPU kernels' library is not built")


def _door_on(arch: str, monkeypatch) -> memra.LLM:
    monkeypatch.setenv("MEMRA_CPU_DECODE", "1")
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    assert llm.model.ops.cpu_ops, "the door is on: the sampler's table runs the C kernels"
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_logprobs_equal_the_sampled_ones_with_the_c_kernels(arch, monkeypatch):
    llm = _door_on(arch, monkeypatch)
    seqs = sampled(llm)
    # values from the inference walk; and (a dense, a MoE, a hybrid) values and gradient from one walk (CKernel)
    walks = ({}, {"grad_walk": "sampler"}) if arch in ("llama", "qwen3_moe", "qwen3_5") else ({},)
    for kw in walks:
        trainer = Trainer(llm, **kw)
        for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
            lp = trainer(*pack(seqs, order))
            for k, got in generated(lp, seqs, order).items():
                assert got == seqs[k][2], (arch, kw, order, k)  # float equality: the same bits
        lp.sum().backward()
        grads = [p.grad for p in trainer.params if p.grad is not None]  # (an expert no token chose has none)
        assert len(grads) > len(trainer.params) // 2 and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # the scorer (the sampler's own table) agrees at every position, prompts included
        assert torch.equal(Trainer(llm, values="scorer")(*pack(seqs, order)), trainer(*pack(seqs, order)))


def test_the_c_kernels_ran_and_the_torch_walk_is_not_the_sampler(monkeypatch):
    """Canary: the walk on torch's ops (the table before the mirror) misses the door-on sampler's bits."""
    from memra.train.exact import walked_logprobs
    from memra.train.params import derive
    from memra.train.walk import Walk

    llm = _door_on("llama", monkeypatch)
    seqs = sampled(llm)
    trainer = Trainer(llm)
    split = trainer._split(*pack(seqs, [0, 1, 2, 3]))
    w = {k: t.detach() for k, t in derive(llm.model, trainer.named_weights()).items()}
    with torch.inference_mode():
        mirrored = walked_logprobs(llm.model, w, split)
        plain = Walk(llm.model, w).logprobs(split, "sampler")
    want = [torch.tensor(s[2]) for s in seqs]
    assert all(torch.equal(m[s - 1 :], x) for m, x, (_, s, _) in zip(mirrored, want, seqs))
    assert any(not torch.equal(p[s - 1 :], x) for p, x, (_, s, _) in zip(plain, want, seqs))


def test_the_c_kernels_gradient_is_the_torch_forms():
    """CKernel's backward: the torch op's gradient at the same inputs (the forward's values differ by rounding)."""
    from memra.train.ops import TrainOps

    ops, plain = TrainOps.make(cpu_ops=True), TrainOps.make()
    g = torch.Generator().manual_seed(0)
    h, d, w = (torch.randn(5, 16, generator=g, requires_grad=True) for _ in range(3))
    gu = torch.randn(5, 32, generator=g, requires_grad=True)
    for op in (lambda o: o.rms_norm(h, w[0], 1e-6, False), lambda o: torch.cat(o.add_rms_norm(h, d, w[0], 1e-6, False)),
               lambda o: o.silu_mul(gu)):
        grads = []
        for o in (ops, plain):
            out = op(o)
            grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(),
                                             (h, d, w, gu), allow_unused=True))
        for a, b in zip(*grads):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6))


def test_the_train_gate_is_green_with_the_c_kernels(load_model):
    from memra.gate.train_arm import run_train_battery

    model = load_model(hf_dir("qwen3_5")).with_doors(MEMRA_CPU_DECODE="1")
    assert model.ops.cpu_ops
    lines: list[str] = []
    assert run_train_battery(model, steps=6, plen=8, out=lines.append), "\n".join(lines)
