"""Tokenizer: llama.cpp's tokenizer test vectors, HF-directory vs GGUF agreement, streaming
detokenization, chat templates checked against HF transformers, and the errors for bad input."""

from __future__ import annotations

import os

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest

from memra.errors import TokenizerError
from memra.loading.gguf_pretokenizers import PRE_TOKENIZERS, _pre_tokenizer
from memra.tokenizer import _BYTE_OF_CHAR, IncrementalDetokenizer, Tokenizer
from memra.tokenizer.gguf_vocab import merges_from_scores, read_tokenizer_metadata, read_tokenizer_metadata_file

FIXTURES = Path(__file__).parent / "fixtures"
HF_TOKENIZER = FIXTURES / "tokenizer"
QWEN_GGUF = FIXTURES / "gguf" / "qwen3_5-f32.gguf"  # same vocabulary as HF_TOKENIZER, pre "qwen2"
TEMPLATES = sorted((FIXTURES / "templates").glob("*.jinja")) + [HF_TOKENIZER / "chat_template.jinja"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Compare <b>&</b> 'quotes' — Äpfel 🍎?"},
    {"role": "assistant", "content": "Fine."},
]

# Several hundred characters that exercise every branch of a byte-level pre-tokenizer.
MIXED_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nÄpfel, Birnen & Pflaumen kosten 3,49 € (2024-05-17)!\n"
    "東京の天気は晴れ。 Привет, мир! 🍎🍐🦙 😶‍🌫️ — naïve café résumé\n"
    "    def f(x):\n\t\treturn x**2  # they're, we'll, I'd, it's, DON'T\n\n\n"
    "  multiple   spaces   \r\nand CRLF\u00a0nbsp 12345678 ...!?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def hf_tok() -> Tokenizer:
    return Tokenizer.from_hf_dir(HF_TOKENIZER)


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(QWEN_GGUF)))


# ---------------------------------------------------------------------------------------------------
# 1. llama.cpp's test vectors
# ---------------------------------------------------------------------------------------------------

VOCABS = ("qwen35", "llama-bpe", "gpt-2", "llama-spm", "phi-3", "gemma-4", "deepseek-llm", "falcon")
_SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_file(name: str) -> Path:
    """The vocab GGUFs are stored xz-compressed (17 MB -> 3.5 MB); unpack each once per machine."""
    import lzma
    import tempfile

    packed = FIXTURES / "vocab" / f"ggml-vocab-{name}.gguf.xz"
    out = Path(tempfile.gettempdir()) / "memra-test-vocab" / f"ggml-vocab-{name}.gguf"
    if not out.exists() or out.stat().st_mtime < packed.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(f".part{os.getpid()}")
        part.write_bytes(lzma.decompress(packed.read_bytes()))
        part.replace(out)  # atomic: parallel test processes never see half a file
    return out


def vocab_text(name: str, suffix: str) -> Path:
    return FIXTURES / "vocab" / f"ggml-vocab-{name}.gguf.{suffix}"


