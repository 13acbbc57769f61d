"""Rebuild a tokenizer from the vocabulary a GGUF file carries in its `tokenizer.*` metadata.

A GGUF file stores no tokenizer.json. llama.cpp's converter writes the pieces it needs instead:

    tokenizer.ggml.model       "gpt2" (byte-level BPE), "llama" (SentencePiece BPE) or "gemma4", among others
    tokenizer.ggml.pre         which pre-tokenizer regex the model was trained with (byte-level BPE only)
    tokenizer.ggml.tokens      the vocabulary, index = token id
    tokenizer.ggml.token_type  1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges      "left right" strings in priority order (byte-level BPE)
    tokenizer.ggml.scores      one float per token; higher merges first (SentencePiece)
    tokenizer.ggml.{bos,eos,eot,eom}_token_id, add_bos_token, add_space_prefix
    tokenizer.chat_template

From these we assemble an equivalent HuggingFace `tokenizers` pipeline (which does the actual splitting
and merging) and reproduce llama.cpp's choices where the file leaves something implicit: the regex for
each `pre` name (memra.loading.gguf_pretokenizers), which tokens are matched whole before BPE, the
default of `add_bos`, and which tokens end generation. The result must tokenize exactly as llama.cpp
does; llama.cpp's own test vectors (tests/fixtures/vocab) check that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from memra.errors import TokenizerError
# re-exported: callers read a file's tokenizer metadata through this module
from memra.tokenizer.gguf_metadata import read_tokenizer_metadata, read_tokenizer_metadata_file  # noqa: F401
from memra.loading.gguf_pretokenizers import PreTokenizerRule, _pre_tokenizer, pre_tokenizer_rule
# The pieces module, not the package root: the root imports core, which builds GGUF tokenizers from here.
from memra.tokenizer.pieces import (
    END_OF_TURN_TEXTS,
    ByteLevelPieces,
    SentencePiecePieces,
    TokenizerParts,
)

if TYPE_CHECKING:
    import gguf

# Token types, as llama.cpp's converter writes them into tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control and unknown tokens are "special": they are matched whole only when the caller asks to parse
# special tokens, and decode(skip_special=True) drops them. User-defined tokens are always matched
# whole (they are ordinary text the model author wanted as single tokens, e.g. "<think>").
_SPECIAL_TYPES = (UNKNOWN, CONTROL)
_WHOLE_MATCH_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)

_SPACE_MARK = "\u2581"  # SentencePiece's visible stand-in for a space ("▁")


# ---------------------------------------------------------------------------------------------------
# The vocabulary as read from the file
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer metadata of one GGUF file, checked and in plain Python types."""

    source: str
    model: str                 # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    meta: Mapping[str, Any]

    def token_id(self, key: str) -> int | None:
        """A `tokenizer.ggml.*_token_id` value, or None when absent or outside the vocabulary."""
        value = self.meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(self.tokens):
            return None
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.meta.get(key)
        return value if isinstance(value, bool) else default

    def ids_of_type(self, *kinds: int) -> list[int]:
        return [i for i, t in enumerate(self.types) if t in kinds]


def _string_list(meta: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TokenizerError(f"{source}: GGUF key {key} must be an array of strings, found {type(value).__name__}")
    return value


def load_vocab(meta: Mapping[str, Any], source: str) -> GgufVocab:
    """Check the keys every tokenizer needs and return them typed."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(
            f"{source}: this GGUF file has no tokenizer metadata (key tokenizer.ggml.model is missing). "
            "Use a GGUF converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py embeds it), "
            "or load the tokenizer from the model's HF directory"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(
            f"{source}: GGUF key tokenizer.ggml.tokens (the vocabulary) is missing; reconvert the model"
        )
    tokens = _string_list(meta, "tokenizer.ggml.tokens", source)
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = [NORMAL] * len(tokens)
    elif (not isinstance(types, list) or len(types) < len(tokens)
          or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise TokenizerError(
            f"{source}: GGUF key tokenizer.ggml.token_type must hold an integer per token; it has "
            f"{len(types) if isinstance(types, list) else 'no'} entries for {len(tokens)} tokens; the file is corrupt "
            "or was converted by a broken tool"
        )
    return GgufVocab(source=source, model=str(model), tokens=tokens, types=[int(t) for t in types[: len(tokens)]],
                     meta=meta)


# ---------------------------------------------------------------------------------------------------
# The two model kinds
# ---------------------------------------------------------------------------------------------------

def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    """token text -> id. A text listed twice keeps its first id (llama.cpp refuses such files; we only
    need one id to encode to, and decoding reads the list directly)."""
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    return vocab


def _bpe_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges: "left right" strings, highest priority first."""
    merges = []
    for entry in _string_list(vocab.meta, "tokenizer.ggml.merges", vocab.source):
        # The separator is the first space after the first character: a left part may itself be a space.
        cut = entry.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"{vocab.source}: malformed entry {entry!r} in tokenizer.ggml.merges (no space)")
        merges.append((entry[:cut], entry[cut + 1:]))
    return merges


