"""The cross-request prefill arm (`memra gate`, every mode): a prompt's prime does not depend on which
other prompts share its forwards.

Reference: each prompt primed alone (prime). Then the same prompts through prime_batch in several
arrangements — all together, in reverse order, and in pairs — and for every prompt, in every
arrangement: its last-position logits and its cache (each attention layer's K and V rows for its
positions, each GDN layer's conv and recurrent state) must be bit-identical to the reference.

Liveness: PRIME_BATCHES (forwards that carried two or more sequences) must advance, and under a
pipeline split PRIME_BATCH_SPLITS too (the batched forward walked the stages). Where prime batching
is not live (the exact path without the batch-invariant kernels: each prompt is then primed alone,
which is exact by construction) the arm says so and is skipped, not passed.

MEMRA_GATE_CANARY=1 changes one token of the first prompt in the first batched arrangement; the arm
must then FAIL.
"""

from __future__ import annotations

import torch

from memra import counters, step
from memra.cache import BLOCK_SIZE

ARM = "prime-batch"
PRIME_BATCH_LONG = 150  # one longer prompt: more than two 64-token pieces on the exact path's short cuts


def prime_batch_prompts(plen: int, seed: int, vocab: int) -> list[list[int]]:
    """Uneven prompts (one of a single token, one long) so the pieces sharing a forward differ in length
    and position."""
    base = [(55 + seed * 13 + j * 31) % vocab for j in range(PRIME_BATCH_LONG)]
    return [base[:plen], base[7 : 7 + plen + 5], base[:1], base]


def cache_bits(cache, trunk_layers: int) -> list[torch.Tensor]:
    """A sequence's cache state on the host: K and V of its positions in every attention layer of the trunk
    (in position order), then every GDN layer's conv and recurrent state. The MTP block's attention (layer
    trunk_layers + j) is left out: its KV is the drafter's, written only as it drafts (memra.spec.MtpDrafter),
    so after a prime its rows hold whatever the pool's blocks last held (a test that ran speculation on the
    same model before left them unequal)."""
    kv, out = cache.kv, []
    for i in (i for i in kv.layers if i < trunk_layers):
        rows = cache.read_rows(cache.pos, kv.k[i].device)
        for table in (kv.k[i], kv.v[i]):
            out.append(table.view(table.shape[0] * BLOCK_SIZE, -1)[rows].cpu())
    if cache.rec is not None:
        for i in cache.rec.layers:
            out += [cache.conv_state(i).cpu(), cache.ssm_state(i).cpu()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def arrangements(n: int) -> list[list[int]]:
    """Which prompts share a prime_batch call: all in order, all reversed, then consecutive pairs."""
    pairs = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    return [list(range(n)), list(reversed(range(n)))] + pairs


def run_prime_batch_arm(model, prompts: list[list[int]], ctx: int, canary: bool, led, split: bool = False) -> bool:
    """The arm on `model` (a pipeline view when `split`). -> whether it ran (False: skipped, not live)."""
    if not step.batching_prime(model, model.settings.exact):
        led.out(f"{ARM} skipped: prime batching is not live here (the exact path without the batch-invariant "
                "kernels primes each prompt alone, exact by construction)")
        return False
    ref_logits, ref_bits = [], []
    for p in prompts:
        c = model.new_cache(ctx)
        ref_logits.append(model.prime(p, c).cpu())
        ref_bits.append(cache_bits(c, model.cfg.n_layers))
        c.free()
    before = counters.snapshot()
    for a, order in enumerate(arrangements(len(prompts))):
        fed = [list(prompts[i]) for i in order]
        if canary and a == 0:
            fed[0][-1] = (fed[0][-1] + 1) % model.cfg.vocab_size
        caches = [model.new_cache(ctx) for _ in order]
        logits = model.prime_batch(fed, caches)
        for i, row, c in zip(order, logits, caches):
            if not torch.equal(row.cpu(), ref_logits[i]):
                led.fail(ARM, f"arrangement {order}: prompt {i}'s logits BIT-DIFF vs primed alone "
                              f"(maxdiff {(row.cpu() - ref_logits[i]).abs().max().item():.3e})")
            elif not _same(cache_bits(c, model.cfg.n_layers), ref_bits[i]):
                led.fail(ARM, f"arrangement {order}: prompt {i}'s cache BIT-DIFF vs primed alone")
            c.free()
    live = counters.delta(before)
    names = ("prime_batches", "prime_batch_splits") if split else ("prime_batches",)
    for name in names:
        if live[name] <= 0:
            led.fail("liveness", f"{ARM}: {name} did not advance")
    led.verdict(ARM, f"{len(prompts)} prompts primed together, reversed and in pairs == each alone, logits and cache "
                     f"bit-checked; " + ", ".join(f"{k} +{live[k]}" for k in names))
    return True
