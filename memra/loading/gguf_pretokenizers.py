"""Pre-tokenizers for GGUF vocabularies: how text is cut into words before BPE runs inside each word.

A GGUF file names its pre-tokenizer (`tokenizer.ggml.pre`) instead of storing the regex; this table
says what each name means, as llama.cpp's own table does (memra.tokenizer.gguf_vocab builds the tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from memra.errors import TokenizerError


@dataclass(frozen=True)
class PreTokenizerRule:
    """What one family of `tokenizer.ggml.pre` names means.

    `patterns` are applied in order, each cutting the pieces the previous one left (text between matches
    stays a piece of its own), which is how llama.cpp applies its regex lists. Where the model's own
    tokenizer.json has a single regex we use that regex verbatim, since the reference token ids were made
    by HF tokenizers with it.
    """

    names: tuple[str, ...]
    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a vocab entry is taken whole (Llama 3)
    add_bos: bool = False        # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


# GPT-2's word regex: contractions, letters, digits, other symbols, each with one optional leading space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3 / Qwen 2 style: case-insensitive contractions, a letter run may take one leading non-letter,
# numbers cut into groups (of up to 3 digits for Llama 3, single digits for Qwen), newlines grouped.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 3.5 keeps combining marks (\p{M}) inside words, so e.g. Devanagari vowel signs stay attached.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZER_RULES: tuple[PreTokenizerRule, ...] = (
    # llama.cpp's fallback for files that name no pre-tokenizer: punctuation runs, then GPT-2 words,
    # then digit runs, then 3-digit groups.
    PreTokenizerRule(("default",),
                     (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    PreTokenizerRule(("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4",
                      "trillion", "granite-docling"),
                     (_GPT2,)),
    PreTokenizerRule(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                     (_LLAMA3,), ignore_merges=True, add_bos=True),
    PreTokenizerRule(("dbrx", "smaug-bpe"), (_LLAMA3,)),
    PreTokenizerRule(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open", "kormo",
                      "f2llmv2"),
                     (_QWEN2,)),
    PreTokenizerRule(("qwen35",), (_QWEN35,)),
    # StarCoder family: every digit alone, then GPT-2 words.
    PreTokenizerRule(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                     (r"\p{N}", _GPT2)),
)

PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {name: rule for rule in PRE_TOKENIZER_RULES for name in rule.names}


def pre_tokenizer_rule(pre: str | None, source: str) -> PreTokenizerRule:
    """The rule for a `tokenizer.ggml.pre` value; a missing value means llama.cpp's 'default'."""
    if not pre:
        return PRE_TOKENIZERS["default"]
    if not isinstance(pre, str):
        raise TokenizerError(f"{source}: GGUF key tokenizer.ggml.pre must be a string, found {type(pre).__name__}")
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(
            f"{source}: unknown pre-tokenizer tokenizer.ggml.pre = {pre!r}; memra knows: {known}. "
            "Load the tokenizer from the model's HF directory (tokenizer.json) instead, "
            "or add the regex for this name to memra/loading/gguf_pretokenizers.py"
        ) from None


def _pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    """Regex splits ('isolated': matches and the gaps between them both become pieces), then the
    byte-level step that spells each UTF-8 byte as one character of the BPE alphabet."""
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in rule.patterns]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
