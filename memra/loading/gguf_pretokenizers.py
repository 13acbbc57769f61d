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

# The letters DeepSeek LLM's word regex admits: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and
# other cased alphabets, spelled as explicit ranges (llama.cpp copies the same list from tokenizer.json).
_DEEPSEEK_LATIN = (
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]")
# Written with escapes because the list holds compatibility characters (U+1F7D, U+2126, U+212A) that an
# editor's Unicode normalisation would silently turn into other code points.
_DEEPSEEK_PUNCT = "[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]"

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
    # DeepSeek LLM: newlines alone, Latin-script words (the character list is its tokenizer.json's, verbatim)
    # and ASCII / full-width punctuation runs each with one optional leading space, trailing whitespace,
    # CJK runs, digit runs.
    PreTokenizerRule(("deepseek-llm",), (r"[\r\n]", r"\s?" + _DEEPSEEK_LATIN + "+", r"\s?" + _DEEPSEEK_PUNCT + "+",
                                         r"\s+$", _DEEPSEEK_CJK + "+", r"\p{N}+")),
    # Falcon: punctuation runs first, then GPT-2 words, then 3-digit groups.
    PreTokenizerRule(("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2.removesuffix(r"|\s+"), r"[0-9][0-9][0-9]")),
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
