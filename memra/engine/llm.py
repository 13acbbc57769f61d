"""memra.LLM: batches of prompts in, one output per prompt out — the convention of vLLM's LLM.generate.

    llm = memra.LLM("model.gguf", device="cuda")
    outs = llm.generate(["prompt a", "prompt b"], memra.SamplingParams(max_tokens=64, seed=1))
    outs[0].outputs[0].text, .token_ids, .finish_reason, .logprobs

It runs the same engine as the server (memra.engine.engine): every prompt is a request, they run as one
continuous batch on the caller's thread, and each answer is the one the prompt gets alone — the engine's
promise (batched rows = B=1 rows, chunked prefill = one-shot prefill, seeded sampling = f(seed, step)).
"""

from __future__ import annotations

import dataclasses
import random
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from memra.engine.engine import Engine
from memra.engine.scoring import ScoreJob, TokenScore
from memra.engine.types import EngineConfig, TokenEvent
from memra.errors import MemraError
from memra.generate import GenerationStats
from memra.pools import KvBudget
from memra.sampling import SamplingParams
from memra.settings import show_progress
from memra.spec import SpecConfig
from memra.tokenizer import TextStream
from memra.tools.messages import template_messages


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the prompt's n choices
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens)
    logprobs: list[float] | None = None  # each generated token's logprob, where asked
    top_logprobs: list[dict[int, float]] | None = None  # the top n of each position, where asked
    seed: int | None = None  # the sampling seed this choice used (choice i: the request's seed + i)


@dataclass(frozen=True)
class RequestOutput:
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs: per prompt position {token id: logprob} of its own token and the top n
    # (vLLM's shape; None at position 0, which nothing predicts)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    weights_version: int = 0  # which weights answered: 0 as loaded, +1 per update_weights (memra.weights)


