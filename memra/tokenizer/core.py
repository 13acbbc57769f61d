"""`Tokenizer`: text <-> token ids and chat prompts for one model.

Splitting text and running BPE is done by the HuggingFace `tokenizers` library; this class adds what
an inference engine needs on top of it: the exact bytes of every token (memra.tokenizer.pieces), the
ids that end generation, and chat templates rendered as HF renders them. Built from a `TokenizerParts`,
which `from_hf_dir` (memra.tokenizer.hf_files) and `from_gguf` (memra.tokenizer.gguf_vocab) each make.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import Tokenizer as Backend

from memra.errors import TokenizerError
from memra.tokenizer.gguf_vocab import parts_from_gguf
from memra.tokenizer.hf_files import _hf_parts
from memra.tokenizer.pieces import TokenizerParts

if TYPE_CHECKING:
    import gguf
    import jinja2


class Tokenizer:
    """Encode, decode and format chats for one model. Build it with `from_hf_dir` or `from_gguf`."""

    def __init__(self, parts: TokenizerParts):
        self._parts = parts
        self._backend = parts.backend
        self.vocab_size: int = parts.vocab_size
        self.bos_id: int | None = parts.bos_id
        self.eos_ids: tuple[int, ...] = tuple(parts.eos_ids)
        self.add_bos: bool = parts.add_bos
        self.chat_template: str | None = parts.chat_template
        self._piece_cache: dict[int, bytes] = {}
        self._plain_backend: Backend | None = None  # the copy that reads control tokens as text
        self._max_piece_chars: int | None = None

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From a HF model directory: tokenizer.json, plus tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json where present."""
        return cls(_hf_parts(Path(path)))

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader | str | Path", source: str = "") -> "Tokenizer":
        """From the tokenizer.* metadata of a GGUF file (see memra.tokenizer.gguf_vocab): an open
        gguf.GGUFReader, or the file's path, which is read ~30x faster than GGUFReader parses it."""
        return cls(parts_from_gguf(reader, source))

    # --- encoding ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids for `text`.

        add_special: prepend bos when the model expects it (`add_bos`); nothing else is added.
        parse_special: match control tokens such as <|im_start|> written in the text as single tokens
            (what a rendered chat template needs). With False they are tokenized as plain text, as
            llama.cpp does for untrusted input; user-defined tokens are matched either way.

        Thread-safe, and it releases the GIL while the Rust side works: `encode_batch_fast` does (plain
        `encode` holds it throughout: 5 s for a 4 MB text, during which no other thread of the process
        runs), and it skips the character offsets nobody here reads. Same ids as `encode`.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode: text must be a str, got {type(text).__name__}")
        backend = self._backend if parse_special else self._plain()
        try:
            ids = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        except TypeError:
            raise TokenizerError(_not_unicode(text)) from None
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def _plain(self) -> Backend:
        """A second backend with `encode_special_tokens` set, built once: flipping the flag on the
        shared one per call would need a lock around every encode."""
        if self._plain_backend is None:
            plain = Backend.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    @property
    def max_piece_chars(self) -> int:
        """The most characters one token decodes to (at least 1), over the whole vocabulary. A text of
        more than n * max_piece_chars characters cannot be n tokens or fewer, whatever the merges;
        the server refuses such a prompt before spending time on tokenizing it."""
        if self._max_piece_chars is None:
            longest = max((len(self._parts.pieces(i)) for i in range(self.vocab_size)), default=1)
            self._max_piece_chars = max(longest, 1)  # bytes >= characters, so the bound holds in characters
        return self._max_piece_chars

    # --- decoding ---------------------------------------------------------------------------------

    def is_special(self, token_id: int) -> bool:
        """Control-type tokens (bos, <|im_end|>, ...), which decode(skip_special=True) leaves out."""
        return self._check_id(token_id) in self._parts.special_ids

    def token_to_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token. May be part of a UTF-8 character; special tokens give their text."""
        return self._piece(self._check_id(token_id))

    def _piece(self, index: int) -> bytes:
        """token_to_piece for an id already checked by _check_id, cached: decoding is per token."""
        piece = self._piece_cache.get(index)
        if piece is None:
            piece = self._piece_cache[index] = self._parts.pieces(index)
        return piece

    def _check_id(self, token_id: Any) -> int:
        """`token_id` as a Python int (numpy and torch integers accepted), or TokenizerError."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token ids must be integers, got {type(token_id).__name__} {token_id!r}") from None
        if not 0 <= index < self.vocab_size:
            raise TokenizerError(
                f"token id {index} is outside this vocabulary (0..{self.vocab_size - 1}); the ids come from "
                "a different model, or the model's embedding has more rows than its tokenizer has tokens"
            )
        return index

    def _stream_piece(self, token_id: int, skip_special: bool, at_start: bool) -> bytes | None:
        """The bytes `token_id` contributes to decoded text, or None when it is skipped.

        SentencePiece vocabularies spell "Hello" at the start of a text as "▁Hello" because encode
        prepends a space; the first piece gives that space back. Shared by decode and the incremental
        detokenizer so the two agree byte for byte.
        """
        index = self._check_id(token_id)  # also turns numpy / torch integers into int
        special = index in self._parts.special_ids
        if special and skip_special:
            return None
        piece = self._piece(index)
        if at_start and not special and self._parts.strip_leading_space and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 (e.g. a cut-off character at the end) becomes U+FFFD."""
        out = bytearray()
        at_start = True
        for token_id in ids:
            piece = self._stream_piece(token_id, skip_special, at_start)
            if piece is not None:
                out += piece
                at_start = False
        return out.decode("utf-8", errors="replace")

    # --- chat templates ---------------------------------------------------------------------------

    def _template(self) -> jinja2.Template:
        # jinja2 and the template helpers are imported here, on the first chat prompt, not with the tokenizer:
        # loading a model renders no template, and the import held ~2 MiB of a small CPU model's peak RSS
        import jinja2

        from memra.tokenizer.chat_template import _compile_template

        origin = self._parts.template_origin
        if self.chat_template is None:
            raise TokenizerError(
                f"{self._parts.source or 'this tokenizer'} has no chat template "
                "(looked for chat_template.jinja, 'chat_template' in tokenizer_config.json, chat_template.json, "
                "or GGUF key tokenizer.chat_template). Add a chat_template.jinja file next to tokenizer.json, "
                "or send raw text to encode() instead of messages"
            )
        try:
            return _compile_template(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(
                f"chat template from {origin} has a syntax error at line {e.lineno}: {e.message}. "
                "Fix the template (it is jinja2) or replace it with the one from the original model"
            ) from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on.

        messages: [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]
        add_generation_prompt: end with the header that opens the assistant's turn.
        kwargs: passed to the template as variables (tools=[...], enable_thinking=False, ...).
        Encode the result with `encode(text, add_special=False)`: the template writes bos itself when needed.
        """
        import jinja2

        from memra.tokenizer.chat_template import _clean_messages

        template = self._template()
        context = {
            **self._parts.special_strings,
            "tools": None,       # HF always defines these two, and templates test `tools is none`
            "documents": None,
            **kwargs,
            "messages": _clean_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except jinja2.TemplateError as e:
            raise TokenizerError(
                f"chat template from {self._parts.template_origin} rejected the conversation: {e}"
            ) from None
        except Exception as e:  # a template indexing a message that lacks a key, comparing str with None, ...
            raise TokenizerError(
                f"chat template from {self._parts.template_origin} failed on this conversation "
                f"({type(e).__name__}: {e}); check the messages' roles and contents"
            ) from None

    # --- description ------------------------------------------------------------------------------

    def _describe(self, token_id: int) -> str:
        return f"{self._backend.id_to_token(token_id)} ({token_id})"

    def summary(self) -> str:
        """One paragraph for `memra inspect`."""
        p = self._parts
        if self.bos_id is None:
            bos = "no bos token"
        else:
            bos = f"bos {self._describe(self.bos_id)} {'prepended' if self.add_bos else 'not prepended'} by encode"
        eos = ("ends generation on " + ", ".join(self._describe(i) for i in self.eos_ids)
               if self.eos_ids else "no end-of-generation token")
        if self.chat_template is None:
            template = "no chat template"
        else:
            template = f"chat template of {len(self.chat_template):,} chars from {p.template_origin}"
            try:
                self._template()
            except TokenizerError:
                template += " (it has a syntax error)"
        return (f"{p.kind} tokenizer from {p.source}: {self.vocab_size:,} tokens, {len(p.special_ids)} special; "
                f"{bos}; {eos}; {template}.")

    def __repr__(self) -> str:
        return f"Tokenizer({self._parts.kind}, {self.vocab_size} tokens, from {self._parts.source})"


def _not_unicode(text: str) -> str:
    """Why the tokenizer refused a str: Python strs may hold lone surrogates (JSON's "\\ud800"), which
    are not Unicode text and have no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}; "
                "send UTF-8 text (surrogate pairs must come in pairs)")
    return "the tokenizer refused the text"
