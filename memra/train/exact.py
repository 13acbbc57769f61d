"""The values of the training forward: each position's logprob as the sampler computed it, from the scorer
(memra.engine.scoring, promise E9: scoring a sampled completion after its prompt gives every token the
logprob it was sampled with, bit for bit). It runs on a view of the sampler's model (HybridModel.with_settings:
the same weight tensors, caches of its own), without autograd.
"""

from __future__ import annotations

import torch

from memra import counters
from memra.engine.scoring import ScoreJob, score
from memra.train.walk import Seq


@torch.no_grad()
def sampler_logprobs(view, seq: Seq) -> torch.Tensor:
    """[L-1] fp32: row i is the logprob of ids[i+1] as the sampler gives it (prompt rows as prompt_logprobs,
    generated rows as sampled)."""
    ids = seq.ids.tolist()
    n = len(ids)
    job = ScoreJob(tuple(ids), seq.start if seq.start < n else None, 0)
    cache = view.new_cache(n)
    try:
        scores = score(view, job, cache)
    finally:
        cache.free()
    counters.bump("train_exact_tokens", n - 1)
    return torch.tensor([t.logprob for t in scores[1:]], dtype=torch.float32)
