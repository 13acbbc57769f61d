"""The values of the training forward: each position's logprob as the sampler computed it, without autograd.

- "scorer": memra.engine.scoring (promise E9: scoring a sampled completion after its prompt gives every token the
  logprob it was sampled with, bit for bit), on a view of the sampler's model (HybridModel.with_settings: the
  same weight tensors, caches of its own). Any device: it runs the model's own kernel table. On a CPU the
  sequences' generated tokens are verified together (sampler_logprobs_batch: one forward a round for all of
  them, where a GPU keeps one verify a sequence).
- "walk": the trainer's walk in the sampler's grouping (memra.train.walk), layer-major, over the weights derived
  from the parameters, on the sampler's table's choices (TrainOps.mirror: the C kernels where MEMRA_CPU_DECODE
  runs them). Where the model's kernel table is the reference (a CPU) it runs the sampler's very ops on
  the sampler's very forwards, so the same bits (tests/test_train.py holds it to the scorer on every fixture
  architecture); a layer's weights then stay in cache across a sequence's tokens, which makes it faster there.
"""

from __future__ import annotations

import torch

from memra import counters
from memra.engine.scoring import ScoreJob, score, score_values_batch
from memra.train.ops import TrainOps
from memra.train.walk import Seq, Walk


@torch.no_grad()
def sampler_logprobs(view, seq: Seq) -> torch.Tensor:
    """[L-1] fp32: row i is the logprob of ids[i+1] as the sampler gives it (prompt rows as prompt_logprobs,
    generated rows as sampled)."""
    ids = seq.ids.tolist()
    n = len(ids)
    job = ScoreJob(tuple(ids), seq.start if seq.start < n else None, 0)
    cache = view.new_cache(n)
    try:
        scores = score(view, job, cache, values_only=True)
    finally:
        cache.free()
    counters.bump("train_exact_tokens", n - 1)
    return torch.tensor(scores[1:], dtype=torch.float32)


@torch.no_grad()
def sampler_logprobs_batch(view, seqs: list[Seq]) -> list[torch.Tensor]:
    """sampler_logprobs of every sequence, their generated tokens verified together (score_values_batch: one
    batched verify forward a round, each column its own sequence's decode step, E4) -> [L-1] fp32 each."""
    jobs = [ScoreJob(tuple(s.ids.tolist()), s.start if s.start < s.ids.numel() else None, 0) for s in seqs]
    caches = []
    try:
        for s in seqs:
            caches.append(view.new_cache(s.ids.numel()))
        scores = score_values_batch(view, jobs, caches)
    finally:
        for c in caches:
            c.free()
    counters.bump("train_exact_tokens", sum(s.ids.numel() - 1 for s in seqs))
    return [torch.tensor(sc[1:], dtype=torch.float32) for sc in scores]


@torch.inference_mode()
def walked_logprobs(model, weights: dict[str, torch.Tensor], seqs: list[Seq]) -> list[torch.Tensor]:
    """Every sequence's [L-1] logprobs from the walk in the sampler's grouping."""
    out = Walk(model, weights, TrainOps.mirror(model.ops)).logprobs(seqs, "sampler")
    counters.bump("train_exact_tokens", sum(s.ids.numel() - 1 for s in seqs))
    return out
