"""Text <-> token ids, streaming detokenization, and chat templates.

One `Tokenizer` class serves both checkpoint formats. Splitting text and running BPE is done by the
HuggingFace `tokenizers` library; this module adds what an inference engine needs on top of it:

* the exact bytes of every token (`token_to_piece`), so that streamed output can hold back half a
  UTF-8 character instead of printing U+FFFD (`IncrementalDetokenizer`);
* the ids that end generation, gathered from every place a checkpoint declares them;
* chat templates rendered the way HF transformers renders them (sandboxed jinja2 with the same
  options and helpers), so a prompt is byte-identical to the one the model was trained on.

`Tokenizer.from_hf_dir` reads tokenizer.json and its side files; `Tokenizer.from_gguf` hands the GGUF
metadata to `memra.loading.gguf_vocab`, which rebuilds an equivalent `tokenizers` pipeline. Both
produce a `TokenizerParts`, the one thing the `Tokenizer` constructor takes.
"""

from __future__ import annotations

import codecs
import functools
import json
import operator
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from memra.errors import TokenizerError

if TYPE_CHECKING:
    import gguf

# Tokens that close a chat turn in common chat formats. A model that emits one is done answering, even
# where its config names a different eos (Qwen's GGUF declares <|endoftext|>; its turns end with <|im_end|>).
END_OF_TURN_TEXTS: tuple[str, ...] = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
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


# ---------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------

class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: HF templates mark the assistant's text with it to build
    training masks. For inference the block just renders its body; without this the template would not
    even parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Templates call raise_exception('...') to reject a conversation they cannot format."""
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Templates that print today's date (Llama 3.x) call strftime_now('%d %b %Y')."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps. jinja2's own would HTML-escape '<' and '&', changing the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment HF transformers renders chat templates in. Templates come from model downloads,
    so they run sandboxed; trim_blocks/lstrip_blocks change whitespace, so they must match exactly."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile_template(text: str) -> jinja2.Template:
    return _template_environment().from_string(text)


def _clean_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and drop None-valued keys, as HF does: OpenAI-style clients send
    `"content": None` on tool calls, which templates treat differently from a missing key."""
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"apply_chat_template: messages must be a list of dicts, got {type(messages).__name__}")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TokenizerError(
                f"apply_chat_template: message {i} must be a dict with a 'role' (and usually 'content'), "
                f"got {message!r}"
            )
        cleaned.append({k: v for k, v in message.items() if v is not None})
    return cleaned


