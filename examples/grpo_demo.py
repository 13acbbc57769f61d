"""A GRPO-style RL loop on the bundled demo model, on a CPU in a few minutes, with no data.

    python examples/grpo_demo.py [--steps 12] [--group 6] [--tokens 16] [--lr 1e-3]

Each step: memra.LLM samples `group` completions per prompt (seeded, temperature 1: the policy itself); a reward
that needs no data scores them (the share of uppercase letters among the generated characters: the demo learnt
Shakespeare, whose speaker names are in capitals); group-relative advantages; memra.train.Trainer computes each
generated token's logprob, which must equal the one it was sampled with, bit for bit (printed: the largest
|trainer - sampler| over every token, exactly 0.0); one optimizer step; llm.update_weights hands the new weights to
the sampler. The mean reward rises. docs/RL.md explains the loop, what is exact and what it costs.
"""

from __future__ import annotations

import argparse
import time

import torch

import memra
from memra import SamplingParams
from memra.train import Trainer

PROMPTS = ["ROMEO:", "JULIET:\n", "First Citizen:\n", "KING LEAR:\n"]


def reward(text: str) -> float:
    """The share of uppercase letters among the generated characters."""
    return sum(c.isupper() for c in text) / max(len(text), 1)


def step_batch(llm, step: int, group: int, tokens: int, prompts: list[str] = PROMPTS):
    """Sample `group` choices per prompt. -> (prompt ids, [(completion ids, sampled logprobs, reward)] per prompt)."""
    params = SamplingParams(n=group, max_tokens=tokens, temperature=1.0, top_p=1.0, top_k=0, seed=1000 * step + 1,
                            logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids, [(c.token_ids, c.token_logprobs, reward(c.text)) for c in o.outputs]) for o in outs]


def run(steps: int = 12, group: int = 6, tokens: int = 16, lr: float = 1e-3, seed: int = 1, out=print,
        prompts: list[str] = PROMPTS) -> list[dict]:
    torch.manual_seed(seed)
    llm = memra.LLM("demo", warm_up=False, seed=seed)
    trainer = Trainer(llm)
    opt = torch.optim.Adam(trainer.parameters(), lr=lr)
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = step_batch(llm, step, group, tokens, prompts)
        t1 = time.perf_counter()
        ids, lens, starts, adv, sampled = [], [], [], [], []
        for prompt, choices in batch:
            r = torch.tensor([c[2] for c in choices])
            a = (r - r.mean()) / (r.std() + 1e-6)  # group-relative advantage
            for (gen, lps, _), a_k in zip(choices, a.tolist()):
                ids += prompt + gen
                lens.append(len(prompt) + len(gen))
                starts.append(len(prompt))
                adv.append(a_k)
                sampled.append(lps)
        logp = trainer(torch.tensor(ids), lens, starts)  # [N]: each position's logprob of the next token
        at, terms, mismatch = 0, [], 0.0
        for n, s, a_k, lps in zip(lens, starts, adv, sampled):
            gen_lp = logp[at + s - 1 : at + n - 1]  # the generated tokens' logprobs
            mismatch = max(mismatch, max(abs(x - y) for x, y in zip(gen_lp.tolist(), lps)))
            terms.append(a_k * gen_lp.sum())
            at += n
        loss = -torch.stack(terms).sum() / sum(n - s for n, s in zip(lens, starts))
        t2 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t3 = time.perf_counter()
        llm.update_weights(trainer.weights())
        t4 = time.perf_counter()
        mean_r = sum(c[2] for _, cs in batch for c in cs) / sum(len(cs) for _, cs in batch)
        row = {"step": step, "reward": mean_r, "mismatch": mismatch, "sample_s": t1 - t0, "forward_s": t2 - t1,
               "backward_s": t3 - t2, "update_s": t4 - t3, "step_s": t4 - t0}
        history.append(row)
        out(f"step {step:3d}  mean reward {mean_r:.4f}  max |trainer - sampler| logprob {mismatch}  "
            f"(sample {t1 - t0:.2f}s, trainer forward {t2 - t1:.2f}s, backward+step {t3 - t2:.2f}s, "
            f"update_weights {t4 - t3:.3f}s)")
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group", type=int, default=6, help="choices sampled per prompt")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per choice")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the demo's ops are small: more threads "
                                                           "mostly spin-wait)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    run(a.steps, a.group, a.tokens, a.lr, a.seed)