@dataclass(frozen=True)
class ScoreOutput:
    """LLM.score's answer for one (prompt, continuation): each continuation token's logprob, bit for bit
    the one it got when it was sampled after this prompt (promise E9)."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # the continuation's
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None  # where top_logprobs > 0


@dataclass
class _Choice:
    """One choice while it runs: its text stream and what it has produced."""

    text: TextStream
    pieces: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


class LLM:
    """A model and an engine over it, for offline batches.

    model: a path (HF directory, .gguf, "demo", "random:SHAPE") or a model memra.load returned.
    max_batch: sequences decoded together; max_ctx: prompt + completion tokens per sequence (default the
    model's context). The engine's caches take at most the model's KV budget (memra.load's kv_budget).
    warm_up: pay kernel compilation and (on a GPU) every batch bucket's graph capture now (Engine.warm_up).
    prefill_wait_steps, prefill_group: hold a request that could start while others decode, so that several
    start in one prefill (memra.engine.admission; EngineConfig's defaults).
    speculative: draft-and-verify decoding, "mtp" or "ngram" (draft length 4) or a memra.spec.SpecConfig;
    the outputs are the same tokens and logprobs as without it (E4), only the speed changes.
    enable_prefix_caching: reuse the primed pages of earlier prompts (vLLM's name; memra.prefix, promise E8:
    the same tokens and logprobs, bit for bit, as without it). Prompts and n > 1 choices that share a prefix
    prime it once.
    """

    def __init__(self, model, device: str | None = None, dtype: str | None = None, *, max_batch: int = 64,
                 max_ctx: int | None = None, warm_up: bool = True,
                 prefill_wait_steps: int | None = None, prefill_group: int | None = None,
                 speculative: str | SpecConfig | None = None, max_model_len: int | None = None,
                 seed: int | None = None, gpu_memory_utilization: float | None = None, enable_prefix_caching: bool = True,
                 **load_options):
        max_ctx = _one_of("max_ctx", max_ctx, "max_model_len", max_model_len)
        if seed is not None and not (isinstance(seed, int) and seed >= 0):
            raise MemraError(f"seed must be a non-negative integer or None, got {seed!r}")
        # Where a request leaves its seed to us (SamplingParams(seed=None)): drawn from this stream, so
        # LLM(seed=S) repeats a run and LLM() gives fresh draws; each output says which seed it used.
        self._seeds = random.Random(seed if seed is not None else secrets.randbits(64))
        if isinstance(model, (str, Path)):
            from memra.loading.checkpoint import load

            if gpu_memory_utilization is not None:
                load_options["kv_budget"] = KvBudget(fraction=gpu_memory_utilization)
            model = load(model, device=device, dtype=dtype, **load_options)
        elif gpu_memory_utilization is not None or load_options:
            named = "gpu_memory_utilization" if gpu_memory_utilization is not None else next(iter(load_options))
            raise MemraError(f"memra.LLM: {named} applies when LLM loads the model; pass it to memra.load instead")
        if model.tokenizer is None:
            raise MemraError("memra.LLM needs a model with its tokenizer (load it with tokenizer=True)")
        self.model, self.tokenizer = model, model.tokenizer
        ctx = min(max_ctx or model.cfg.max_position, model.cfg.max_position)
        spec = SpecConfig(speculative) if isinstance(speculative, str) else speculative
        self.engine = Engine(model, EngineConfig(max_batch=max_batch, max_ctx=ctx, max_waiting=1 << 30,
                                                 prefill_wait_steps=prefill_wait_steps, prefill_group=prefill_group,
                                                 speculative=spec, prefix_caching=enable_prefix_caching))
        if warm_up:  # as vLLM captures its graphs at start: the first generate() pays no capture or compile
            self.engine.warm_up()

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text (encoded with the model's special tokens,
        e.g. bos), a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]}; `params`
        (or vLLM's name, `sampling_params`) is one SamplingParams for all or one per prompt. A seed of None
        is drawn here (LLM's seed stream), and the output's `seed` says which.
        use_tqdm: a bar of finished prompts on an interactive terminal (never when piped or under CI)."""
        params = _one_of("params", params, "sampling_params", sampling_params)
        batch = [_prompt_text_or_ids(p, k) for k, p in enumerate(_prompt_list(prompts))]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise MemraError(f"generate got {len(plist)} SamplingParams for {len(batch)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise MemraError("generate's sampling_params must be a memra.SamplingParams or a list of them")
        plist = [p if p.seed is not None else dataclasses.replace(p, seed=self._seeds.randrange(1 << 31)) for p in plist]
        ids = [sp.truncate(self.tokenizer.encode(p, add_special=True) if isinstance(p, str) else list(p),
                           self.engine.max_len) for p, sp in zip(batch, plist)]
        for prompt_ids, p in zip(ids, plist):  # every refusal before anything is queued
            self.engine.check_request(prompt_ids, p)
        jobs = self.engine.score_jobs  # prompt_logprobs: each prompt scored as a prompt (memra.engine.scoring)
        scored = [jobs.submit(ScoreJob(tuple(i), None, p.prompt_logprobs)) if p.prompt_logprobs is not None else None
                  for i, p in zip(ids, plist)]
        runs = []
        bar = _progress_bar(sum(p.n for p in plist)) if use_tqdm else None
        for prompt_ids, p in zip(ids, plist):
            choices, rids = [_Choice(TextStream.for_params(self.tokenizer, p)) for _ in range(p.n)], []
            rids += self.engine.submit(prompt_ids, p, self._sink(choices, rids, bar), n=p.n, logprobs=p.logprobs,
                                       eos_ids=self._eos_ids(p))
            runs.append(choices)
        try:
            self.engine.run_until_idle()
        finally:
            if bar is not None:
                bar.close()
        failed = next((c.error for choices in runs for c in choices if c.error), None)
        if failed:
            raise MemraError(failed)
        return [RequestOutput(p if isinstance(p, str) else None, i,
                              [_output(k, c, sp.seed + k) for k, c in enumerate(choices)],
                              None if f is None else [_as_dict(i[k], t) for k, t in enumerate(f.result())],
                              getattr(self.model, "weights_version", 0))
                for p, i, choices, f, sp in zip(batch, ids, runs, scored, plist)]

    def score(self, prompts: Sequence[str] | Sequence[Sequence[int]],
              continuations: Sequence[str] | Sequence[Sequence[int]], top_logprobs: int = 0) -> list[ScoreOutput]:
        """Each continuation's tokens scored after its prompt: the prompt primed as a prompt, the
        continuation stepped as decode steps, so a token gets, bit for bit, the logprob it had when it was
        sampled (memra.engine.scoring). Text prompts are encoded with the special tokens, text
        continuations without; give token ids to score exactly what was generated."""
        if len(prompts) != len(continuations):
            raise MemraError(f"score got {len(prompts)} prompts for {len(continuations)} continuations")
        enc = self.tokenizer.encode
        pairs = [(enc(p, add_special=True) if isinstance(p, str) else list(p),
                  enc(c, add_special=False) if isinstance(c, str) else list(c)) for p, c in zip(prompts, continuations)]
        if any(not p or not c for p, c in pairs):
            raise MemraError("score needs a non-empty prompt and continuation in every pair")
        futures = [self.engine.score_jobs.submit(ScoreJob(tuple(p + c), len(p), top_logprobs)) for p, c in pairs]
        self.engine.run_until_idle()
        outs = []
        for (p, c), f in zip(pairs, futures):
            got = f.result()[len(p):]
            tops = [dict(t.top) for t in got] if top_logprobs else None
            outs.append(ScoreOutput(p, c, [t.logprob for t in got], tops))
        return outs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               stats: GenerationStats | None = None, interrupt: threading.Event | None = None) -> Iterator[str]:
        """One prompt's text as it is generated (what `memra generate` prints), through the same engine.
        Stops at EOS, max_tokens or a stop string (not printed), or between two engine steps once `interrupt`
        is set (finish_reason "abort": `memra chat`'s Ctrl-C); `stats` gets the counts and timings."""
        p = params or SamplingParams()
        if p.n != 1:
            raise MemraError("stream() runs one choice; use generate() for n > 1")
        if p.seed is None:
            p = dataclasses.replace(p, seed=self._seeds.randrange(1 << 31))
        ids = self.tokenizer.encode(prompt, add_special=True) if isinstance(prompt, str) else list(prompt)
        ids = p.truncate(ids, self.engine.max_len)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(ids)
        events: deque[TokenEvent] = deque()
        text = TextStream.for_params(self.tokenizer, p)
        start = time.perf_counter()
        rids = self.engine.submit(ids, p, events.append, logprobs=p.logprobs, eos_ids=self._eos_ids(p))
        first = last = None
        try:
            while stats.finish_reason == "":
                if interrupt is not None and interrupt.is_set():
                    stats.finish_reason = "abort"
                    yield text.finish()
                    break
                if not events and not self.engine.step():
                    break
                while events and stats.finish_reason == "":
                    ev = events.popleft()
                    if ev.error:
                        raise MemraError(ev.error)
                    if ev.token_id is not None:
                        last = time.perf_counter()
                        first = first or last
                        stats.token_ids.append(ev.token_id)
                        stats.cached_tokens = ev.cached_tokens
                        stats.generated_tokens += 1
                        piece = text.push(ev.token_id, stop_token=ev.finish_reason == "stop")
                        if text.stopped:
                            stats.finish_reason = "stop"
                        if piece:
                            yield piece
                    if ev.finish_reason is not None and stats.finish_reason == "":
                        stats.finish_reason = ev.finish_reason
                        yield text.finish()
        finally:  # done, or the reader stopped early: nothing more runs for this prompt
            if first is not None:
                stats.prefill_seconds, stats.decode_seconds = first - start, last - first
            self.engine.cancel(rids)
            self.engine.run_until_idle()

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """generate() over conversations ([{"role", "content"}, ...]) rendered with the chat template;
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) and `tools` ([{"type": "function",
        "function": {...}}]) reach the template; an assistant's tool_calls may carry their arguments as a
        JSON string, as OpenAI clients send them (memra.tools.template_messages). To read calls back from
        an output's text: memra.tools.parse_tool_calls(text, "hermes" | "qwen3_xml" | "llama3_json")."""
        params = _one_of("params", params, "sampling_params", sampling_params)
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else list(conversations)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        ids = [self.tokenizer.encode(self.tokenizer.apply_chat_template(template_messages(list(c)),
                                                                        add_generation_prompt=True, **extra))
               for c in convs]
        return self.generate(ids, params, use_tqdm)

    def update_weights(self, weights, abort: bool = False) -> int:
        """New values for some or all weights, in the checkpoint's own names: a mapping or (name, tensor) pairs
        (e.g. memra.train.Trainer.weights()), or a safetensors file or directory. Checked whole before anything
        changes, copied into the same storage, the prefix cache dropped (memra.weights.update). -> the new
        weights version (RequestOutput.weights_version)."""
        from memra.weights.update import prepare

        fut = self.engine.weight_swaps.submit(prepare(self.model, weights), abort=abort)
        self.engine.run_until_idle()
        return fut.result()

    def get_tokenizer(self):
        """The model's tokenizer (encode, decode, apply_chat_template), as vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    def _eos_ids(self, p: SamplingParams):
        return p.stop_ids(self.tokenizer.eos_ids)

    def _sink(self, choices: list[_Choice], rids: list[str], bar=None):
        """Events of one prompt's choices -> their text; runs on this thread inside run_until_idle, after
        `rids` has been filled in by submit. `bar` (or None) advances as each choice finishes."""
        def take(c: _Choice, ev: TokenEvent) -> None:
            if ev.error:
                c.error, c.finish = ev.error, "abort"
                return
            if ev.token_id is not None:
                c.tokens.append(ev.token_id)
                c.pieces.append(c.text.push(ev.token_id, stop_token=ev.finish_reason == "stop"))
                if ev.logprob is not None:
                    c.logprobs.append(ev.logprob)
                    c.tops.append(dict(ev.top_logprobs))
                if c.text.stopped:
                    c.finish = "stop"
                    self.engine.cancel([rids[ev.index]], finish_reason="stop")
                    return
            if ev.finish_reason is not None:
                c.finish = ev.finish_reason
                c.pieces.append(c.text.finish())

        def sink(ev: TokenEvent) -> None:
            c = choices[ev.index]
            if c.finish is not None:
                return  # after a stop string: the step that was already running
            take(c, ev)
            if bar is not None and c.finish is not None:
                bar.update(1)
        return sink


def _progress_bar(total: int):
    """A tqdm bar of finished choices on an interactive terminal; None when piped or under CI."""
    if not show_progress():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="seq", file=sys.stderr, leave=False)


def _one_of(name: str, value, alias: str, alias_value):
    """memra's name and vLLM's for one argument: either, not both."""
    if value is not None and alias_value is not None and value != alias_value:
        raise MemraError(f"give {name} or {alias}, not both")
    return value if value is not None else alias_value


def _prompt_text_or_ids(p, k: int):
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


def _prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise MemraError("generate needs at least one prompt")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_dict(token: int, t: TokenScore | None) -> dict[int, float] | None:
    return None if t is None else {token: t.logprob, **dict(t.top)}


def _output(index: int, c: _Choice, seed: int | None = None) -> CompletionOutput:
    asked = bool(c.logprobs)
    return CompletionOutput(index, "".join(c.pieces), c.tokens, c.finish or "length",
                            c.logprobs if asked else None, c.tops if asked else None, seed)
