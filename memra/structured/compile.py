"""Grammars compiled once per constraint and tokenizer, on the caller's thread (never the engine's).

llguidance needs the vocabulary as bytes: memra's Tokenizer knows every token's exact bytes (the same
pieces the detokenizer writes), so the LLTokenizer is built from those, which serves HF and GGUF
vocabularies alike. Building it and compiling a grammar can take from microseconds to a second for a
large schema; both are cached (the LLTokenizer per Tokenizer, the grammar by StructuredOutputs.key).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

import llguidance as llg

from memra import counters
from memra.errors import MemraError
from memra.structured.params import StructuredOutputs
from memra.structured.state import GrammarState

CACHE_SIZE = 256  # grammars kept per tokenizer, least recently used dropped first
# JSON as OpenAI's structured outputs write it: no whitespace between tokens (a model that loves spaces
# could otherwise pad forever without ever closing the object); a schema's "x-guidance" may ask otherwise
JSON_DEFAULTS = {"whitespace_flexible": False}


class Grammar:
    """One compiled constraint: a matcher at its start, which each sequence copies."""

    def __init__(self, matcher: llg.LLMatcher, vocab: int):
        self._proto, self.vocab = matcher, vocab

    def start(self) -> GrammarState:
        return GrammarState(self._proto.deep_copy(), self.vocab)


class _Wrapped:
    """What llguidance.TokenizerWrapper reads: each id's bytes, the specials, and an encoder."""

    def __init__(self, tok):
        self.tokens = [tok.token_to_piece(i) for i in range(tok.vocab_size)]
        self.eos_token_id = tok.eos_ids[0] if tok.eos_ids else None
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, parse_special=False)


class _Compiler:
    def __init__(self, tok):
        self.tok = tok
        self.lock = threading.Lock()
        self.cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._ll: llg.LLTokenizer | None = None

    def ll(self) -> llg.LLTokenizer:
        if self._ll is None:
            eos = list(self.tok.eos_ids) or None
            self._ll = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(self.tok)), n_vocab=self.tok.vocab_size,
                                       eos_token=eos)
        return self._ll

    def compile(self, spec: StructuredOutputs) -> Grammar:
        with self.lock:
            hit = self.cache.get(spec.key)
            if hit is not None:
                self.cache.move_to_end(spec.key)
                return hit
            ll = self.ll()
        text = _grammar_text(spec)  # outside the lock: other requests' cache hits go on meanwhile
        problem = llg.LLMatcher.validate_grammar(text, ll)
        if problem:
            raise MemraError(f"{_name(spec)} was refused by the grammar compiler: {_one_line(problem)}")
        matcher = llg.LLMatcher(ll, text, log_level=0)
        if matcher.is_error():
            raise MemraError(f"{_name(spec)} was refused by the grammar compiler: {_one_line(matcher.get_error())}")
        counters.bump("grammars_compiled")
        grammar = Grammar(matcher, self.tok.vocab_size)
        with self.lock:
            self.cache[spec.key] = grammar
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return grammar


_compilers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compile_for(tokenizer, spec: StructuredOutputs) -> Grammar:
    """The compiled grammar of `spec` for `tokenizer` (cached). MemraError names what llguidance refused."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = _Compiler(tokenizer)
    return compiler.compile(spec)


def _grammar_text(spec: StructuredOutputs) -> str:
    kind, text, strict = spec.key
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise MemraError(f"{_name(spec)} is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise MemraError(f"{_name(spec)} must be a JSON object")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS,
                                                       overrides=None if strict else {"lenient": True})
        except ValueError as e:
            raise MemraError(f"{_name(spec)} was refused by the grammar compiler: {_one_line(str(e))}") from None
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    return llg.LLMatcher.grammar_from_lark(text)


def _name(spec: StructuredOutputs) -> str:
    return {"json": "the JSON schema", "json_object": "json_object", "choice": "the choice list",
            "regex": "the regex", "grammar": "the grammar"}[spec.key[0]]


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
