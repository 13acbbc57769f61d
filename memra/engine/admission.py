"""When the scheduler lets waiting requests start (at once, or held a few decode steps so that several
start in one prefill), and in which order (first come first served, or longest output first).

Why hold at all: the prompts that start in one step go through shared forwards (memra.step
.prime_batch; on a GPU with the invariant kernels, one forward takes them all), and such a forward's
cost is mostly fixed: its few hundred kernels are launched one by one from Python where it is not a
captured graph. A step that prefills therefore costs about the same whether one short prompt starts
in it or eight, and it delays the decode of every running row. Under a steady stream of requests
each finishing sequence would otherwise buy its successor a prefilling step of its own.

The rule (TGI's `max_waiting_tokens` in spirit): while rows are decoding and no prefill is planned for
the step anyway, requests that could start are held back until `group` of them can start together
or the first has been held `wait_steps` steps. A step that prefills anyway (a running prompt's next
chunk) lets them all in, since joining its forwards is nearly free. With nothing decoding nothing is
held: an idle engine starts a request at once. Held steps are counted only while some request could
have started (a free place in the running set), so a full batch does not use up the wait.

What holding costs: a held request's time to first token grows by at most `wait_steps` decode steps,
and its place in the batch stays empty meanwhile. What it cannot cost: any bit of any output, since
every request's tokens are the same whichever step it starts in. wait_steps = 0 turns it off.

Measured on an H200 (Llama-3-8B shape, random weights, `memra bench serve` at concurrency 64, 512
requests of 128-256 tokens with 4-40-word prompts; group max(2, 64 / 8) = 8 unless said):
    wait_steps   output tok/s   prefilling steps   TTFT p50 / p99
    0            3,970          331 x 30.1 ms      85 / 523 ms
    8            4,271          122 x 41.9 ms      147 / 460 ms
    16 (16)      4,311          72 x 49.5 ms       199 / 689 ms
    32 (16)      4,333          46 x 56.6 ms       323 / 846 ms
and offline (memra.LLM, the same 512 prompts) 4,219 -> 4,518 tok/s at 8. The engine's default is 8:
most of the gain for about 60 ms of median time to first token. (Those runs predate the grouped decode
attention; after it, offline: 6,548 tok/s at 0, 6,698 at 8.)

Where the mixed step is a captured graph (memra.mixed_graphs) a step that starts requests costs about a
decode step, and the engine's default is 0 there (EngineConfig.grouping): served Llama in one run, 8,353
tok/s at 0 against 8,313 at 8, TTFT p50 80 against 115 ms.

The order (MEMRA_ADMISSION_ORDER): "fcfs" queues a request behind every one that came before it; "lof"
(longest output first, SGLang's --schedule-policy lof) behind every waiting request whose max_tokens is at
least its own, so that the requests that will run longest start first; "auto" (the default) is lof in an
engine that takes a whole run at once (EngineConfig.offline: memra.LLM, so `memra generate` and `memra bench
throughput`) and fcfs in the server, where under steady load lof would keep short requests waiting behind
long ones. Offline, where every request is known at once, lof shortens the tail a long request started late
would leave (a run's last steps decoding a few rows, bound by reading the weights). On the workload of `memra
bench throughput` (1,000 requests, 768 running) it runs 566 decode steps instead of 1,018 beside the same ~475
mixed ones. Alone it gained 0.4% on one H100 (the long contexts were then decoded inside mixed steps, through
the prompt piece's wide block table); with the decode rows on a table of their own (MEMRA_MIXED_DECODE_WIDTH)
10,383 against 9,413 output tok/s in one call (docs/PERFORMANCE.md, admission order). Like the wait, the order
changes no bit of any output: a request's tokens are the same whichever step it starts in and beside whom.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from memra.errors import MemraError


_SETTINGS = {"wait_steps": ("--prefill-wait-steps", 0), "group": ("--prefill-group", 1)}  # flag, least value


@dataclass(frozen=True)
class PrefillGrouping:
    wait_steps: int = 0  # most steps a startable request is held (0: never held)
    group: int = 1  # startable requests that end the hold at once

    def __post_init__(self) -> None:
        for name, (flag, least) in _SETTINGS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise MemraError(f"{flag} must be an integer >= {least}, got {v!r}")

    def holds(self, *, decoding: bool, prefilling: bool, startable: int, held: int) -> bool:
        """Whether this step keeps the waiting requests out. startable: how many could start now (waiting
        ones, up to the free places); held: the steps they have already been held."""
        return (self.wait_steps > 0 and decoding and not prefilling and 0 < startable < self.group
                and held < self.wait_steps)


def enqueue(waiting: deque[str], rid: str, max_tokens_of: Callable[[str], int], longest_first: bool) -> None:
    """Put `rid` in the waiting queue (rids, front first): at its end; or, longest_first, behind every request
    that asks for at least as many tokens as it (equal ones stay in arrival order). Under longest_first the
    queue stays sorted, so a binary search finds the place (a batch of many prompts would be quadratic walked)."""
    if not longest_first:
        waiting.append(rid)
        return
    key = -max_tokens_of(rid)
    waiting.insert(bisect.bisect_right(waiting, key, key=lambda r: -max_tokens_of(r)), rid)
