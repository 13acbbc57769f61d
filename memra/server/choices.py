"""One HTTP request's choices: the engine's token events turned into OpenAI response bodies.

The engine thread hands each sequence's events to `RequestOutputs.sink`, which only moves them onto
the request's event loop. There each choice's `TextStream` turns token ids into text and watches for
stop strings (linear in the text, memra.tokenizer.stops); a choice whose text reached one ends with
finish_reason "stop" and its sequence is cancelled at the engine's next step (later events for it are
dropped). So the engine thread never touches text.

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
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from memra.server.engine import TokenEvent
from memra.server.errors import error_response
from memra.tokenizer import TextStream

_ERROR_STATUS = {"shutdown": 503, "refused": 400, "engine": 500}


@dataclass(frozen=True)
class Delta:
    """What one event adds to one choice."""

    index: int
    text: str
    event: TokenEvent
    finish_reason: str | None  # the event's, or "stop" when the text reached a stop string


@dataclass(frozen=True)
class ReplyHeader:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    logprobs: bool  # the client asked for logprobs


class RequestOutputs:
    """Events from the engine thread in, per-choice deltas out, on the request's event loop."""

    def __init__(self, engine, tok, stops: tuple[str, ...], choices: int):
        self.engine, self.tok = engine, tok
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.streams = [TextStream(tok, stops) for _ in range(choices)]
        self.ended = [False] * choices
        self.tokens = [0] * choices  # completion tokens each choice delivered
        self.rids: list[str] = []  # the engine's sequence of choice i is rids[i]

    def sink_for(self, offset: int):
        """The sink of one prompt's choices, which the engine numbers from 0: ours start at `offset`."""
        def sink(ev: TokenEvent) -> None:  # called on the engine thread: hand over, nothing else
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev if not offset else _shift(ev, offset))
        return sink

    @property
    def open(self) -> int:
        return self.ended.count(False)

    async def deltas(self) -> AsyncIterator[Delta]:
        while self.open:
            ev = await self.queue.get()
            i = ev.index
            if self.ended[i]:  # after a stop string: what the engine sent before our cancel reached it
                continue
            stream = self.streams[i]
            if ev.token_id is None:  # ended without a token: an abort, with or without an error
                self.ended[i] = True
                yield Delta(i, "" if ev.error else stream.finish(), ev, ev.finish_reason)
                continue
            self.tokens[i] += 1
            text, finish = stream.push(ev.token_id), ev.finish_reason
            if stream.stopped:
                if finish is None:
                    self.engine.cancel([self.rids[i]], finish_reason="stop")
                finish = "stop"
            if finish is not None:
                text += stream.finish()
                self.ended[i] = True
            yield Delta(i, text, ev, finish)

    def cancel_open(self) -> None:
        """The client is gone (or the answer is complete): nothing more runs for the choices left."""
        left = [rid for rid, ended in zip(self.rids, self.ended) if not ended]
        if left:
            self.engine.cancel(left)

    # --- a whole (non-streaming) answer ---
    async def whole(self, request: Request, head: ReplyHeader) -> Response:
        """The complete body, or an error body; cancels everything if the client leaves meanwhile."""
        collect = asyncio.ensure_future(self._collect(head))
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
        async for d in self.deltas():
            if d.event.error:
                return error_response(_ERROR_STATUS.get(d.event.error_kind, 500), d.event.error)
            texts[d.index].append(d.text)
            if d.event.token_id is not None:
                logs[d.index].append(d.event)
            finish[d.index] = d.finish_reason
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            lp = logprobs_body(self.tok, logs[i], head.chat) if head.logprobs else None
            if head.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        return JSONResponse({"id": head.id, "object": "chat.completion" if head.chat else "text_completion",
                             "created": head.created, "model": head.model, "choices": choices,
                             "usage": self._usage(head)})

    def _usage(self, head: ReplyHeader) -> dict:
        done = sum(self.tokens)
        return {"prompt_tokens": head.prompt_tokens, "completion_tokens": done,
                "total_tokens": head.prompt_tokens + done}

    # --- a stream of server-sent events ---
    async def events(self, head: ReplyHeader, include_usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if head.chat else "text_completion"

        def chunk(choices, **extra) -> str:
            return "data: " + json.dumps({"id": head.id, "object": kind, "created": head.created, "model": head.model,
                                          "choices": choices, **extra}) + "\n\n"

        try:
            if head.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(self.streams))])
            async for d in self.deltas():
                ev = d.event
                if ev.error:
                    status = _ERROR_STATUS.get(ev.error_kind, 500)
                    kind_name = "invalid_request_error" if status < 500 else "server_error"
                    yield "data: " + json.dumps({"error": {"message": ev.error, "type": kind_name, "param": None,
                                                           "code": status}}) + "\n\n"
                    continue
                if ev.token_id is None and not d.text and d.finish_reason not in ("stop", "length"):
                    continue  # an abort without words: nothing to tell
                lp = logprobs_body(self.tok, [ev], head.chat) if head.logprobs and ev.token_id is not None else None
                if head.chat:
                    delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                    yield chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}])
                else:
                    yield chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}])
            if include_usage:
                yield chunk([], usage=self._usage(head))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (a write failed), or we are done: nothing more runs for this request
            self.cancel_open()


def logprobs_body(tok, events: list[TokenEvent], chat: bool):
    events = [e for e in events if e.token_id is not None and e.logprob is not None]
    if chat:
        def entry(tid: int, lp: float) -> dict:
            s = tok.decode([tid])
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top_logprobs]}
                            for e in events]}
    return {"tokens": [tok.decode([e.token_id]) for e in events], "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{tok.decode([t]): v for t, v in e.top_logprobs} for e in events],
            "text_offset": []}


def _shift(ev: TokenEvent, offset: int) -> TokenEvent:
    return dataclasses.replace(ev, index=ev.index + offset)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection. The body has been read, so the only message
    left to receive is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