def split_vocab_texts(raw: str) -> list[str]:
    """Cut a .inp file the way llama.cpp's test-tokenizer-0 does: every text is followed by a newline,
    the line __ggml_vocab_test__ and its newline; anything after the last separator is one more text."""
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(_SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(_SEPARATOR)
    return texts


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs; the .out file has one line of space-separated ids per text."""
    texts = split_vocab_texts(vocab_text(name, "inp").read_bytes().decode("utf-8"))
    lines = vocab_text(name, "out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


@functools.cache
def vocab_tokenizer(name: str) -> Tokenizer:
    # From the path: gguf.GGUFReader needs ~15 s to parse a 150k-token vocabulary, our reader <1 s.
    # test_gguf_reader_and_path_agree / test_llamacpp_vocab_vectors_via_gguf_reader cover GGUFReader.
    return Tokenizer.from_gguf(vocab_file(name))


def check_vectors(tok: Tokenizer, name: str) -> None:
    cases = vocab_cases(name)
    assert len(cases) > 40
    # parse_special=False because test-tokenizer-0 tokenizes with parse_special = false.
    failures = [(text, got, want) for text, want in cases if (got := tok.encode(text, parse_special=False)) != want]
    assert not failures, f"{len(failures)} of {len(cases)} texts differ, first (text, got, want): {failures[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vocab_vectors(name):
    check_vectors(vocab_tokenizer(name), name)


def test_llamacpp_vocab_vectors_via_gguf_reader():
    """The path lead code takes: an open gguf.GGUFReader (gpt-2 only; the reader is slow, see above)."""
    check_vectors(Tokenizer.from_gguf(gguf.GGUFReader(str(vocab_file("gpt-2")))), "gpt-2")


@pytest.mark.slow
@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vocab_vectors_via_gguf_reader_all(name):
    check_vectors(Tokenizer.from_gguf(gguf.GGUFReader(str(vocab_file(name)))), name)


@pytest.mark.parametrize("path", [QWEN_GGUF, vocab_file("phi-3")], ids=lambda p: p.name)
def test_gguf_reader_and_path_agree(path):
    from_reader = read_tokenizer_metadata(gguf.GGUFReader(str(path)), str(path))
    assert read_tokenizer_metadata_file(path) == from_reader
    assert "tokenizer.ggml.tokens" in from_reader and "general.name" in from_reader


def pre_tokenized(pre: str, text: str) -> list[str]:
    """The words a `tokenizer.ggml.pre` rule cuts `text` into, back in plain text."""
    pieces = _pre_tokenizer(PRE_TOKENIZERS[pre]).pre_tokenize_str(text)
    return [bytes(_BYTE_OF_CHAR[c] for c in piece).decode() for piece, _ in pieces]


def test_pre_tokenizer_rules():
    """What distinguishes the regex families (the vocab vectors above do not exercise all of it)."""
    hindi = "हिन्दी"  # letters with combining vowel signs and a virama (\p{M})
    assert pre_tokenized("qwen35", hindi) == [hindi]
    assert len(pre_tokenized("qwen2", hindi)) == 4
    assert pre_tokenized("llama3", "x 12345") == ["x", " ", "123", "45"]
    assert pre_tokenized("qwen2", "x 12345") == ["x", " ", "1", "2", "3", "4", "5"]
    assert pre_tokenized("gpt-2", "x 12345 DON'T") == ["x", " 12345", " DON", "'", "T"]
    assert pre_tokenized("llama3", "DON'T") == ["DON", "'T"]
    assert pre_tokenized("default", "x 12345!!") == ["x", " ", "123", "45", "!!"]


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_decode_round_trips(name):
    tok = vocab_tokenizer(name)
    for text, ids in vocab_cases(name):
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok, skip_special=False)
        chunks = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(chunks) == text
        assert not any("\ufffd" in c for c in chunks)


def test_vocab_special_ids():
    llama3, spm, qwen = (vocab_tokenizer(n) for n in ("llama-bpe", "llama-spm", "qwen35"))
    # Llama 3 and SentencePiece models prepend bos by default; Qwen does not.
    assert (llama3.bos_id, llama3.add_bos, llama3.encode("Hello", add_special=True)[0]) == (128000, True, 128000)
    assert (spm.bos_id, spm.add_bos, spm.encode("Hello", add_special=True)[0]) == (1, True, 1)
    assert qwen.add_bos is False and qwen.encode("Hello", add_special=True) == [9707]
    # eos plus the turn-end tokens: <|eot_id|> for Llama 3, <|im_end|> for Qwen.
    assert llama3.eos_ids[0] == 128001 and 128009 in llama3.eos_ids
    assert qwen.eos_ids[0] == 151643 and 151645 in qwen.eos_ids
    assert "pre-tokenizer 'qwen35'" in qwen.summary() and "151,936 tokens" in qwen.summary()
    # Phi-3's control tokens swallow the newline after them, as llama.cpp does for that model.
    phi3 = vocab_tokenizer("phi-3")
    assert phi3.encode("<|user|>\nHi") == [32010] + phi3.encode("Hi")
    # Gemma 4 always starts with <bos> (2), and ends on <eos> (1) or its turn-end <turn|> (106).
    gemma4 = vocab_tokenizer("gemma-4")
    assert (gemma4.bos_id, gemma4.add_bos, gemma4.encode("Hello", add_special=True)[0]) == (2, True, 2)
    assert gemma4.eos_ids == (1, 106) and gemma4.decode(gemma4.encode("a  b\n\n c")) == "a  b\n\n c"


# ---------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------
# 2. HF directory and GGUF build the same tokenizer
# ---------------------------------------------------------------------------------------------------

def test_hf_dir_round_trips(hf_tok):
    ids = hf_tok.encode(MIXED_TEXT)
    assert hf_tok.decode(ids) == MIXED_TEXT
    assert b"".join(hf_tok.token_to_piece(i) for i in ids) == MIXED_TEXT.encode()
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> matched as one token, three times


def test_hf_dir_and_gguf_agree(hf_tok, gguf_tok):
    assert len(MIXED_TEXT) > 300
    assert hf_tok.encode(MIXED_TEXT) == gguf_tok.encode(MIXED_TEXT)
    for line in MIXED_TEXT.splitlines(keepends=True):
        assert hf_tok.encode(line) == gguf_tok.encode(line), line
    assert hf_tok.vocab_size == gguf_tok.vocab_size == 1024
    assert gguf_tok.decode(gguf_tok.encode(MIXED_TEXT)) == MIXED_TEXT


def test_special_ids_and_flags(hf_tok, gguf_tok):
    # tokenizer_config.json: eos <|im_end|>, no bos; generation_config.json agrees (eos 2).
    assert (hf_tok.bos_id, hf_tok.add_bos, hf_tok.eos_ids) == (None, False, (2,))
    assert hf_tok.encode("hi", add_special=True) == hf_tok.encode("hi")
    # The GGUF declares eos 2 and llama.cpp also stops on <|endoftext|> (0).
    assert gguf_tok.eos_ids[0] == 2 and 0 in gguf_tok.eos_ids
    assert hf_tok.is_special(2) and not hf_tok.is_special(100)


def test_parse_special_false_keeps_control_tokens_as_text(hf_tok):
    ids = hf_tok.encode("<|im_start|>user", parse_special=False)
    assert 1 not in ids and hf_tok.decode(ids) == "<|im_start|>user"
    assert hf_tok.encode("<|im_start|>user")[0] == 1


def test_skip_special(hf_tok):
    ids = hf_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert hf_tok.decode(ids, skip_special=True) == "user\nhi"
    assert hf_tok.token_to_piece(2) == b"<|im_end|>"


def test_summary_mentions_the_essentials(hf_tok, gguf_tok):
    for tok in (hf_tok, gguf_tok):
        text = tok.summary()
        assert "1,024 tokens" in text and "<|im_end|> (2)" in text and "chat template" in text
    assert "pre-tokenizer 'qwen2'" in gguf_tok.summary()


# ---------------------------------------------------------------------------------------------------
# 3. Streaming detokenization
# ---------------------------------------------------------------------------------------------------

STREAM_TEXT = "Äpfel 🍎🍐 東京は晴れ 😶‍🌫️ naïve — done"


def test_incremental_detokenizer_matches_decode(hf_tok):
    ids = hf_tok.encode(STREAM_TEXT)
    assert len(ids) > len(STREAM_TEXT) // 2  # a 1024-token vocab splits these characters into bytes
    detok = IncrementalDetokenizer(hf_tok, skip_special=False)
    chunks = [detok.push(i) for i in ids]
    assert detok.flush() == ""
    assert "".join(chunks) == hf_tok.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks  # some tokens carried only part of a character and were held back


def test_incremental_detokenizer_cut_off_stream(hf_tok):
    ids = hf_tok.encode("ok 🍎")
    detok = IncrementalDetokenizer(hf_tok)
    partial = "".join(detok.push(i) for i in ids[:-1])
    assert partial == "ok " and "\ufffd" not in partial
    tail = detok.flush()  # the emoji never completed
    assert "\ufffd" in tail and partial + tail == hf_tok.decode(ids[:-1])


def test_incremental_detokenizer_skips_specials(hf_tok):
    ids = hf_tok.encode("<|im_start|>assistant\nHi 🍎<|im_end|>")
    detok = IncrementalDetokenizer(hf_tok)  # skip_special=True by default
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == "assistant\nHi 🍎" == hf_tok.decode(ids, skip_special=True)


# ---------------------------------------------------------------------------------------------------
# 4. Chat templates
# ---------------------------------------------------------------------------------------------------

def tokenizer_dir(tmp_path: Path, template: str | None = None, config: dict | None = None) -> Path:
    """A copy of the fixture tokenizer with the given chat_template.jinja and tokenizer_config.json
    (by default the fixture's own config, which names eos <|im_end|> and pad <|endoftext|>)."""
    shutil.copy(HF_TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    if config is None:
        shutil.copy(HF_TOKENIZER / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    else:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("template_file", TEMPLATES, ids=lambda p: p.name)
def test_chat_templates_render_like_transformers(tmp_path, template_file):
    template = template_file.read_text(encoding="utf-8")
    tok = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path, template))
    assert tok.chat_template == template
    prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert "Compare <b>&</b> 'quotes' — Äpfel 🍎?" in prompt and "Fine." in prompt
    if "<|im_start|>" in template:  # the ChatML family (Qwen); Gemma 4 and Step-3.5 have turns of their own
        assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        assert "<|im_start|>user\nCompare <b>&</b> 'quotes' — Äpfel 🍎?<|im_end|>\n" in prompt
        assert "<|im_start|>assistant\n" in prompt
        assert prompt.rstrip("\n").endswith(("<|im_start|>assistant", "<think>", "</think>"))

    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather <now>",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}):
        for generation_prompt in (True, False):
            # HF passes the tokenizer's special tokens to the template too.
            want, _ = render(conversations=[CONVERSATION], chat_template=template,
                             add_generation_prompt=generation_prompt, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", **kwargs)
            got = tok.apply_chat_template(CONVERSATION, add_generation_prompt=generation_prompt, **kwargs)
            assert got == want[0], (kwargs, generation_prompt)


def test_rendered_prompt_tokenizes_specials(hf_tok):
    ids = hf_tok.encode(hf_tok.apply_chat_template(CONVERSATION))
    assert ids.count(1) == 4 and ids.count(2) == 3  # 4 x <|im_start|>, 3 x <|im_end|>


def test_template_precedence(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's chat_template."""
    config = {"eos_token": "<|im_end|>", "chat_template": "from-config {{ messages | length }}"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from_config = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path / "a", config=config))
    assert from_config.apply_chat_template(CONVERSATION) == "from-config 3"
    both = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path / "b", template="from-file", config=config))
    assert both.apply_chat_template(CONVERSATION) == "from-file"


def test_gguf_chat_template(gguf_tok, hf_tok):
    assert gguf_tok.chat_template == hf_tok.chat_template
    assert gguf_tok.apply_chat_template(CONVERSATION) == hf_tok.apply_chat_template(CONVERSATION)


def test_template_helpers(tmp_path):
    template = ("{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') | length }}|"
                "{% generation %}{{ eos_token }}{% endgeneration %}")
    tok = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path, template, {"eos_token": "<|im_end|>"}))
    assert tok.apply_chat_template([{"role": "user", "content": "<ü>"}]) == '"<ü>"|4|<|im_end|>'


