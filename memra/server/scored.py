"""The scored side of a reply: `echo` with `logprobs`, vLLM's `prompt_logprobs`, `text_offset` and
`return_tokens_as_token_ids` (the scores come from memra.engine.scoring).

Shapes, as OpenAI's legacy completions and vLLM answer them:
- echo: the choice's text starts with the prompt, and its `logprobs` lists the prompt's tokens first:
  `token_logprobs[0]` and `top_logprobs[0]` are null (nothing predicts the first token), then each
  prompt token's logprob and its position's top n, then the generated tokens.
- `text_offset[i]`: where token i's text starts in the choice's text (characters). A character split
  over several tokens starts at the first of them.
- prompt_logprobs: one entry per prompt position, null first, then {token id: {logprob, rank,
  decoded_token}} holding the prompt's own token (rank: 1 + how many tokens scored higher) and the top n.
- return_tokens_as_token_ids: every token's text is "token_id:<id>" (for tokens that are not whole
  characters or not JSON-encodable alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from memra.engine.scoring import TokenScore
from memra.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Scored:
    """One prompt's scores, and how the client wants them."""

    ids: list[int]
    scores: list[TokenScore | None]
    text: str  # the prompt's text (as given, or decoded from its ids)


@dataclass(frozen=True)
class ScoredReply:
    """What a reply adds to each choice: per prompt, its scores; choice i belongs to prompt i // n."""

    prompts: tuple[Scored, ...]
    n: int
    echo: bool  # the choice's text (and logprobs, where echo_top is set) start with the prompt's
    echo_top: int | None  # completions' `logprobs` with echo (None: echo without logprobs, or no echo)
    prompt_top: int | None  # prompt_logprobs
    as_ids: bool

    def extend(self, tok, choice: dict, i: int) -> None:
        """Put the prompt's part into choice i's body (a completions or chat choice)."""
        s = self.prompts[i // self.n]
        if self.echo:
            echo = echo_logprobs(tok, s, self.echo_top, self.as_ids) if self.echo_top is not None else None
            choice["logprobs"] = joined(echo, choice["logprobs"], len(s.text))
            choice["text"] = s.text + choice["text"]
        if self.prompt_top is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, s, self.prompt_top, self.as_ids)


def token_text(tok, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else tok.decode([token])


def text_offsets(tok, ids: list[int], base: int = 0) -> list[int]:
    """Each token's first character in the text decoding `ids` gives, plus `base`."""
    detok, at, out = IncrementalDetokenizer(tok), base, []
    for t in ids:
        out.append(at)
        at += len(detok.push(t))
    return out


def echo_logprobs(tok, s: Scored, top: int, as_ids: bool) -> dict:
    """The completions `logprobs` object of the echoed prompt (`text_offset` over its decoded ids)."""
    tops = [None if sc is None else {token_text(tok, t, as_ids): lp for t, lp in sc.top[:top]} for sc in s.scores]
    return {"tokens": [token_text(tok, t, as_ids) for t in s.ids],
            "token_logprobs": [None if sc is None else sc.logprob for sc in s.scores],
            "top_logprobs": tops, "text_offset": text_offsets(tok, s.ids)}


def joined(echo: dict | None, generated: dict | None, shift: int) -> dict | None:
    """The echoed prompt's logprobs, then the generated tokens' with their offsets moved past the prompt."""
    if generated is not None:
        generated = {**generated, "text_offset": [o + shift for o in generated["text_offset"]]}
    if echo is None or generated is None:
        return echo or generated
    return {k: echo[k] + generated[k] for k in echo}


def prompt_logprobs(tok, s: Scored, top: int, as_ids: bool) -> list:
    out: list = []
    for token, sc in zip(s.ids, s.scores):
        if sc is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": sc.logprob, "rank": sc.rank, "decoded_token": token_text(tok, token, as_ids)}}
        for rank, (t, lp) in enumerate(sc.top[:top], 1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": token_text(tok, t, as_ids)})
        out.append(entry)
    return out