# ---------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------

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
        # encode(parse_special=False) flips a flag on the shared backend; the lock keeps that atomic.
        self._encode_lock = threading.Lock()

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From a HF model directory: tokenizer.json, plus tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json where present."""
        return cls(_hf_parts(Path(path)))

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader | str | Path", source: str = "") -> "Tokenizer":
        """From the tokenizer.* metadata of a GGUF file (see memra.loading.gguf_vocab): an open
        gguf.GGUFReader, or the file's path, which is read ~30x faster than GGUFReader parses it."""
        from memra.loading.gguf_vocab import parts_from_gguf  # imports this module; load it lazily

        return cls(parts_from_gguf(reader, source))

    # --- encoding ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids for `text`.

        add_special: prepend bos when the model expects it (`add_bos`); nothing else is added.
        parse_special: match control tokens such as <|im_start|> written in the text as single tokens
            (what a rendered chat template needs). With False they are tokenized as plain text, as
            llama.cpp does for untrusted input; user-defined tokens are matched either way.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode: text must be a str, got {type(text).__name__}")
        with self._encode_lock:
            self._backend.encode_special_tokens = not parse_special
            try:
                ids = self._backend.encode(text, add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = False
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

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


class IncrementalDetokenizer:
    """Turn a stream of token ids into text as it arrives.

    One token may carry only part of a character (byte-level BPE splits emoji and CJK across tokens), so
    `push` returns only whole characters and holds back an incomplete tail until the next token completes
    it. Concatenating every `push` and the final `flush` gives exactly `tok.decode(ids, skip_special)`.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = True):
        self._tok = tok
        self._skip_special = skip_special
        # Python's incremental UTF-8 decoder does exactly the holding back we need, and its 'replace'
        # output matches one-shot decoding of the same bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def push(self, token_id: int) -> str:
        """The text completed by this token (possibly empty)."""
        piece = self._tok._stream_piece(token_id, self._skip_special, self._at_start)
        if piece is None:
            return ""
        self._at_start = False
        return self._utf8.decode(piece, final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, with U+FFFD for bytes that never completed."""
        return self._utf8.decode(b"", final=True)


class StopStringFilter:
    """Streams text but holds back any tail that could still grow into a stop string; on a match,
    emits the text before it and stops (the stop string itself is not printed, as in OpenAI's API)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---------------------------------------------------------------------------------------------------
# Loading a HF directory
# ---------------------------------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{path}: not UTF-8 text; the file is corrupt, download it again") from None


def _read_json(path: Path, text: str | None = None) -> Any:
    """A JSON file (or its already-read `text`), or TokenizerError naming the file and what is wrong."""
    try:
        return json.loads(_read_text(path) if text is None else text)
    except json.JSONDecodeError as e:
        raise TokenizerError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            "the file is corrupt or truncated, download it again"
        ) from None


def _read_json_object(path: Path) -> dict[str, Any]:
    """An optional JSON object file: {} when absent."""
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_string(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_ids(value: Any) -> list[int]:
    """An `eos_token_id` entry: an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _load_backend(path: Path) -> tuple[Backend, dict[str, Any]]:
    """tokenizer.json as a `tokenizers` object and as parsed JSON (we inspect its decoder)."""
    if not path.is_file():
        hint = ""
        if (path.parent / "tokenizer.model").is_file():
            hint = (" (there is a SentencePiece tokenizer.model; convert it with transformers: "
                    "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes tokenizer.json)")
        raise TokenizerError(
            f"{path} not found{hint}; copy tokenizer.json from the original model repository into {path.parent}"
        )
    text = _read_text(path)
    spec = _read_json(path, text)
    if not isinstance(spec, dict) or "model" not in spec:
        raise TokenizerError(f"{path}: not a tokenizers file (no 'model' section); download tokenizer.json again")
    try:
        backend = Backend.from_str(text)
    except Exception as e:  # the Rust side names what it cannot parse
        raise TokenizerError(f"{path}: the tokenizers library cannot load it ({e}); download it again or "
                             "upgrade the tokenizers package") from None
    return backend, spec


def _component_types(node: Any) -> list[dict[str, Any]]:
    """A tokenizer.json decoder and, for a Sequence, the decoders inside it, flattened."""
    if not isinstance(node, dict):
        return []
    found = [node]
    for child in node.get("decoders") or []:
        found += _component_types(child)
    return found


def _hf_pieces(spec: dict[str, Any], backend: Backend,
               verbatim: Mapping[int, str]) -> tuple[Callable[[int], bytes], bool, str]:
    """How to get a token's bytes from this tokenizer.json: (pieces, strip_leading_space, kind)."""
    decoders = _component_types(spec.get("decoder"))
    types = {d.get("type") for d in decoders}
    model = str(spec["model"].get("type", "unknown model"))
    if "ByteLevel" in types:
        return ByteLevelPieces(backend.id_to_token, verbatim), False, f"byte-level {model}"
    if "Metaspace" in types or "ByteFallback" in types:
        # The space SentencePiece prepends is dropped on decode by a Strip decoder, or by Metaspace itself.
        strip = any(
            (d.get("type") == "Strip" and d.get("content") == " " and d.get("start", 0) >= 1)
            or (d.get("type") == "Metaspace"
                and (d.get("prepend_scheme") in ("always", "first") or d.get("add_prefix_space") is True))
            for d in decoders
        )
        return SentencePiecePieces(backend.id_to_token, verbatim), strip, f"SentencePiece-style {model}"
    return DecoderPieces(backend), False, model


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    """The chat template and where it came from, in HF's order of precedence."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file}: cannot read the chat template ({e})") from None
    value = config.get("chat_template")
    if isinstance(value, list):  # several named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    if isinstance(value, str) and value:
        return value, f"{directory / 'tokenizer_config.json'} (key 'chat_template')"
    json_file = directory / "chat_template.json"  # multimodal processors keep it here
    value = _read_json_object(json_file).get("chat_template")
    if isinstance(value, str) and value:
        return value, f"{json_file} (key 'chat_template')"
    return None, ""


def _hf_eos_ids(directory: Path, config: Mapping[str, Any], backend: Backend, template: str | None) -> tuple[int, ...]:
    """tokenizer_config's eos_token, then the eos_token_id of generation_config.json and config.json
    (an int or a list; multimodal configs nest it in text_config), then the turn-end tokens the chat
    template writes."""
    ids: list[int | None] = []
    if eos_text := _token_string(config.get("eos_token")):
        ids.append(backend.token_to_id(eos_text))
    for name in ("generation_config.json", "config.json"):
        data = _read_json_object(directory / name)
        ids += _int_ids(data.get("eos_token_id"))
        if isinstance(data.get("text_config"), dict):
            ids += _int_ids(data["text_config"].get("eos_token_id"))
    if template:
        ids += [backend.token_to_id(text) for text in END_OF_TURN_TEXTS if text in template]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _hf_parts(directory: Path) -> TokenizerParts:
    if not directory.is_dir():
        raise TokenizerError(f"{directory}: not a directory; pass the model directory that holds tokenizer.json")
    backend, spec = _load_backend(directory / "tokenizer.json")
    config = _read_json_object(directory / "tokenizer_config.json")

    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    verbatim = {i: t.content for i, t in added.items()}
    pieces, strip_leading_space, kind = _hf_pieces(spec, backend, verbatim)

    special_strings = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                       if (s := _token_string(config.get(k)))}
    bos_text = special_strings.get("bos_token")
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # No explicit setting: did tokenizer.json's post-processor put bos in front?
        add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    template, origin = _hf_chat_template(directory, config)

    return TokenizerParts(
        backend=backend,
        pieces=pieces,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        special_ids=frozenset(i for i, t in added.items() if t.special),
        bos_id=bos_id,
        eos_ids=_hf_eos_ids(directory, config, backend, template),
        add_bos=add_bos and bos_id is not None,
        strip_leading_space=strip_leading_space,
        chat_template=template,
        template_origin=origin,
        special_strings=special_strings,
        kind=kind,
        source=str(directory),
    )
