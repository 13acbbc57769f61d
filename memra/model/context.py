"""The per-step facts every layer needs, passed explicitly (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra.cache import Cache, StateTrail


@dataclass(frozen=True)
class StepContext:
    cache: Cache
    pos0: int  # position of the first token of this step
    n_tokens: int  # T
    cos: torch.Tensor  # [T, R] rotary tables for positions pos0..pos0+T-1, model dtype
    sin: torch.Tensor
    recurrent: bool  # GDN mode: True = token-by-token recurrence (generated tokens), False = chunked (prompt)
    kv_write_rows: torch.Tensor  # [T] flat KV-pool rows (block * BLOCK_SIZE + offset) the new tokens go to
    kv_read_rows: torch.Tensor  # [pos0 + T] flat rows of the whole prefix, in position order
    trail: StateTrail | None = None  # verify: record each token's recurrent state here (rollback)
    column: int = 0  # verify: which of the T columns this (T=1) context's token is
