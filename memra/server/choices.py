"""One HTTP request's choices: the engine's token events turned into OpenAI response bodies.

    engine thread --events--> TextWorker thread --deltas--> the request's event loop --> bodies
                               (detokenize, stop strings)

The engine thread hands each event to the server's one `TextWorker` and goes on. That thread turns
token ids into text with each choice's `TextStream` (whole characters; stop strings matched in time
linear in the text, memra.tokenizer.stops) and hands the finished delta to the request's event loop,
which only formats and sends it. A choice whose text reached a stop string ends with finish_reason
"stop" and its sequence is cancelled at the engine's next step (later events for it are dropped). So
neither the engine thread nor the event loop spends time on text.

A request ends one of four ways, and each gives the client a complete answer:
- every choice finished: a JSON body, or the stream's last chunks, usage and `data: [DONE]`;
- an engine abort with an error: a 503 (shutdown) / 400 (refused) / 500 (engine) body, or in a stream
  an error event and then `data: [DONE]`;
- the client went away (a stream's write failed, or a non-streaming client closed its connection):
  every sequence is cancelled and freed at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from memra.engine.engine import TokenEvent
from memra.sampling import SamplingParams
from memra.server.reasoning import ReasoningSplitter
from memra.server.errors import error_response
from memra.server.scored import ScoredReply, text_offsets, token_text
from memra.server.tools import ChoiceCalls, assembled
from memra.tokenizer import TextStream

_ERROR_STATUS = {"shutdown": 503, "refused": 400, "engine": 500}


@dataclass(frozen=True)
class Delta:
    """What one event adds to one choice."""

    index: int
    text: str
    event: TokenEvent
    finish_reason: str | None  # the event's, or "stop" when the text reached a stop string
    reasoning: str = ""  # with a reasoning parser: the part of the text that is reasoning (memra.server.reasoning)
    tool_calls: tuple = ()  # with tools: tool-call deltas in OpenAI's shape (memra.server.tools)


@dataclass(frozen=True)
class ReplyHeader:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    logprobs: bool  # the client asked for logprobs
    as_ids: bool = False  # return_tokens_as_token_ids
    scored: ScoredReply | None = None  # echo / prompt_logprobs (memra.server.scored)
    n: int = 1  # choices per prompt


class TextWorker:
    """The one thread that makes every request's text (module docstring). Events of one request are
    handled in the order the engine sent them, so each TextStream sees its tokens in order. It takes
    whatever has queued up at once and hands the results to each event loop in one call, so a decode
    step of B rows costs one wake-up of the loop, not B."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="memra-text", daemon=True)
        self._thread.start()

    def put(self, outputs: "RequestOutputs", ev: TokenEvent) -> None:  # called on the engine thread
        self._jobs.put((outputs, ev))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while not self._jobs.empty():
                jobs.append(self._jobs.get_nowait())
            ready: dict[asyncio.AbstractEventLoop, list] = {}
            for job in jobs:
                if job is None:
                    self._deliver(ready)
                    return
                outputs, ev = job
                delta = self._process(outputs, ev)
                if delta is not None:
                    ready.setdefault(outputs.loop, []).append((outputs.queue, delta))
            self._deliver(ready)

    @staticmethod
    def _process(outputs: "RequestOutputs", ev: TokenEvent) -> "Delta | None":
        try:
            return outputs.process(ev)
        except Exception:  # a bug in one request's text must not end the others': its client gets a 500
            print("memra serve: text worker failed on one event:", file=sys.stderr)
            traceback.print_exc()
            failed = dataclasses.replace(ev, token_id=None, finish_reason="abort", error_kind="engine",
                                         error="internal error making the text; the server log has the details")
            return Delta(ev.index, "", failed, "abort")

    @staticmethod
    def _deliver(ready: dict) -> None:
        for loop, items in ready.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is left to read these
                pass


def _put_all(items: list) -> None:
    for q, delta in items:
        q.put_nowait(delta)


