"""The bytes of every token, and the parts a `Tokenizer` is made of.

Streamed output must hold back half a UTF-8 character instead of printing U+FFFD, so the engine needs
each token's exact bytes, which the `tokenizers` library does not expose; they are recovered here from
the vocabulary's own spelling (byte-level BPE's printable alphabet, SentencePiece's '▁' and <0xNN>).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from tokenizers import Tokenizer as Backend

# Tokens that close a chat turn in common chat formats. A model that emits one is done answering, even
# where its config names a different eos (Qwen's GGUF declares <|endoftext|>; its turns end with <|im_end|>).
END_OF_TURN_TEXTS: tuple[str, ...] = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "<turn|>",  # Gemma 4 ends a turn with <turn|>; its eos is <eos>
)


# ---------------------------------------------------------------------------------------------------
# Token bytes
# ---------------------------------------------------------------------------------------------------

def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each of the 256 byte values as one printable character: bytes that
    are printable Latin-1 stand for themselves, the other 68 are moved up to U+0100 and beyond (so a
    space, byte 0x20, is written 'Ġ' = U+0120). Returns character -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    char_to_byte = {chr(b): b for b in printable}
    next_free = 256
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(next_free)] = b
            next_free += 1
    return char_to_byte


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens
_SPACE_MARK = "\u2581"  # SentencePiece's "▁"

TextOf = Callable[[int], "str | None"]  # token id -> its vocabulary string


class _VocabPieces:
    """Token bytes from the vocabulary's spelling. `verbatim` tokens (added / control tokens such as
    <|im_end|>) are stored as plain text, not in the vocabulary's encoding, and come out as their UTF-8."""

    def __init__(self, text_of: TextOf, verbatim: Mapping[int, str]):
        self._text_of, self._verbatim = text_of, verbatim

    def __call__(self, token_id: int) -> bytes:
        if token_id in self._verbatim:
            return self._verbatim[token_id].encode()
        return self._spell(self._text_of(token_id) or "")

    def _spell(self, text: str) -> bytes:
        raise TypeError("use ByteLevelPieces or SentencePiecePieces")


class ByteLevelPieces(_VocabPieces):
    """Token bytes for byte-level BPE (GPT-2, Llama 3, Qwen): map each character back to its byte."""

    def _spell(self, text: str) -> bytes:
        # A character outside the alphabet cannot come from the converter; keep it rather than fail.
        return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode() for c in text)


class SentencePiecePieces(_VocabPieces):
    """Token bytes for SentencePiece vocabularies: '▁' is a space, '<0xNN>' is the single byte NN."""

    def _spell(self, text: str) -> bytes:
        if match := _BYTE_TOKEN.fullmatch(text):
            return bytes([int(match[1], 16)])
        return text.replace(_SPACE_MARK, " ").encode()


class DecoderPieces:
    """Fallback for other tokenizer.json decoders (e.g. WordPiece): ask the backend, one token at a time.
    Exact for vocabularies whose tokens are whole characters, which is what such decoders assume."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def __call__(self, token_id: int) -> bytes:
        return self._backend.decode([token_id], skip_special_tokens=False).encode()


@dataclass(frozen=True)
class TokenizerParts:
    """Everything a `Tokenizer` is made of. The two loaders (HF directory, GGUF) each build one."""

    backend: Backend                 # splits text and runs BPE
    pieces: Callable[[int], bytes]   # token id -> its bytes (text for special tokens)
    vocab_size: int
    special_ids: frozenset[int]      # left out by decode(skip_special=True)
    bos_id: int | None
    eos_ids: tuple[int, ...]         # every id that ends generation, the declared eos first
    add_bos: bool                    # encode(add_special=True) prepends bos_id
    strip_leading_space: bool        # SentencePiece: decode drops the space that encode prepended
    chat_template: str | None
    template_origin: str             # where the template came from, for error messages
    special_strings: Mapping[str, str] = field(default_factory=dict)  # bos_token / eos_token ... for templates
    kind: str = ""                   # e.g. "byte-level BPE", for summary()
    source: str = ""                 # the file or directory, for summary() and errors
