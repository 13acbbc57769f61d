"""memra.LLM's prompts in vLLM's forms: text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}
dicts, one or a list of them; and chat's continue_final_message cut."""

from __future__ import annotations

from memra.errors import MemraError


def prompt_text_or_ids(p, k: int):
    """One prompt as text or token ids; vLLM's dict forms unwrapped; anything else refused by position."""
    if isinstance(p, dict):
        if set(p) == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if set(p) == {"prompt_token_ids"} and isinstance(p["prompt_token_ids"], (list, tuple)):
            p = p["prompt_token_ids"]
        else:
            raise MemraError(f"prompt {k}: a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids', "
                             f"got keys {sorted(p)}")
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise MemraError(f"prompt {k} must be text, a non-empty list of token ids, or a {{'prompt': ...}} / "
                     f"{{'prompt_token_ids': [...]}} dict; got {type(p).__name__}")


def prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise MemraError("generate needs at least one prompt")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def cut_after_final(text: str, messages: list[dict]) -> str:
    """vLLM's continue_final_message: the rendered conversation up to the end of the last message's
    content (the template's end-of-turn after it left out), so the model continues that message."""
    content = messages[-1].get("content") if messages else None
    if not messages or messages[-1].get("role") != "assistant" or not isinstance(content, str) or content not in text:
        raise MemraError("LLM.chat(continue_final_message=True) needs the conversation to end with an "
                         "assistant message whose text content the template writes")
    return text[: text.rindex(content) + len(content)]