class RequestOutputs:
    """Events from the engine thread in, per-choice deltas out on the request's event loop; the text is
    made on the TextWorker's thread (`process`)."""

    def __init__(self, engine, tok, params: SamplingParams, choices: int, worker: TextWorker,
                 reasoning: Callable[[], ReasoningSplitter] | None = None, include_reasoning: bool = True,
                 calls: list[ChoiceCalls] | None = None):
        self.engine, self.tok, self.worker = engine, tok, worker
        # with a reasoning parser: each choice's splitter; include_reasoning false drops the reasoning
        self.splitters = [reasoning() for _ in range(choices)] if reasoning is not None else None
        self.include_reasoning = include_reasoning
        self.calls = calls  # with tools: each choice's call parser, fed the content (after the reasoning)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.streams = [TextStream.for_params(tok, params) for _ in range(choices)]
        self.ended = [False] * choices  # the text thread's view: no more deltas for this choice
        self.tokens = [0] * choices  # completion tokens each choice delivered
        self.cached = [0] * choices  # prompt tokens of each choice served from the prefix cache
        self.rids: list[str] = []  # the engine's sequence of choice i is rids[i]
        self.open = choices  # the event loop's view: choices whose last delta has not arrived

    def sink_for(self, offset: int):
        """The sink of one prompt's choices, which the engine numbers from 0: ours start at `offset`."""
        def sink(ev: TokenEvent) -> None:  # called on the engine thread: hand over, nothing else
            self.worker.put(self, ev if not offset else _shift(ev, offset))
        return sink

    def process(self, ev: TokenEvent) -> Delta | None:
        """One event -> what it adds to its choice (None: nothing). Runs on the text thread."""
        i = ev.index
        if self.ended[i]:  # after a stop string: what the engine sent before our cancel reached it
            return None
        stream = self.streams[i]
        if ev.token_id is None:  # ended without a token: an abort, with or without an error
            self.ended[i] = True
            return self._delta(i, "" if ev.error else stream.finish(), ev, ev.finish_reason)
        self.tokens[i] += 1
        self.cached[i] = ev.cached_tokens
        text, finish = stream.push(ev.token_id, stop_token=ev.finish_reason == "stop"), ev.finish_reason
        if stream.stopped:
            if finish is None:
                self.engine.cancel([self.rids[i]], finish_reason="stop")
            finish = "stop"
        if finish is not None:
            text += stream.finish()
            self.ended[i] = True
        return self._delta(i, text, ev, finish)

    def _delta(self, i: int, text: str, ev: TokenEvent, finish: str | None) -> Delta:
        """The delta of choice i, its text split into reasoning and content where a parser is on, and its
        content into text and tool calls where tools are."""
        reasoning, calls = "", ()
        if self.splitters is not None:
            reasoning, text = self.splitters[i].push(text)
            if finish is not None:
                r, c = self.splitters[i].finish()
                reasoning, text = reasoning + r, text + c
            reasoning = reasoning if self.include_reasoning else ""
        if self.calls is not None:
            text, calls, finish = self.calls[i].push(text, finish)
        return Delta(i, text, ev, finish, reasoning, tuple(calls))

    async def deltas(self) -> AsyncIterator[Delta]:
        while self.open:
            d = await self.queue.get()
            if d.finish_reason is not None:
                self.open -= 1
            yield d

    def ready(self) -> bool:
        """Whether another delta is already waiting (a stream then sends them in one write)."""
        return not self.queue.empty()

    def cancel_open(self) -> None:
        """The client is gone (or the answer is complete): nothing more runs for the choices left."""
        left = [rid for rid, ended in zip(self.rids, self.ended) if not ended]
        if left:
            self.engine.cancel(left)

    # --- a whole (non-streaming) answer ---
    async def whole(self, request: Request, head: ReplyHeader) -> Response:
        """The complete body, or an error body; cancels everything if the client leaves meanwhile."""
        return await self.until_done(request, self._collect(head))

    async def until_done(self, request: Request, work) -> Response:
        """`work` (a coroutine that reads `deltas()` to the end and makes the body), or a 499 where the
        client leaves first; either way nothing is left running on the engine."""
        collect = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
            self.cancel_open()
        if collect.cancelled() or not collect.done():
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        return collect.result()

    async def _collect(self, head: ReplyHeader) -> Response:
        n = len(self.streams)
        texts, logs, finish = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        thoughts, calls = [[] for _ in range(n)], [[] for _ in range(n)]
        version = 0
        async for d in self.deltas():
            version = max(version, d.event.weights_version)
            if d.event.error:
                return error_response(_ERROR_STATUS.get(d.event.error_kind, 500), d.event.error)
            texts[d.index].append(d.text)
            thoughts[d.index].append(d.reasoning)
            calls[d.index].extend(d.tool_calls)
            if d.event.token_id is not None:
                logs[d.index].append(d.event)
            finish[d.index] = d.finish_reason
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            lp = logprobs_body(self.tok, logs[i], head.chat, head.as_ids) if head.logprobs else None
            if head.chat:
                message = {"role": "assistant", "content": text}
                if self.splitters is not None:  # vLLM's shape: null where a part is empty
                    message = {"role": "assistant", "content": text or None,
                               "reasoning_content": "".join(thoughts[i]) or None}
                if calls[i]:  # OpenAI's shape: content null where the answer is only calls
                    message.update(content=text or None, tool_calls=assembled(calls[i]))
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
            if head.scored is not None:
                head.scored.extend(self.tok, choices[-1], i)
        return JSONResponse(reply_body(head, choices, self._usage(head), version))

    def _usage(self, head: ReplyHeader) -> dict:
        done = sum(self.tokens)
        # each prompt counts once, whatever its n (its choices share one prime): so do its cached tokens
        cached = sum(self.cached[i] for i in range(0, len(self.cached), head.n))
        return {"prompt_tokens": head.prompt_tokens, "completion_tokens": done,
                "total_tokens": head.prompt_tokens + done, "prompt_tokens_details": {"cached_tokens": cached}}

    # --- a stream of server-sent events ---
    async def events(self, head: ReplyHeader, include_usage: bool,
                     on_first_token: Callable[[], None] | None = None) -> AsyncIterator[str]:
        """The SSE body. Deltas that are already waiting go out in one write (a client that fell behind
        catches up without one write per token). on_first_token: called once, when the first token's
        delta reaches this loop (the server's HTTP-side TTFT)."""
        kind = "chat.completion.chunk" if head.chat else "text_completion"
        # every chunk repeats these fields: serialized once (a stream sends one chunk per token)
        fixed = json.dumps({"id": head.id, "object": kind, "created": head.created, "model": head.model})[:-1]

        def chunk(choices, **extra) -> str:
            rest = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
            return f"data: {fixed}, \"choices\": {json.dumps(choices)}{rest}}}\n\n"

        def message(d: Delta) -> str:
            ev = d.event
            if ev.error:
                status = _ERROR_STATUS.get(ev.error_kind, 500)
                kind_name = "invalid_request_error" if status < 500 else "server_error"
                return "data: " + json.dumps({"error": {"message": ev.error, "type": kind_name, "param": None,
                                                        "code": status}}) + "\n\n"
            if ev.token_id is None and not (d.text or d.reasoning or d.tool_calls) \
                    and d.finish_reason not in ("stop", "length", "tool_calls"):
                return ""  # an abort without words: nothing to tell
            version = {"system_fingerprint": fingerprint(ev.weights_version)} if ev.token_id is not None else {}
            lp = (logprobs_body(self.tok, [ev], head.chat, head.as_ids, emitted[d.index])
                  if head.logprobs and ev.token_id is not None else None)
            emitted[d.index] += len(d.text)
            if head.chat:
                delta = {"reasoning_content": d.reasoning} if d.reasoning else {}
                if d.text or (d.finish_reason is None and not d.reasoning and not d.tool_calls):
                    delta["content"] = d.text
                if d.tool_calls:
                    delta["tool_calls"] = list(d.tool_calls)
                return chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}], **version)
            return chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}], **version)

        emitted = [0] * len(self.streams)  # characters each choice has sent: its next token's text_offset
        try:
            if head.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(self.streams))])
            pending: list[str] = []
            async for d in self.deltas():
                if on_first_token is not None and d.event.token_id is not None:
                    on_first_token()
                    on_first_token = None
                pending.append(message(d))
                if not self.ready():
                    yield "".join(pending)
                    pending.clear()
            if include_usage:
                pending.append(chunk([], usage=self._usage(head)))
            yield "".join(pending) + "data: [DONE]\n\n"
        finally:  # the client went away (a write failed), or we are done: nothing more runs for this request
            self.cancel_open()


