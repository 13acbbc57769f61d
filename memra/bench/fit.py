"""How many layers of a real shape `memra bench model` can build on this device: the shape's own count
when its weights, the widest decode cell's caches, one long prompt's cache and a reserve fit in free
memory; else the most that fit — so a big shape on a small device still gives numbers (for the reduced
model, and the report says so) instead of an out-of-memory failure.
"""

from __future__ import annotations

import math

import torch

from memra.bench.config import GIB, BenchConfig
from memra.bench.roofline import cache_bytes
from memra.config import ModelConfig
from memra.errors import MemraError
from memra.random_model import SHAPES, canonical_shapes


def _shape_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes random_model allocates for a config (MTP included): fp32 norms/gates, the rest in dtype."""
    from memra.config import FP32_WEIGHTS

    item = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) * (4 if k.rsplit(".", 1)[-1] in FP32_WEIGHTS else item)
               for k, s in canonical_shapes(cfg).items())


RESERVE_BYTES = 8 * GIB  # activations, HF's caches, allocator slack — kept free beyond weights and memra's caches


def fit_layers(name: str, requested: int | None, cfg: BenchConfig, free_bytes: int) -> tuple[int, str | None]:
    """The layer count to build `name` with: the requested one, or the shape's own if it fits in
    free_bytes with the largest batch's caches and a reserve; else the most layers that fit (a multiple
    of 4 for hybrids, keeping their 3 GDN : 1 attention pattern) and a note saying so."""
    full = requested or SHAPES[name]().n_layers
    dtype, decode_ctx = cfg.dtype, cfg.prompt_tokens + cfg.warmup + cfg.decode_steps + 1
    long_ctx = max(cfg.prefill_chunk, cfg.ttft_tokens + 1)

    def need(n: int) -> int:  # weights + the widest decode cell's caches + one long prompt's cache + reserve
        shape = SHAPES[name](n)
        return (_shape_bytes(shape, dtype) + max(cfg.batches) * cache_bytes(shape, dtype, decode_ctx)
                + cache_bytes(shape, dtype, long_ctx) + RESERVE_BYTES)

    if requested is not None or need(full) <= free_bytes:
        return full, None
    step = 4 if "gdn" in SHAPES[name]().mixers else 1
    fits = [n for n in range(step, full, step) if need(n) <= free_bytes]
    if not fits:
        raise MemraError(f"{name}: not even {step} layer(s) fit in {free_bytes / 1e9:.1f} GB free")
    return fits[-1], (f"built with {fits[-1]} of {full} layers: the full model needs ~{need(full) / 1e9:.0f} GB "
                      f"(weights, caches, reserve) and {free_bytes / 1e9:.0f} GB are free; "
                      f"every number and roofline here is for the reduced model")
