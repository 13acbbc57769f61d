"""memra.train.Trainer (promise E11): the training forward's logprobs equal, bit for bit, the logprobs memra sampled
the same tokens with, whatever the packing, order and lengths, on every fixture architecture (CPU fp32); its
gradients match HF transformers' in float64 within a stated tolerance for a dense, a MoE and a hybrid model."""

from __future__ import annotations

import random

import pytest
import torch

import memra
from memra import counters
from memra.decode_plan import decode_plan
from memra.errors import MemraError
from memra.sampling import SamplingParams
from memra.train import Trainer

from conftest import hf_dir

ARCHS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe",
         "step3p5"]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 80))]  # the second crosses the 64-token grid


def sampled(llm, max_tokens: int = 10, seed: int = 3):
    """(prompt + completion, prompt length, sampled logprobs) of every choice: seeded, n=2 per prompt."""
    p = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed, logprobs=0, n=2,
                       ignore_eos=True)
    outs = llm.generate(PROMPTS, p, use_tqdm=False)
    return [(pr + c.token_ids, len(pr), c.token_logprobs) for pr, o in zip(PROMPTS, outs) for c in o.outputs]


def pack(seqs, order):
    ids = [t for k in order for t in seqs[k][0]]
    return torch.tensor(ids), [len(seqs[k][0]) for k in order], [seqs[k][1] for k in order]


def generated(lp: torch.Tensor, seqs, order) -> dict[int, list[float]]:
    """Each sequence's logprobs at its generated tokens (position i holds the logprob of token i + 1)."""
    out, at = {}, 0
    for k in order:
        n, s = len(seqs[k][0]), seqs[k][1]
        out[k] = lp[at + s - 1 : at + n - 1].tolist()
        at += n
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_logprobs_equal_the_sampled_ones_whatever_the_packing(arch):
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    trainer = Trainer(llm)
    seqs = sampled(llm)
    rng = random.Random(arch)
    before = counters.snapshot()
    for order in (list(range(len(seqs))), rng.sample(range(len(seqs)), len(seqs)), [2]):
        lp = trainer(*pack(seqs, order))
        assert lp.requires_grad
        for k, got in generated(lp, seqs, order).items():
            assert got == seqs[k][2], (arch, order, k)  # float equality: the same bits
    after = counters.snapshot()
    assert after["train_exact_tokens"] > before["train_exact_tokens"]
    assert after["train_grad_tokens"] > before["train_grad_tokens"]
    # the CPU's default values: the scorer where the sampler decodes its rows stacked (an fp32 model on the
    # row-invariant linear, MEMRA_CPU_FLIN), else the walk in the sampler's grouping (its one-row steps); the
    # two give the same bits either way
    assert trainer.values == ("scorer" if decode_plan(llm.model) == "stacked" else "walk"), arch
    with torch.no_grad():
        scored = Trainer(llm, values="scorer")(*pack(seqs, order))
        walked = Trainer(llm, values="walk")(*pack(seqs, order))
    assert torch.equal(scored, walked), arch  # every position, the prompt's included



def _hf_grad(ref: dict, name: str) -> torch.Tensor | None:
    """HF's gradient for a checkpoint name (its MoE holds the experts fused: gate_up_proj [X, 2F, E], gate first)."""
    if name in ref:
        return ref[name].grad
    if ".experts." in name:
        head, rest = name.split(".experts.")
        x, proj = int(rest.split(".")[0]), rest.split(".")[1]
        if proj == "down_proj":
            return ref[f"{head}.experts.down_proj"].grad[x]
        gu = ref[f"{head}.experts.gate_up_proj"].grad[x]
        f = gu.shape[0] // 2
        return gu[:f] if proj == "gate_proj" else gu[f:]
    return None


# fp32 gradients against float64 ones, max |g - g64| / max |g64| per tensor: attention models at fp32 rounding
# over a few hundred terms; GDN's chunked form (a triangular solve per 64-token chunk) amplifies it ~100x
TOLERANCE = {"llama": 2e-5, "qwen3_moe": 2e-5, "qwen3_5": 1e-3}