# ---------------------------------------------------------------------------------------------------
# A SentencePiece ('llama') vocabulary built by hand
# ---------------------------------------------------------------------------------------------------

def write_gguf(path: Path, metadata: dict[str, Any]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


# Merged pieces in falling priority; single characters come last with the lowest scores.
_SPM_MERGED = ["▁H", "ll", "▁He", "llo", "▁Hello", "or", "▁w", "▁wor", "ld", "▁world"]
_SPM_CHARS = ["▁", "H", "e", "l", "o", "w", "r", "d"]


def spm_metadata() -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_MERGED + _SPM_CHARS
    types = [2, 3, 3] + [6] * 256 + [1] * (len(_SPM_MERGED) + len(_SPM_CHARS))
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_MERGED))] + [-100.0] * len(_SPM_CHARS)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def test_merges_from_scores_order():
    meta = spm_metadata()
    merges = merges_from_scores(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"],
                                meta["tokenizer.ggml.scores"])
    assert merges[:4] == [("▁", "H"), ("l", "l"), ("▁H", "e"), ("ll", "o")]
    assert ("▁He", "llo") in merges and ("▁wor", "ld") in merges


def test_sentencepiece_gguf(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "spm.gguf", spm_metadata()))
    ids = tok.encode("Hello world", add_special=True)
    assert tok.bos_id == 1 and tok.add_bos and tok.eos_ids == (2,)
    pieces = [tok.token_to_piece(i) for i in ids]
    assert pieces == [b"<s>", b" Hello", b" world"]
    # Like llama.cpp, the text after a special token gets its own space prefix.
    assert tok.encode("Hello</s>Hello") == [ids[1], 2, ids[1]]
    # Characters outside the vocabulary fall back to byte tokens; decode drops the prepended space.
    ids = tok.encode("Hello\né")
    assert [tok.token_to_piece(i) for i in ids] == [b" Hello", b"\n", b"\xc3", b"\xa9"]
    assert tok.decode(ids) == "Hello\né"
    assert tok.decode(tok.encode("Hello world", add_special=True), skip_special=True) == "Hello world"
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "Hello\né"
    assert "SentencePiece" in tok.summary()


