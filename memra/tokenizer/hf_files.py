"""A `TokenizerParts` from a Hugging Face model directory: tokenizer.json and its side files
(tokenizer_config.json, chat_template.jinja / .json, generation_config.json, config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from tokenizers import Tokenizer as Backend

from memra.errors import TokenizerError
from memra.tokenizer.pieces import (END_OF_TURN_TEXTS, ByteLevelPieces, DecoderPieces, SentencePiecePieces,
                                    TokenizerParts)


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
    except (ValueError, RecursionError):  # an integer literal too long to convert; nesting past the stack
        raise TokenizerError(f"{path}: not JSON memra can read (a number too long or nesting too deep); the file is "
                             "corrupt, download it again") from None


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
        named = {t["name"]: t.get("template") for t in value if isinstance(t, dict) and isinstance(t.get("name"), str)}
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
