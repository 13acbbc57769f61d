"""A byte-level tokenizer of any vocabulary size, for random-weight models of real shapes.

`memra serve random:llama-3-8b` must be measurable at real size with no download, so the model needs a
tokenizer whose ids cover its whole vocabulary (a random model samples any of them). Here: ids 0..255
are the 256 bytes, spelled in GPT-2's byte-level alphabet, and every later id is a distinct run of two
or three bytes, so decoding any id gives real (if meaningless) text. There are no merges: encoding
yields one token per byte, which is all a load test needs. No end-of-text token: a random model runs
each request to its max_tokens, which is what a throughput measurement wants.
"""

from __future__ import annotations

from itertools import product

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from memra.errors import MemraError
from memra.tokenizer.core import Tokenizer
from memra.tokenizer.pieces import _BYTE_OF_CHAR, ByteLevelPieces, TokenizerParts

_MAX_VOCAB = 256 + 256**2 + 256**3


def byte_level_tokenizer(vocab_size: int, source: str = "synthetic") -> Tokenizer:
    if not 256 <= vocab_size <= _MAX_VOCAB:
        raise MemraError(f"a synthetic byte-level vocabulary needs 256..{_MAX_VOCAB} tokens, got {vocab_size}")
    char_of = {b: c for c, b in _BYTE_OF_CHAR.items()}
    alphabet = [char_of[b] for b in range(256)]
    spellings = list(alphabet)
    for width in (2, 3):
        for chars in product(alphabet, repeat=width):
            if len(spellings) == vocab_size:
                break
            spellings.append("".join(chars))
    backend = Backend(models.BPE(vocab={s: i for i, s in enumerate(spellings)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(TokenizerParts(
        backend=backend, pieces=ByteLevelPieces(spellings.__getitem__, {}), vocab_size=vocab_size,
        special_ids=frozenset(), bos_id=None, eos_ids=(), add_bos=False, strip_leading_space=False,
        chat_template=None, template_origin="", kind="synthetic byte-level", source=source))