def reply_body(head: ReplyHeader, choices: list[dict], usage: dict, weights_version: int = 0) -> dict:
    """weights_version: the weights that answered (memra.weights), as OpenAI's system_fingerprint."""
    body = {"id": head.id, "object": "chat.completion" if head.chat else "text_completion", "created": head.created,
            "model": head.model, "system_fingerprint": fingerprint(weights_version), "choices": choices, "usage": usage}
    if head.chat and head.scored is not None and head.scored.prompt_top is not None:  # vLLM: the response's
        body["prompt_logprobs"] = [c.pop("prompt_logprobs") for c in choices][0]
    return body


def fingerprint(weights_version: int) -> str:
    """OpenAI's system_fingerprint: which weights answered (0 as loaded, +1 per update_weights)."""
    return f"memra-weights-{weights_version}"


def logprobs_body(tok, events: list[TokenEvent], chat: bool, as_ids: bool = False, base: int = 0):
    """The generated tokens' logprobs object; `base`: the first token's text_offset."""
    events = [e for e in events if e.token_id is not None and e.logprob is not None]
    if chat:
        def entry(tid: int, lp: float) -> dict:
            s = token_text(tok, tid, as_ids)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top_logprobs]}
                            for e in events]}
    return {"tokens": [token_text(tok, e.token_id, as_ids) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{token_text(tok, t, as_ids): v for t, v in e.top_logprobs} for e in events],
            "text_offset": text_offsets(tok, [e.token_id for e in events], base)}


def _shift(ev: TokenEvent, offset: int) -> TokenEvent:
    return dataclasses.replace(ev, index=ev.index + offset)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection. The body has been read, so the only message
    left to receive is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
