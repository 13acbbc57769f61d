"""B > 1 decode of one GGUF on the CPU, for `memra bench model --gguf FILE --batch B`: memra beside
llama.cpp's batched decode (memra.bench.gguf_file runs each in a process of its own).

Row i's prompt is ids 10+i .. 25+i (row 0 is the B=1 run's prompt), greedy, `tokens` new tokens a row.
The rate is the batch's: tokens every row produced after the last row's first one (the prefill's end),
over the time from that moment to the last token.
- memra: B sequences submitted at once to memra.LLM's engine (max_batch=B): each step one forward of B
  rows, each row's bits its B=1 bits (the exactness gate; tests/test_cpu_gdn.py and test_cpu_decode.py
  hold them on CPU); row 0's tokens are returned, so the report can set them beside the B=1 run's.
- llama.cpp: llama-cpp-python's low-level API, B sequences in one llama_batch per step (its
  `llama-batched-bench` loop), argmax of each row's logits. Its rows are not batch-invariant.
"""

from __future__ import annotations

import ctypes
import time

PROMPT0 = 10


def prompts(batch: int) -> list[list[int]]:
    return [list(range(PROMPT0 + i, PROMPT0 + 16 + i)) for i in range(batch)]


def batch_rate(first: list[float], times: list[float]) -> float | None:
    """Tokens after every row's first one, over the time from then to the last."""
    start = max(first)
    after = [t for t in times if t > start]
    return len(after) / (after[-1] - start) if after and after[-1] > start else None


def memra_batch(path: str, tokens: int, batch: int) -> dict:
    import memra

    rows = prompts(batch)
    llm = memra.LLM(path, device="cpu", max_batch=batch, max_ctx=len(rows[0]) + tokens + 1)
    times: list[float] = []
    firsts: dict[int, float] = {}
    row0: list[int] = []

    def reader(i):
        def on(ev):
            if ev.token_id is None:
                return
            now = time.perf_counter()
            times.append(now)
            firsts.setdefault(i, now)
            if i == 0:
                row0.append(ev.token_id)
        return on

    for i, p in enumerate(rows):
        llm.engine.submit(p, memra.SamplingParams(max_tokens=tokens, temperature=0.0), reader(i))
    llm.engine.run_until_idle()
    return dict(tok_s=batch_rate(list(firsts.values()), sorted(times)), row0=row0)


def llama_cpp_batch(path: str, tokens: int, batch: int, threads: int) -> dict:
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(path.encode(), mp)
    rows = prompts(batch)
    cp = lc.llama_context_default_params()
    cp.n_ctx = batch * (len(rows[0]) + tokens + 8)
    cp.n_batch = cp.n_ubatch = max(512, batch * len(rows[0]))
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = batch, threads, threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    b = lc.llama_batch_init(batch * len(rows[0]), 0, 1)

    def step(entries):  # [(seq, pos, token, wants logits)] -> one llama_decode
        for j, (s, pos, tok, out) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, out
            b.seq_id[j][0] = s
        b.n_tokens = len(entries)
        if lc.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(j):
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).argmax())

    step([(s, p, t, p == len(r) - 1) for s, r in enumerate(rows) for p, t in enumerate(r)])
    nxt = [argmax((s + 1) * len(rows[0]) - 1) for s in range(batch)]
    row0, start = [nxt[0]], time.perf_counter()
    for k in range(tokens - 1):
        step([(s, len(rows[0]) + k, nxt[s], True) for s in range(batch)])
        nxt = [argmax(s) for s in range(batch)]
        row0.append(nxt[0])
    elapsed = time.perf_counter() - start
    lc.llama_batch_free(b)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return dict(tok_s=batch * (tokens - 1) / elapsed if elapsed > 0 else None, row0=row0)
