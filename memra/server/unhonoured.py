"""Request fields that OpenAI's or vLLM's protocol defines and memra does not honour: each is refused
with a 400 naming it, so that no client believes it got what it asked for.

The rule: a field in the table below is refused when the request carries it with any value other than
null or one of its no-op values (the value that asks for what memra does anyway: `store: false`,
`use_beam_search: false`, `tools: []`, ...). Fields the protocols do not
define (vendor extras) stay ignored, and the fields memra honours (`n`, `logprobs`, `echo` on
completions, `prompt_logprobs`, `return_tokens_as_token_ids`, `add_special_tokens`, ...) are validated by
memra.server.protocol. Where a field has a no-op value only because another field is refused
(on /v1/completions, `tool_choice: "auto"` needs `tools`, which is refused when non-empty), that value
is accepted. The chat route's tool fields are checked by memra.server.tools.

Sources, by the tag in each row:
  openai-chat  OpenAI API reference, POST /v1/chat/completions (platform.openai.com/docs/api-reference/chat)
  openai-cmpl  OpenAI API reference, POST /v1/completions (legacy)
  vllm-samp    vLLM vllm/entrypoints/openai/protocol.py, the "*-sampling-params" blocks of
               ChatCompletionRequest / CompletionRequest (and docs/serving/openai_compatible_server.md)
  vllm-extra   the same file's "*-extra-params" blocks
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memra.server.errors import ApiError

CHAT, CMPL = "chat", "completions"
BOTH = (CHAT, CMPL)


@dataclass(frozen=True)
class Unhonoured:
    name: str
    routes: tuple[str, ...]
    source: str
    no_op: Callable[[object, dict], bool]  # (value, whole body) -> the value asks for nothing memra does not do
    why: str  # the end of the refusal's sentence


def _is(*values) -> Callable[[object, dict], bool]:
    # `False == 0` in Python: compare types too, so `store: 0` is not taken for false
    return lambda v, body: any(type(v) is type(x) and v == x or (type(x) is float and type(v) is int and v == x)
                               for x in values)


def _empty(v, body) -> bool:
    return v in ([], {}, "")


def _never(v, body) -> bool:
    return False


def _best_of(v, body) -> bool:
    return type(v) is int and v in (1, body.get("n", 1))


_ALL_TEXT = _is(["text"])
R = Unhonoured
TABLE: tuple[Unhonoured, ...] = (
    # OpenAI's own fields
    # tool calling is a chat feature (memra.server.tools); a completion has no messages to call from
    R("tools", (CMPL,), "openai-chat", _empty, "tool calling is on /v1/chat/completions"),
    R("tool_choice", (CMPL,), "openai-chat", _is("none", "auto"), "tool calling is on /v1/chat/completions"),
    R("parallel_tool_calls", (CMPL,), "openai-chat", _is(True, False), "tool calling is on /v1/chat/completions"),
    R("functions", BOTH, "openai-chat", _empty, "the deprecated functions API is not served; use tools"),
    R("function_call", BOTH, "openai-chat", _is("none", "auto"), "the deprecated functions API is not served; use tool_choice"),
    R("reasoning_effort", BOTH, "openai-chat", _never, "memra does not steer reasoning"),
    R("verbosity", BOTH, "openai-chat", _never, "memra does not steer verbosity"),
    R("modalities", BOTH, "openai-chat", _ALL_TEXT, "memra produces text only"),
    R("audio", BOTH, "openai-chat", _never, "memra produces text only"),
    R("prediction", BOTH, "openai-chat", _never, "memra has no predicted outputs"),
    R("service_tier", BOTH, "openai-chat", _is("auto", "default"), "memra has one service tier"),
    R("store", BOTH, "openai-chat", _is(False), "memra stores nothing"),
    R("metadata", BOTH, "openai-chat", _empty, "memra stores nothing to tag"),
    R("web_search_options", BOTH, "openai-chat", _never, "memra has no web search"),
    R("prompt_cache_key", BOTH, "openai-chat", _never, "memra has no cache routing key"),
    R("suffix", (CMPL,), "openai-cmpl", _empty, "memra has no fill-in-the-middle"),
    R("best_of", (CMPL,), "openai-cmpl / vllm-samp", _best_of, "memra does not rank candidates; use n"),
    # vLLM's sampling params
    R("use_beam_search", BOTH, "vllm-samp", _is(False), "memra has no beam search"),
    R("length_penalty", BOTH, "vllm-samp", _is(1.0), "memra has no beam search"),
    R("allowed_token_ids", BOTH, "vllm-samp", _never, "memra has no allow-list; use logit_bias"),
    R("bad_words", BOTH, "vllm-samp", _empty, "memra has no bad-word filter"),
    # vLLM's extra params
    R("echo", (CHAT,), "vllm-extra", _is(False), "memra's chat does not prepend the last message"),
    R("add_generation_prompt", (CHAT,), "vllm-extra", _is(True), "memra always adds the generation prompt"),
    R("continue_final_message", (CHAT,), "vllm-extra", _is(False), "memra always starts a new message"),
    R("documents", (CHAT,), "vllm-extra", _empty, "memra passes no documents to the chat template"),
    R("chat_template", (CHAT,), "vllm-extra", _never, "memra uses the model's chat template"),
    R("include_reasoning", (CHAT,), "vllm-extra", _is(True), "this server separates no reasoning (start it with --reasoning-parser qwen3)"),
    R("mm_processor_kwargs", BOTH, "vllm-extra", _empty, "memra serves text-only models"),
    R("media_io_kwargs", BOTH, "vllm-extra", _empty, "memra serves text-only models"),
    R("prompt_embeds", (CMPL,), "vllm-extra", _never, "memra takes text or token ids"),
    R("guided_decoding_backend", BOTH, "vllm-extra", _never, "memra has no structured output"),
    R("guided_whitespace_pattern", BOTH, "vllm-extra", _never, "memra has no structured output"),
    R("structural_tag", BOTH, "vllm-extra", _never, "memra has no structured output"),
    R("priority", BOTH, "vllm-extra", _is(0), "memra schedules first come, first served"),
    R("request_id", BOTH, "vllm-extra", _never, "memra makes its own response ids"),
    R("logits_processors", BOTH, "vllm-extra", _empty, "memra runs no custom logits processors"),
    R("return_token_ids", BOTH, "vllm-extra", _is(False), "memra does not return token ids"),
    R("cache_salt", BOTH, "vllm-extra", _never, "memra's cache takes no salt"),
    R("kv_transfer_params", BOTH, "vllm-extra", _never, "memra has no KV transfer"),
    R("vllm_xargs", BOTH, "vllm-extra", _empty, "memra has no request extensions"),
    R("repetition_detection", BOTH, "vllm-extra", _never, "memra has no repetition detector"),
)
# Fields of those protocols that memra honours (memra.server.protocol validates them); the table's test
# holds TABLE and HONOURED together against every field the protocols name.
HONOURED = frozenset({"n", "logprobs", "top_logprobs", "prompt_logprobs", "return_tokens_as_token_ids",
                      "add_special_tokens", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                      "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
                      "chat_template_kwargs",
                      # structured output (memra.server.structured)
                      "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar"})
_BY_ROUTE = {route: tuple(r for r in TABLE if route in r.routes) for route in BOTH}


def refuse_unhonoured(body: dict, route: str, honoured: frozenset[str] = frozenset()) -> None:
    """ApiError(400) naming the first field of `body` that memra would not honour on `route`.
    `honoured`: table fields this server implements after all (they are validated elsewhere)."""
    for row in _BY_ROUTE[route]:
        if row.name in body and row.name not in honoured:
            value = body[row.name]
            if value is not None and not row.no_op(value, body):
                raise ApiError(400, f"{row.name} is not supported: {row.why}; remove the field", param=row.name)
