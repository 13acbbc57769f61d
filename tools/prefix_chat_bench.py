"""Measure the prefix cache on a multi-turn chat workload and on n > 1 (CPU or GPU), engine in process.

    python tools/prefix_chat_bench.py [--model demo] [--system-tokens 2048] [--turns 4] [--conversations 32]
                                      [--answer-tokens 32] [--n 8]

Chat: every conversation shares one system prompt; turn t of all conversations is submitted at once (a
wave), each turn's prompt the whole conversation so far rendered with the chat template. The same waves
run on an engine with the prefix cache off and on; each request's TTFT is submit -> first token event.
Reports the hit rate (cached / prompt tokens), prefill tokens, TTFT and wall time, and checks that the
answers are the same. n > 1: one prompt of the system prompt's length with n choices, prefill tokens
with the cache off and on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memra
from memra.engine.engine import Engine
from memra.engine.types import EngineConfig
from memra.sampling import SamplingParams
from memra.server.metrics import Metrics


def run_wave(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list[float]]:
    toks, ttft = [[] for _ in prompts], [None] * len(prompts)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        def sink(ev, i=i):
            if ev.error:
                raise RuntimeError(ev.error)
            if ev.token_id is not None:
                if ttft[i] is None:
                    ttft[i] = time.perf_counter() - t0
                toks[i].append(ev.token_id)
        engine.submit(p, params, sink)
    engine.run_until_idle()
    return toks, ttft


def chat(model, args, on: bool):
    tok = model.tokenizer
    words = open("tests/fixtures/demo_heldout.txt").read().split()
    system, k = "", 0
    while len(tok.encode(system)) < args.system_tokens:
        system += words[k % len(words)] + " "
        k += 1
    metrics = Metrics("bench")
    engine = Engine(model, EngineConfig(max_batch=args.conversations, max_ctx=args.system_tokens + 1024,
                                        token_budget=2048, prefix_caching=on), metrics)
    convs = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    answers, ttfts, t0 = [], [], time.perf_counter()
    for turn in range(args.turns):
        for c, conv in enumerate(convs):
            conv.append({"role": "user", "content": " ".join(words[(37 * c + 11 * turn + j) % len(words)]
                                                             for j in range(12))})
        prompts = [tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True)) for conv in convs]
        out, ttft = run_wave(engine, prompts, SamplingParams(temperature=0.0, max_tokens=args.answer_tokens))
        answers.append(out)
        ttfts += ttft
        for conv, ids in zip(convs, out):
            conv.append({"role": "assistant", "content": tok.decode(ids, skip_special=True).strip()})
    wall = time.perf_counter() - t0
    p = engine.backend.prefix
    queried, served = (p.queried, p.served) if on else (0, 0)
    prefilled = metrics.prompt_tokens._value.get()
    return answers, ttfts, wall, queried, served, prefilled


def choices(model, args, on: bool) -> float:
    metrics = Metrics("bench")
    engine = Engine(model, EngineConfig(max_batch=args.n, max_ctx=args.system_tokens + 64, prefix_caching=on),
                    metrics)
    prompt = [(7 + 31 * j) % model.cfg.vocab_size for j in range(args.system_tokens)]
    engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=1), lambda ev: None, n=args.n)
    engine.run_until_idle()
    return metrics.prompt_tokens._value.get()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = memra.load(args.model)
    runs = {on: chat(model, args, on) for on in (False, True)}
    assert runs[False][0] == runs[True][0], "the answers differ with the prefix cache on"
    for on, (_, ttft, wall, queried, served, prefilled) in runs.items():
        print(f"chat, prefix cache {'on ' if on else 'off'}: {args.conversations} conversations x {args.turns} turns, "
              f"system prompt {args.system_tokens} tokens: prefilled {prefilled:,.0f} tokens, hit rate "
              f"{served / queried if queried else 0:.1%}, TTFT mean {statistics.mean(ttft):.3f}s median "
              f"{statistics.median(ttft):.3f}s, wall {wall:.1f}s")
    off, on = (choices(model, args, x) for x in (False, True))
    print(f"n={args.n}, one {args.system_tokens}-token prompt: prefilled {off:,.0f} tokens off, {on:,.0f} on "
          f"({off - on:,.0f} saved, {(off - on) / off:.1%})")


if __name__ == "__main__":
    main()