# ---------------------------------------------------------------------------------------------------
# 5. Errors for bad input
# ---------------------------------------------------------------------------------------------------

def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found.*copy tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_hf_dir(tmp_path / "nope")


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not valid JSON .*line 1.*download it again"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}', encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizers library cannot load it"):
        Tokenizer.from_hf_dir(tmp_path)


def test_corrupt_tokenizer_config(tmp_path):
    tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_hf_dir(tmp_path)


def test_gguf_without_tokenizer(tmp_path):
    reader = write_gguf(tmp_path / "bare.gguf", {"general.name": "bare"})
    with pytest.raises(TokenizerError, match=r"bare\.gguf: .*no tokenizer metadata.*tokenizer\.ggml\.model"):
        Tokenizer.from_gguf(reader)


def test_gguf_path_not_gguf_or_truncated(tmp_path):
    (tmp_path / "notes.gguf").write_text("hello", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"notes\.gguf: not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "notes.gguf")
    (tmp_path / "cut.gguf").write_bytes(QWEN_GGUF.read_bytes()[:5000])
    with pytest.raises(TokenizerError, match=r"cut\.gguf: corrupt or truncated GGUF metadata"):
        Tokenizer.from_gguf(tmp_path / "cut.gguf")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_gguf_unknown_model(tmp_path):
    reader = write_gguf(tmp_path / "bert.gguf", {**spm_metadata(), "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model = 'bert' is not supported.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(reader)


def test_gguf_unknown_pre(tmp_path):
    meta = {**spm_metadata(), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["l l"],
            "tokenizer.ggml.pre": "martian-v9"}
    reader = write_gguf(tmp_path / "pre.gguf", meta)
    with pytest.raises(TokenizerError, match=r"pre-tokenizer tokenizer\.ggml\.pre = 'martian-v9'.*qwen2.*qwen35"):
        Tokenizer.from_gguf(reader, "pre.gguf")


def test_template_syntax_error(tmp_path):
    tok = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path, "{% for m in messages %}{{ m.content }"))
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja has a syntax error at line 1"):
        tok.apply_chat_template(CONVERSATION)
    assert "syntax error" in tok.summary()  # inspect still works


def test_template_raise_exception(tmp_path):
    tok = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path, (FIXTURES / "templates" / "Qwen3.5-4B.jinja").read_text()))
    with pytest.raises(TokenizerError, match="rejected the conversation: No messages provided"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="must be a dict with a 'role'"):
        tok.apply_chat_template([{"content": "no role"}])


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_hf_dir(tokenizer_dir(tmp_path))
    assert tok.chat_template is None and "no chat template" in tok.summary()
    with pytest.raises(TokenizerError, match=r"has no chat template.*chat_template\.jinja"):
        tok.apply_chat_template(CONVERSATION)


def test_bad_ids_and_text(hf_tok):
    with pytest.raises(TokenizerError, match=r"token id 5000 is outside this vocabulary \(0\.\.1023\)"):
        hf_tok.decode([5, 5000])
    with pytest.raises(TokenizerError, match="must be a str"):
        hf_tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="token ids must be integers"):
        hf_tok.decode([1.5])  # type: ignore[list-item]


def test_numpy_and_torch_ids(hf_tok):
    """Sampled ids arrive as numpy or torch integers; they must behave like ints (torch's hash does not)."""
    import numpy as np
    import torch

    ids = hf_tok.encode("hi <|im_end|>")
    for seq in (np.array(ids), torch.tensor(ids)):
        assert hf_tok.decode(seq, skip_special=True) == "hi "
        assert hf_tok.is_special(seq[-1]) and hf_tok.token_to_piece(seq[-1]) == b"<|im_end|>"
