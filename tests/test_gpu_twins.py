"""CPU twins of what only the GPU path runs (docs/GPU.md lists what is left to the `cuda` tests).

The GPU path differs from the CPU's in three ways these tests reproduce on CPU, with the GPU's kernel
table run in Triton's interpreter (conftest.gpu_kernel_table):
- its piece plan: a prime is one forward per chunk (INVARIANT_PIECE), not one per 64 tokens, so how a
  prompt is chunked changes which tokens share a forward (E5, E8: issue 44's served/offline drift);
- its captured steps: a static step (memra.graphs, memra.mixed_graphs) must never make the host wait
  for the device (memra.capture), for every architecture, MoE ones included (Step-3.5's crashed);
- its prefix cache under load: the prefix gate's arms on the GPU's piece plan and kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import FIXTURES, gpu_kernel_table, hf_dir
from memra import step

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter runs the Triton kernels on CPU tensors")

ARCHS = sorted(p.name for p in (FIXTURES / "hf").iterdir() if (p / "config.json").exists())
# The default suite's share (the interpreter is slow): Step's MoE (clamped SwiGLU, a scaled
# sum), whose reference fallback crashed the capture; every fixture architecture with -m slow.
QUICK = ("step3p5",)


@pytest.fixture
def gpu_path(monkeypatch):
    """load(arch) -> the fixture's model with the GPU's kernel table (interpreted) and its piece plan."""
    from memra.kernels.table import KernelTable
    from memra.loading.checkpoint import load

    table = gpu_kernel_table()
    monkeypatch.setattr(KernelTable, "build", classmethod(lambda cls, device, settings: table))
    monkeypatch.setattr(step, "exact_piece", lambda model: step.INVARIANT_PIECE)  # the invariant path's plan

    def get(arch: str):
        model = load(hf_dir(arch), device="cpu", tokenizer=False)
        return model.with_doors(MEMRA_DECODE_PLAN="row")  # the stacked plan's check needs the GPU's torch ops

    return get


def _kv_bytes(model, cache) -> list[torch.Tensor]:
    blocks = torch.tensor(cache.blocks[: -(-cache.pos // 16)])
    kv = cache.kv
    return [kv.k[i][blocks] for i in kv.layers if i < model.cfg.n_layers]


def test_a_prompt_token_primed_alone_keeps_its_one_shot_bits(gpu_path):
    """A prompt of 64k + 1 tokens cut at 64k (a prefix-cache hit, a snapshot stop, the token budget)
    primes its last token as a forward of its own: its logits and K/V must be those of the one-shot
    prime, which runs it inside one forward. They were not while a lone prompt token attended through
    the decode kernel (issue 44's E8 failure: served request #170, 129 tokens)."""
    model = gpu_path("llama")
    prompt = [(37 * i + 11) % model.cfg.vocab_size for i in range(129)]
    whole = model.new_cache(256)
    want = model.prime(prompt, whole)
    for cut in (128, 64):
        cache = model.new_cache(256)
        model.prime(prompt[:cut], cache)
        got = model.prime(prompt[cut:], cache)
        assert torch.equal(got, want), f"cut at {cut}: logits differ by {(got - want).abs().max().item():.3g}"
        assert all(torch.equal(a, b) for a, b in zip(_kv_bytes(model, cache), _kv_bytes(model, whole)))


@pytest.mark.parametrize("arch", [a if a in QUICK else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_captured_steps_never_wait_for_the_device(gpu_path, arch):
    """The decode graph's and the mixed graph's static steps, run eagerly on the GPU's table under
    memra.capture's guard (memra.graphs.run_static): any op that would break a capture raises here."""
    from memra.graphs import StaticDecode, reserve_scratch, scratch_of, table_blocks
    from memra.mixed_graphs import StaticMixed, token_bucket

    model = gpu_path(arch)
    vocab = model.cfg.vocab_size
    probe = model.new_cache(128)
    reserve_scratch(model, probe.kv, probe.rec)
    probe.free()
    running = [model.new_cache(128) for _ in range(2)]
    for c, n in zip(running, (5, 3)):  # positions as if primed: this checks what the step asks of the host, not values
        c.reserve(n + 2)
        c.pos = n
    scratch = scratch_of(running[0].kv, running[0].rec, model.graph_scratch)
    ids = torch.tensor([7 % vocab, 8 % vocab])
    decode = StaticDecode(model, running[0].kv, running[0].rec, 4, table_blocks(128))  # two inert padding rows
    assert decode.run(ids, running, scratch).shape == (2, vocab)
    for c in running:
        c.pos += 1
    new = model.new_cache(128)
    new.reserve(3)
    mixed = StaticMixed(model, running[0].kv, running[0].rec, 2, token_bucket(3), table_blocks(128))
    got, lasts = mixed.run(ids, running, [torch.tensor([2, 7, 1])], [new], scratch)
    assert got.shape == (2, vocab) and lasts[0].shape == (vocab,)


@pytest.mark.slow  # minutes in the interpreter
def test_the_prefix_gate_holds_on_the_gpu_piece_plan(gpu_path):
    """`memra gate --mode prefix`'s arms, the load arm's single-token tails included, on the GPU's kernels
    and piece plan: a hit equals a cold run (on the code before the fix, the load arm FAILed here)."""
    from memra.gate.prefix_battery import run_prefix_battery

    lines = []
    assert run_prefix_battery(gpu_path("llama"), batches=(1, 2), steps=4, out=lines.append), "\n".join(lines)
