"""Token ids to text as they arrive: whole characters only, and stop strings applied."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from memra.tokenizer.stops import StopStringFilter

if TYPE_CHECKING:
    from memra.tokenizer.core import Tokenizer


class IncrementalDetokenizer:
    """Turn a stream of token ids into text as it arrives.

    One token may carry only part of a character (byte-level BPE splits emoji and CJK across tokens), so
    `push` returns only whole characters and holds back an incomplete tail until the next token completes
    it. Concatenating every `push` and the final `flush` gives exactly `tok.decode(ids, skip_special)`.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = True, spaces_between_special: bool = False):
        self._tok = tok
        self._skip_special = skip_special
        # HF's (slow) decode with spaces_between_special_tokens: the runs of ordinary text and each kept
        # special token are joined with " ". Only where special tokens are kept (skip_special False).
        self._spaces = spaces_between_special and not skip_special
        self._after_special = False
        # Python's incremental UTF-8 decoder does exactly the holding back we need, and its 'replace'
        # output matches one-shot decoding of the same bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def push(self, token_id: int) -> str:
        """The text completed by this token (possibly empty)."""
        piece = self._tok._stream_piece(token_id, self._skip_special, self._at_start)
        if piece is None:
            return ""
        if self._spaces:
            special = self._tok.is_special(token_id)
            if not self._at_start and (special or self._after_special) and piece:
                piece = b" " + piece
            self._after_special = special
        self._at_start = False
        return self._utf8.decode(piece, final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, with U+FFFD for bytes that never completed."""
        return self._utf8.decode(b"", final=True)


class TextStream:
    """One sequence's generated tokens to the text its reader sees: whole characters (the detokenizer),
    cut before the first stop string (the filter). The concatenation of every `push` and `finish` is the
    decoded text up to the stop string, however the tokens were grouped."""

    def __init__(self, tok: "Tokenizer", stops: tuple[str, ...] = (), skip_special: bool = True,
                 include_stop: bool = False, spaces_between_special: bool = False, min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(tok, skip_special, spaces_between_special)
        self._stops = StopStringFilter(stops, include_stop)
        self._include_stop = include_stop
        self._min_tokens, self._tokens = min_tokens, 0  # stop strings count once past min_tokens (vLLM's rule)

    @classmethod
    def for_params(cls, tok: "Tokenizer", p) -> "TextStream":
        """The text of a request made with memra.SamplingParams `p` (its stops and vLLM's text options)."""
        return cls(tok, p.stop, p.skip_special_tokens, p.include_stop_str_in_output, p.spaces_between_special_tokens,
                   p.min_tokens)

    @property
    def stopped(self) -> bool:
        """A stop string has appeared: nothing more will be released."""
        return self._stops.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, once `stopped` (vLLM's CompletionOutput.stop_reason)."""
        return self._stops.matched

    def push(self, token_id: int, stop_token: bool = False) -> str:
        """The text released by this token. stop_token: it is the EOS / stop token that ends the sequence,
        whose text is left out (as vLLM does) unless the stop is to be included."""
        self._tokens += 1
        if stop_token and not self._include_stop:
            return ""
        return self._stops.push(self._detok.push(token_id), armed=self._tokens > self._min_tokens)

    def finish(self) -> str:
        """At the end of the stream (EOS, length, abort): the held-back text, unless a stop string ended it."""
        if self.stopped:
            return ""
        return self._stops.push(self._detok.flush(), armed=self._tokens > self._min_tokens) + self._stops.flush()
