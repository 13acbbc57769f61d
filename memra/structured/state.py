"""One sequence's place in its grammar, and the mask that place allows."""

from __future__ import annotations

import torch

from memra import counters

_BITS = torch.arange(8, dtype=torch.uint8)  # bit b of byte k is token 8k + b (llguidance's little-endian u32 words)


class GrammarState:
    """A sequence's matcher: `advance` feeds it the sequence's new tokens, `mask` says what may come next."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.consumed = 0  # output tokens already fed to the matcher

    def advance(self, out: list[int]) -> bool:
        """Feed the tokens of `out` not yet fed. -> whether the grammar is complete (its mask: EOS only)."""
        while self.consumed < len(out):
            self.matcher.consume_token(out[self.consumed])  # a refused token leaves it in error: is_stopped below
            self.consumed += 1
        return self.matcher.is_stopped() or self.matcher.is_error()

    def mask(self, width: int, device: torch.device) -> torch.Tensor:
        """[width] bool: the tokens the grammar allows next (ids past the tokenizer's vocabulary never)."""
        raw = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)  # [ceil(V/32)*4]
        allowed = ((raw[:, None] >> _BITS) & 1).bool().flatten()[: min(width, self.vocab)]
        if allowed.numel() < width:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.numel())])
        counters.bump("grammar_masked_rows")
        return allowed.to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar refuses at -inf (a new tensor)."""
        return logits.masked_fill(~self.mask(logits.shape[-1], logits.device), float("-inf"))
