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
import itertools
import random
import secrets
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Sequence

from memra.engine.engine import Engine
from memra.engine.llm_args import generation_defaults, read_args
from memra.engine.outputs import Choice, OutputBuilder, RequestOutput, ScoreOutput
from memra.engine.prompts import cut_after_final, prompt_list, prompt_text_or_ids
from memra.engine.release import Releasing
from memra.engine.scoring import ScoreJob
from memra.engine.types import EngineConfig, TokenEvent
from memra.errors import MemraError
from memra.generate import GenerationStats
from memra.pools import KvBudget
from memra.sampling import SamplingParams
from memra.settings import show_progress
from memra.spec import SpecConfig
from memra.tokenizer import TextStream
from memra.tools.messages import template_messages


class LLM(Releasing):
    """A model and an engine over it, for offline batches.

    model: a path (HF directory, .gguf, "demo", ORG/NAME from the Hub, "random:SHAPE") or a model
    memra.load returned. It takes vLLM's arguments under vLLM's names (docs/VLLM.md has every one, and what
    memra does with it): max_model_len (= max_ctx), max_num_seqs (= max_batch), max_num_batched_tokens,
    gpu_memory_utilization, enforce_eager, enable_prefix_caching, speculative_config, dtype ("auto"), seed,
    max_logprobs, generation_config; those that cannot change memra's results (trust_remote_code, swap_space,
    ...) are accepted, and those memra cannot honour (tensor_parallel_size > 1, quantization, ...) are
    refused in one line that says what to use instead.
    device: "cuda" where a GPU is present, else "cpu" (vLLM's choice), unless named.
    seed: where a request leaves its seed to LLM (SamplingParams(seed=None)), it is drawn from a stream
    that starts at this seed: 0 by default, as vLLM's, so a script gives the same outputs on every run and
    its unseeded samples differ from each other; None: a fresh stream on every run.
    max_batch: sequences decoded together; max_ctx: prompt + completion tokens per sequence (default the
    model's context). The engine's caches take at most the model's KV budget (memra.load's kv_budget).
    warm_up: pay kernel compilation and (on a GPU) every batch bucket's graph capture now (Engine.warm_up).
    prefill_wait_steps, prefill_group: hold a request that could start while others decode, so that several
    start in one prefill (memra.engine.admission; EngineConfig's defaults). prefill_budget: prompt tokens a
    step takes apart from its decode rows (memra.engine.scheduler's split budget; 0: they share one budget;
    None: EngineConfig.split_budget: at max_batch >= 256 where mixed steps are captured graphs, their largest
    prompt bucket, 512 unless MEMRA_MIXED_TOKENS raises it; else shared).
    speculative: draft-and-verify decoding, "mtp" or "ngram" (draft length 4) or a memra.spec.SpecConfig;
    the outputs are the same tokens and logprobs as without it (E4), only the speed changes.
    enable_prefix_caching: reuse the primed pages of earlier prompts (vLLM's name; memra.prefix, promise E8:
    the same tokens and logprobs, bit for bit, as without it). Prompts and n > 1 choices that share a prefix
    prime it once.
    """

    def __init__(self, model, device: str | None = None, dtype: str | None = "auto", *, max_batch: int | None = None,
                 max_ctx: int | None = None, warm_up: bool = True,
                 prefill_wait_steps: int | None = None, prefill_group: int | None = None, prefill_budget: int | None = None,
                 speculative: str | SpecConfig | None = None, max_model_len: int | None = None,
                 seed: int | None = 0, gpu_memory_utilization: float | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = False, tokenizer: str | None = None, speculative_config: dict | None = None,
                 max_logprobs: int = 20, generation_config: str | None = "auto", **options):
        max_ctx = _one_of("max_ctx", max_ctx, "max_model_len", max_model_len)
        max_batch = _one_of("max_batch", max_batch, "max_num_seqs", max_num_seqs) or 64
        if seed is not None and not (type(seed) is int and seed >= 0):
            raise MemraError(f"LLM(seed=...) must be a non-negative integer or None, got {seed!r}")
        args = read_args(options, dtype=dtype, tokenizer=tokenizer, model=model, enforce_eager=enforce_eager,
                         max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
                         speculative_config=speculative_config, max_logprobs=max_logprobs,
                         generation_config=generation_config)
        # Where a request leaves its seed to us (SamplingParams(seed=None)): drawn from this stream, so
        # LLM(seed=S) repeats a run and LLM(seed=None) gives fresh draws; each output says which seed it used.
        self._seeds = random.Random(seed if seed is not None else secrets.randbits(64))
        self._request_ids = itertools.count()
        self._max_logprobs = args.max_logprobs
        self._owns_model = isinstance(model, (str, Path))  # close() then gives the weights back too
        model = self._model(model, device, args.load_options, gpu_memory_utilization, enforce_eager)
        if model.tokenizer is None:
            raise MemraError("memra.LLM needs a model with its tokenizer (load it with tokenizer=True)")
        self.model, self.tokenizer = model, model.tokenizer
        self._outputs = OutputBuilder(self.tokenizer)
        self._defaults = generation_defaults(model.source, generation_config)
        ctx = min(max_ctx or model.cfg.max_position, model.cfg.max_position)
        budget = {} if args.token_budget is None else {"token_budget": args.token_budget}
        self.engine = Engine(model, EngineConfig(max_batch=max_batch, max_ctx=ctx, max_waiting=1 << 30,
                                                 prefill_wait_steps=prefill_wait_steps, prefill_group=prefill_group,
                                                 prefill_budget=prefill_budget,
                                                 speculative=args.speculative, prefix_caching=enable_prefix_caching,
                                                 offline=True, **budget))
        if warm_up:  # as vLLM captures its graphs at start: the first generate() pays no capture or compile
            self.engine.warm_up()

    @staticmethod
    def _model(model, device, load_options: dict, gpu_memory_utilization, enforce_eager: bool):
        """The model: loaded here from a path (with the options that shape loading), or given loaded."""
        if not isinstance(model, (str, Path)):
            given = {"gpu_memory_utilization": gpu_memory_utilization is not None, "enforce_eager": enforce_eager,
                     "device": device not in (None, "auto", str(model.device), model.device.type),
                     **{k: v is not None for k, v in load_options.items()}}  # dtype "auto" arrives as None
            named = next((k for k, on in given.items() if on), None)
            if named is not None:
                raise MemraError(f"LLM({named}=...) applies when LLM loads the model; pass it to memra.load instead")
            return model
        import torch

        from memra.loading.checkpoint import load
        from memra.settings import Settings

        if gpu_memory_utilization is not None:
            load_options["kv_budget"] = KvBudget(fraction=gpu_memory_utilization)
        if enforce_eager:  # vLLM's: decode steps launched one kernel at a time (MEMRA_CUDA_GRAPHS=0)
            settings = load_options.get("settings") or Settings.from_env()
            load_options["settings"] = dataclasses.replace(settings, cuda_graphs=False)
        if device is None or device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return load(model, device=device, **load_options)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate uses where it gets no SamplingParams: vLLM's defaults, over which the model's
        generation_config.json sets its own (LLM's generation_config="auto", as vLLM)."""
        return SamplingParams(**self._defaults)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text (encoded with the model's special tokens,
        e.g. bos), a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]}; `params`
        (or vLLM's name, `sampling_params`) is one SamplingParams for all or one per prompt (none: the
        model's defaults, get_default_sampling_params). A seed of None is drawn here (LLM's seed stream),
        and the output's `seed` says which; max_tokens None runs to the end of the context.
        use_tqdm: a bar of finished sequences on an interactive terminal (never when piped or under CI); a
        callable (vLLM's, e.g. functools.partial(tqdm, leave=True)) makes the bar, wherever the output goes."""
        if lora_request is not None:
            raise MemraError("LLM.generate(lora_request=...) is not supported: memra serves no adapters; merge the "
                             "LoRA into the weights first")
        params = _one_of("params", params, "sampling_params", sampling_params)
        batch = [prompt_text_or_ids(p, k) for k, p in enumerate(prompt_list(prompts))]
        params = params if params is not None else self.get_default_sampling_params()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise MemraError(f"LLM.generate got {len(plist)} SamplingParams for {len(batch)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise MemraError("LLM.generate's sampling_params must be a memra.SamplingParams or a list of them")
        ids = [sp.truncate(self.tokenizer.encode(p, add_special=True) if isinstance(p, str) else list(p),
                           self.engine.max_len) for p, sp in zip(batch, plist)]
        plist = [self._settle(p, len(i)) for p, i in zip(plist, ids)]
        for prompt_ids, p in zip(ids, plist):  # every refusal before anything is queued
            self.engine.check_request(prompt_ids, p)
        jobs = self.engine.score_jobs  # prompt_logprobs: each prompt scored as a prompt (memra.engine.scoring)
        scored = [jobs.submit(ScoreJob(tuple(i), None, p.prompt_logprobs)) if p.prompt_logprobs is not None else None
                  for i, p in zip(ids, plist)]
        runs, arrivals = [], []
        bar = _progress_bar(sum(p.n for p in plist), use_tqdm)
        for prompt_ids, p in zip(ids, plist):
            choices, rids = [Choice(TextStream.for_params(self.tokenizer, p)) for _ in range(p.n)], []
            arrivals.append(time.time())
            rids += self.engine.submit(prompt_ids, p, self._sink(choices, rids, p, bar), n=p.n, logprobs=p.logprobs,
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
        out = self._outputs
        return [RequestOutput(str(next(self._request_ids)), p if isinstance(p, str) else None, i,
                              None if f is None else out.prompt_logprobs(i, f.result(), sp.detokenize),
                              [out.completion(k, c, sp.seed + k, sp.detokenize) for k, c in enumerate(choices)],
                              metrics=out.metrics(at, choices), num_cached_tokens=choices[0].cached,
                              weights_version=getattr(self.model, "weights_version", 0))
                for p, i, choices, f, sp, at in zip(batch, ids, runs, scored, plist, arrivals)]

    def _settle(self, p: SamplingParams, prompt_len: int) -> SamplingParams:
        """A request's params as the engine takes them: a seed drawn from LLM's stream where none was
        given, max_tokens None -> the rest of the context, logprobs held to LLM's max_logprobs."""
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(p, name) or 0) > self._max_logprobs:
                raise MemraError(f"SamplingParams({name}={getattr(p, name)}) is over LLM(max_logprobs="
                                 f"{self._max_logprobs}); ask for fewer, or raise max_logprobs")
        if p.seed is None:
            p = dataclasses.replace(p, seed=self._seeds.randrange(1 << 31))
        if p.max_tokens is None:
            p = dataclasses.replace(p, max_tokens=max(1, self.engine.max_len - prompt_len))
        return p

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
        p = params or self.get_default_sampling_params()
        if p.n != 1:
            raise MemraError("stream() runs one choice; use generate() for n > 1")
        ids = self.tokenizer.encode(prompt, add_special=True) if isinstance(prompt, str) else list(prompt)
        ids = p.truncate(ids, self.engine.max_len)
        p = self._settle(p, len(ids))
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
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, lora_request=None,
             chat_template: str | None = None, chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """generate() over conversations ([{"role", "content"}, ...]) rendered with the chat template;
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) and `tools` ([{"type": "function",
        "function": {...}}]) reach the template; an assistant's tool_calls may carry their arguments as a
        JSON string, as OpenAI clients send them (memra.tools.template_messages). To read calls back from
        an output's text: memra.tools.parse_tool_calls(text, "hermes" | "qwen3_xml" | "llama3_json").
        continue_final_message (vLLM's): the last message is an assistant's to be continued, so the prompt
        ends with its content, without the end-of-turn the template would write after it."""
        if chat_template is not None:
            raise MemraError("LLM.chat(chat_template=...) is not supported: memra renders the model's own template; "
                             "put yours in the model folder as chat_template.jinja")
        if chat_template_content_format not in ("auto", "string"):
            raise MemraError(f"LLM.chat(chat_template_content_format={chat_template_content_format!r}) is not "
                             "supported: memra passes message content to the template as text ('auto')")
        if continue_final_message and add_generation_prompt:
            raise MemraError("LLM.chat: continue_final_message=True needs add_generation_prompt=False (as in vLLM)")
        params = _one_of("params", params, "sampling_params", sampling_params)
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else list(conversations)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        texts = []
        for c in convs:
            messages = template_messages(list(c))
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
            texts.append(cut_after_final(text, messages) if continue_final_message else text)
        # encoded without added specials (the template writes them); each output's prompt is the rendered text
        outs = self.generate([self.tokenizer.encode(t) for t in texts], params, use_tqdm, lora_request=lora_request)
        return [dataclasses.replace(o, prompt=t) for o, t in zip(outs, texts)]

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

    def _sink(self, choices: list[Choice], rids: list[str], p: SamplingParams, bar=None):
        """Events of one prompt's choices -> their text; runs on this thread inside run_until_idle, after
        `rids` has been filled in by submit. `bar` (or None) advances as each choice finishes."""
        eos = frozenset(self.tokenizer.eos_ids)

        def take(c: Choice, ev: TokenEvent) -> None:
            if ev.error:
                c.error, c.finish = ev.error, "abort"
                return
            if ev.token_id is not None:
                c.last_token_time = time.time()
                c.first_token_time = c.first_token_time or c.last_token_time
                c.cached = ev.cached_tokens
                c.tokens.append(ev.token_id)
                c.pieces.append(c.text.push(ev.token_id, stop_token=ev.finish_reason == "stop"))
                if ev.logprob is not None:
                    c.logprobs.append((ev.logprob, ev.rank, ev.top_logprobs))
                if c.text.stopped:
                    c.finish, c.stop_reason, c.finished_time = "stop", c.text.stop_string, time.time()
                    self.engine.cancel([rids[ev.index]], finish_reason="stop")
                    return
            if ev.finish_reason is not None:
                c.finish, c.finished_time = ev.finish_reason, time.time()
                last = c.tokens[-1] if c.tokens else None
                if ev.finish_reason == "stop" and last in p.stop_token_ids and (p.ignore_eos or last not in eos):
                    c.stop_reason = last  # vLLM's: a stop token's id; None where EOS ended it
                c.pieces.append(c.text.finish())

        def sink(ev: TokenEvent) -> None:
            c = choices[ev.index]
            if c.finish is not None:
                return  # after a stop string: the step that was already running
            take(c, ev)
            if bar is not None and c.finish is not None:
                bar.update(1)
        return sink


def _progress_bar(total: int, use_tqdm):
    """A tqdm bar of finished choices: use_tqdm's own (a callable), or on an interactive terminal tqdm's;
    None when use_tqdm is off, or when piped or under CI."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="generate", unit="seq")
    if not use_tqdm or not show_progress():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="seq", file=sys.stderr, leave=False)


def _one_of(name: str, value, alias: str, alias_value):
    """memra's name and vLLM's for one argument: either, not both."""
    if value is not None and alias_value is not None and value != alias_value:
        raise MemraError(f"give {name} or {alias}, not both")
    return value if value is not None else alias_value