@pytest.mark.parametrize("arch", list(TOLERANCE))
def test_gradients_match_hf_transformers_in_float64(arch):
    transformers = pytest.importorskip("transformers")
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    trainer = Trainer(llm, checkpointing=True)
    g = torch.Generator().manual_seed(0)
    lens, starts = [70, 9, 33], [60, 4, 33]
    ids = torch.randint(0, llm.model.cfg.vocab_size, (sum(lens),), generator=g)
    coef = torch.randn(sum(lens), generator=g)  # advantages
    (coef * trainer(ids, lens, starts)).sum().backward()
    extra = {"experts_implementation": "eager"} if "moe" in arch else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir(arch)), dtype=torch.float64,
                                                           attn_implementation="eager", **extra)
    total, at = 0, 0
    for n in lens:
        x = ids[at : at + n]
        logp = torch.log_softmax(hf(x[None]).logits[0].double(), -1)[:-1].gather(1, x[1:, None])[:, 0]
        total = total + (coef[at : at + n - 1].double() * logp).sum()
        at += n
    total.backward()
    ref = dict(hf.named_parameters())
    worst = {}
    for name, p in trainer.named_weights().items():
        r = _hf_grad(ref, name)
        assert r is not None and p.grad is not None, name
        worst[name] = ((p.grad.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
    assert max(worst.values()) <= TOLERANCE[arch], max(worst.items(), key=lambda kv: kv[1])


def test_checkpointing_and_the_sampler_walk_give_the_same_gradient():
    llm = memra.LLM(str(hf_dir("qwen3_5")), warm_up=False, seed=1)
    seqs = sampled(llm, max_tokens=6)[:3]
    grads = {}
    for name, kw in {"plain": {}, "ckpt": {"checkpointing": True}, "sampler": {"grad_walk": "sampler"}}.items():
        trainer = Trainer(llm, **kw)
        before = counters.snapshot()["train_checkpointed_layers"]
        trainer(*pack(seqs, [0, 1, 2])).sum().backward()
        assert (counters.snapshot()["train_checkpointed_layers"] > before) == (name == "ckpt")
        grads[name] = torch.cat([p.grad.flatten() for p in trainer.params])
    assert torch.equal(grads["plain"], grads["ckpt"])  # the recomputed layers are the same computation
    # the sampler's grouping is the same function computed in another order
    assert ((grads["plain"] - grads["sampler"]).abs().max() / grads["sampler"].abs().max()) < 1e-4


def test_an_optimizer_step_must_reach_the_sampler_before_the_next_forward():
    """With values from the scorer (a GPU's default: the sampler's own weight tensors), so the refusal guards E11."""
    llm = memra.LLM(str(hf_dir("qwen3_5")), warm_up=False, seed=1)
    trainer = Trainer(llm, values="scorer")
    seqs = sampled(llm, max_tokens=6)
    opt = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    (-trainer(*pack(seqs, [0, 1])).sum()).backward()
    opt.step()
    with pytest.raises(MemraError, match="update_weights"):
        trainer(*pack(seqs, [0]))
    assert llm.update_weights(trainer.weights()) == 1
    again = sampled(llm, max_tokens=6, seed=9)  # sampled with the new weights
    lp = trainer(*pack(again, [3, 0]))
    for k, got in generated(lp, again, [3, 0]).items():
        assert got == again[k][2]
    for bad, msg in [(([1, 2, 3], [2]), "sum to"), (([1, 2, 3], [3], [4]), "starts"),
                     (([1, 2, 5000], [3]), "token ids")]:
        with pytest.raises(MemraError, match=msg):
            trainer(torch.tensor(bad[0]), *bad[1:])


def test_canary_a_trainer_on_the_plain_forward_is_not_the_sampler():
    llm = memra.LLM(str(hf_dir("qwen3_5")), warm_up=False, seed=1)
    seqs = sampled(llm)
    lp = Trainer(llm, canary=True)(*pack(seqs, [0, 1, 2, 3]))
    got = generated(lp, seqs, [0, 1, 2, 3])
    assert any(got[k] != seqs[k][2] for k in got)
    assert max(abs(a - b) for k in got for a, b in zip(got[k], seqs[k][2])) < 1e-3  # close, not equal


@pytest.mark.parametrize("arch", ["qwen3_5"])
def test_the_train_gate_is_green_and_its_canary_fails(arch, load_model):
    from memra.gate.train_arm import run_train_battery

    model = load_model(hf_dir(arch))
    lines: list[str] = []
    assert run_train_battery(model, steps=6, plen=8, out=lines.append), "\n".join(lines)
    lines = []
    assert not run_train_battery(model.with_doors(MEMRA_GATE_CANARY="1"), steps=6, plen=8, out=lines.append)
    assert any(line.startswith("e11:") and "FAIL" in line for line in lines), "\n".join(lines)


def test_models_the_walk_cannot_run_are_refused_in_one_line():
    from conftest import FIXTURES

    packed = memra.load(str(FIXTURES / "gguf" / "llama-q8_0.gguf"))  # Q8_0 kept packed on a CPU
    with pytest.raises(MemraError, match="packed_weights=False"):
        Trainer(packed)
    f32 = memra.LLM(str(FIXTURES / "gguf" / "llama-f32.gguf"), warm_up=False, seed=1)  # GGUF names work
    seqs = sampled(f32, max_tokens=4)[:1]
    for k, got in generated(Trainer(f32)(*pack(seqs, [0])), seqs, [0]).items():
        assert got == seqs[k][2]
    with pytest.raises(MemraError, match="gemma4"):
        Trainer(memra.load(str(hf_dir("gemma4"))))