def _byte_level_backend(vocab: GgufVocab, rule: PreTokenizerRule) -> Backend:
    if "tokenizer.ggml.merges" not in vocab.meta:
        raise TokenizerError(f"{vocab.source}: GGUF key tokenizer.ggml.merges is missing; byte-level BPE needs it")
    model = models.BPE(vocab=_vocab_dict(vocab.tokens), merges=_bpe_merges(vocab),
                       ignore_merges=rule.ignore_merges)
    backend = Backend(model)
    backend.pre_tokenizer = _pre_tokenizer(rule)
    backend.decoder = decoders.ByteLevel()
    return backend


def _scores(vocab: GgufVocab) -> list[float]:
    scores = vocab.meta.get("tokenizer.ggml.scores")
    if (not isinstance(scores, list) or len(scores) < len(vocab.tokens)
            or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)):
        raise TokenizerError(
            f"{vocab.source}: GGUF key tokenizer.ggml.scores is missing, shorter than the vocabulary or holds a "
            "non-number; a SentencePiece ('llama') vocabulary needs one finite score per token"
        )
    return [float(s) for s in scores]


def merges_from_scores(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merge rules.

    SentencePiece (and llama.cpp's SPM tokenizer) repeatedly joins the adjacent pair whose concatenation
    is the vocabulary entry with the highest score. Listing, for every normal token in order of falling
    score, each way of writing it as two vocabulary entries gives a merge table in which the BPE rule
    "apply the highest-priority applicable merge" picks that same pair. Ties between equal scores go to
    the lower id, a stable choice for the rare tokens that share a score.
    """
    vocab = set(tokens)
    order = sorted((i for i, t in enumerate(types) if t == NORMAL), key=lambda i: (-scores[i], i))
    merges = []
    for i in order:
        text = tokens[i]
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _sentencepiece_backend(vocab: GgufVocab) -> Backend:
    unk_id = vocab.token_id("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=_vocab_dict(vocab.tokens),
        merges=merges_from_scores(vocab.tokens, vocab.types, _scores(vocab)),
        unk_token=vocab.tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
    )
    backend = Backend(model)
    # Spaces are spelled "▁". llama.cpp prepends one to every text fragment that starts the input or
    # follows a special token; the tokenizers normalizer runs once per such fragment, so Prepend matches.
    replace = normalizers.Replace(" ", _SPACE_MARK)
    if vocab.flag("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE_MARK), replace])
    else:
        backend.normalizer = replace
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _gemma4_backend(vocab: GgufVocab) -> Backend:
    """Gemma 4: BPE over raw UTF-8 (not the byte-level alphabet), with spaces spelled "▁" and no word
    splitting except at newlines; the merges are stored as for byte-level BPE, characters outside the
    vocabulary fall back to <0xNN> byte tokens, and no space is prepended (add_space_prefix is false)."""
    if "tokenizer.ggml.merges" not in vocab.meta:
        raise TokenizerError(f"{vocab.source}: GGUF key tokenizer.ggml.merges is missing; a gemma4 vocabulary needs it")
    model = models.BPE(vocab=_vocab_dict(vocab.tokens), merges=_bpe_merges(vocab), byte_fallback=True)
    backend = Backend(model)
    backend.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    # llama.cpp cuts only between newline runs and the rest (its BPE never merges across a newline).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _rstrip_specials(vocab: GgufVocab) -> set[int]:
    """Ids of whole-match tokens that swallow the whitespace after them.

    Phi-3's tokenizer.json marks its special tokens rstrip, so "<|user|>\\nHi" encodes without the
    newline. GGUF has no field for that; llama.cpp recognises the model by name, and so do we.
    """
    name = str(vocab.meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    ids = set(vocab.ids_of_type(*_WHOLE_MATCH_TYPES))
    ids |= {i for i, t in enumerate(vocab.tokens) if t == "</s>"}
    return ids - {i for i, t in enumerate(vocab.tokens) if t in ("<unk>", "<s>", "<|endoftext|>")}


def _add_whole_match_tokens(backend: Backend, vocab: GgufVocab) -> None:
    """Register control / unknown / user-defined tokens so they are cut out of the text before BPE.

    `special=True` marks the ones `Tokenizer.encode(parse_special=False)` must leave as plain text
    (llama.cpp: control and unknown); user-defined tokens are always matched.
    """
    rstrip = _rstrip_specials(vocab)
    added = [
        AddedToken(vocab.tokens[i], special=vocab.types[i] in _SPECIAL_TYPES, normalized=False,
                   rstrip=i in rstrip, lstrip=False, single_word=False)
        for i in vocab.ids_of_type(*_WHOLE_MATCH_TYPES)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])


# ---------------------------------------------------------------------------------------------------
# Special ids
# ---------------------------------------------------------------------------------------------------

def _end_of_generation_ids(vocab: GgufVocab) -> tuple[int, ...]:
    """eos, then eot and eom, then every token whose text llama.cpp treats as ending a turn.

    GGUF has no generation_config.json; llama.cpp fills the gap by recognising turn-end tokens by their
    text (e.g. a Qwen file declares eos <|endoftext|> but the chat ends turns with <|im_end|>).
    """
    ids = [vocab.token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [i for i, text in enumerate(vocab.tokens) if text in END_OF_TURN_TEXTS]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _bos(vocab: GgufVocab, default_id: int | None, add_default: bool) -> tuple[int | None, bool]:
    bos_key = "tokenizer.ggml.bos_token_id"
    bos_id = vocab.token_id(bos_key) if bos_key in vocab.meta else default_id
    add_bos = vocab.flag("tokenizer.ggml.add_bos_token", add_default)
    if add_bos and bos_id is None:
        raise TokenizerError(
            f"{vocab.source}: tokenizer.ggml.add_bos_token is true but {bos_key} is not set (or out of range); "
            "fix the file's metadata (e.g. with gguf's gguf_set_metadata.py)"
        )
    return bos_id, add_bos


# ---------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------

def build_parts(meta: Mapping[str, Any], source: str) -> TokenizerParts:
    """Everything `Tokenizer` needs, from GGUF tokenizer metadata."""
    vocab = load_vocab(meta, source)
    try:  # the `tokenizers` library raises a bare Exception for a vocabulary it cannot build
        return _build_parts(vocab, meta, source)
    except TokenizerError:
        raise
    except Exception as e:
        why = " ".join(str(e).split())
        raise TokenizerError(f"{source}: the vocabulary in tokenizer.ggml.* cannot be built ({why}); the file's "
                             "tokenizer metadata is corrupt: re-download or re-convert it") from None


def _build_parts(vocab: GgufVocab, meta: Mapping[str, Any], source: str) -> TokenizerParts:
    if vocab.model == "gpt2":
        rule = pre_tokenizer_rule(meta.get("tokenizer.ggml.pre"), source)
        backend = _byte_level_backend(vocab, rule)
        bos_id, add_bos = _bos(vocab, None, rule.add_bos)
        kind = f"byte-level BPE, pre-tokenizer {meta.get('tokenizer.ggml.pre') or 'default'!r}"
        strip_leading_space = False
        piece_kind: type[ByteLevelPieces | SentencePiecePieces] = ByteLevelPieces
    elif vocab.model == "llama":
        backend = _sentencepiece_backend(vocab)
        # SentencePiece convention when the file does not say: <s> = 1, prepended by default.
        bos_id, add_bos = _bos(vocab, 1 if len(vocab.tokens) > 1 else None, True)
        kind = "SentencePiece BPE"
        strip_leading_space = vocab.flag("tokenizer.ggml.add_space_prefix", True)
        piece_kind = SentencePiecePieces
    elif vocab.model == "gemma4":
        backend = _gemma4_backend(vocab)
        # llama.cpp always prepends <bos> for Gemma 4, whatever the file says.
        bos_id, add_bos = _bos(vocab, 2, True)
        add_bos = bos_id is not None
        kind = "Gemma 4 BPE"
        strip_leading_space = False
        piece_kind = SentencePiecePieces
    else:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model = {vocab.model!r} is not supported; memra reads 'gpt2' "
            "(byte-level BPE), 'llama' (SentencePiece BPE) and 'gemma4' vocabularies. "
            "Load the tokenizer from the model's HF directory (tokenizer.json) instead"
        )
    _add_whole_match_tokens(backend, vocab)

    # Whole-match tokens are plain text, not spelled in the byte alphabet / with "▁".
    verbatim = {i: vocab.tokens[i] for i in vocab.ids_of_type(*_WHOLE_MATCH_TYPES)}
    eos_ids = _end_of_generation_ids(vocab)
    eos_id = vocab.token_id("tokenizer.ggml.eos_token_id")
    template = meta.get("tokenizer.chat_template")
    return TokenizerParts(
        backend=backend,
        pieces=piece_kind(vocab.tokens.__getitem__, verbatim),
        vocab_size=len(vocab.tokens),
        special_ids=frozenset(vocab.ids_of_type(*_SPECIAL_TYPES)),
        bos_id=bos_id,
        eos_ids=eos_ids,
        add_bos=add_bos,
        strip_leading_space=strip_leading_space,
        chat_template=template if isinstance(template, str) and template else None,
        template_origin=f"{source} (GGUF key tokenizer.chat_template)",
        # Templates may write {{ bos_token }} / {{ eos_token }}; HF passes these strings too.
        special_strings={name: vocab.tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", eos_id))
                         if i is not None},
        kind=kind,
        source=f"GGUF {source}",
    )


def parts_from_gguf(reader: "gguf.GGUFReader | str | Path", source: str = "") -> TokenizerParts:
    """`build_parts` for an open `gguf.GGUFReader`, or for a GGUF file path (much faster to read)."""
    if isinstance(reader, (str, Path)):
        return build_parts(read_tokenizer_metadata_file(reader), source or str(reader))
    # The reader keeps its file only as a numpy memmap, which remembers the name.
    source = source or str(getattr(getattr(reader, "data", None), "filename", None) or "the GGUF file")
    return build_parts(read_tokenizer_metadata(reader, source), source)
