"""POST /v1/responses (OpenAI's Responses API, vLLM's subset): the request is read as a chat request
(memra.server.responses_request) and served by the chat route's code, so its tokens are the chat
request's; this module turns that answer's deltas into Response output items, whole or as the API's
streaming events, and keeps answered responses for previous_response_id.

    output items   reasoning (with --reasoning-parser), message (output_text, with logprobs where asked),
                   function_call (call_id: the chat API's tool-call id)
    events         response.created, response.in_progress, response.output_item.added,
                   response.content_part.added, response.output_text.delta / .done,
                   response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done,
                   response.content_part.done, response.output_item.done, then response.completed
                   (its response's status "incomplete" where max_output_tokens cut it, as vLLM sends
                   it); an error event and response.failed where the engine ended it with an error
    stored         the last STORE_SIZE responses with store true (OpenAI's default), in memory: GET
                   /v1/responses/{id}, and previous_response_id continues one's conversation
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from memra.server.choices import ReplyHeader, RequestOutputs, _ERROR_STATUS, logprobs_body
from memra.server.errors import ApiError, error_response
from memra.server.responses_request import chat_body, stored_messages

STORE_SIZE = 1024  # responses kept for previous_response_id and GET, least recently used dropped first
_ECHOED = ("instructions", "max_output_tokens", "metadata", "previous_response_id", "temperature", "top_p",
           "tool_choice", "tools", "top_logprobs", "user", "parallel_tool_calls")


class ResponseStore:
    """Answered responses by id: (the response body, the messages a follow-up continues), bounded."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def put(self, rid: str, body: dict, messages: list[dict]) -> None:
        with self._lock:
            self._items[rid] = (body, messages)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = "previous_response_id") -> tuple[dict, list[dict]]:
        with self._lock:
            hit = self._items.get(rid)
            if hit is None:
                raise ApiError(404, f"response {rid[:80]!r} is not stored on this server (it keeps the last "
                                    f"{self.size} responses sent with store true, in memory)",
                               param=param, code="response_not_found")
            self._items.move_to_end(rid)
            return hit


class OutputItems:
    """One answer's deltas -> output items, and the streaming events that build them. The whole answer
    and the stream are made by this one class, so they agree."""

    def __init__(self, tok, logprobs: bool):
        self.tok, self.logprobs = tok, logprobs
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.seq = 0
        self.finish: str | None = None
        self.error: tuple[int, str] | None = None
        self.reasoning_tokens = 0
        self.pending: list[dict] = []  # logprobs of tokens whose text has not reached the message yet

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _start(self, item: dict, out: list) -> None:
        out.extend(self._close())
        self.items.append(item)
        self.open = item
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "reasoning":
            shown["content"] = []
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown))
        if item["type"] in ("message", "reasoning"):
            part = self._part(item)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part={**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})}))

    @staticmethod
    def _part(item: dict) -> dict:
        return item["content"][0]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        at, out = len(self.items) - 1, []
        if item["type"] == "message":
            part = self._part(item)
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=part["text"], logprobs=part.get("logprobs", [])))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                  part=part))
        elif item["type"] == "reasoning":
            part = self._part(item)
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                  part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        return out

    def push(self, d) -> list[dict]:
        """One delta of the answer -> its events."""
        out: list[dict] = []
        ev = d.event
        if ev.error:
            self.error = (_ERROR_STATUS.get(ev.error_kind, 500), ev.error)
            return out
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                self._start({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "status": "completed",
                             "content": [{"type": "reasoning_text", "text": ""}]}, out)
            self._part(self.open)["text"] += d.reasoning
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=d.reasoning))
            if not d.text and ev.token_id is not None:
                self.reasoning_tokens += 1
        if self.logprobs and ev.token_id is not None and not d.reasoning:  # a token of the message's text
            self.pending += logprobs_body(self.tok, [ev], True)["content"]
        writing = self.open is not None and self.open["type"] == "message"
        if d.text or (self.pending and writing):
            lps, self.pending = self.pending, []
            if not writing:
                self._start({"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                             "status": "completed", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                                 **({"logprobs": []} if self.logprobs else {})}]}, out)
            part = self._part(self.open)
            part["text"] += d.text
            if self.logprobs:
                part["logprobs"] += lps
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                                  content_index=0, delta=d.text, logprobs=lps))
        for call in d.tool_calls:
            if "id" in call:
                self._start({"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": call["id"],
                             "name": call["function"]["name"], "arguments": "", "status": "completed"}, out)
            self.open["arguments"] += call["function"]["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, delta=call["function"]["arguments"]))
        if d.finish_reason is not None:
            self.finish = d.finish_reason
            out.extend(self._close())
        return out


def install_responses(app: FastAPI, read: Callable, start_chat: Callable, model_name: str, tok) -> None:
    """The /v1/responses routes on `app`. read(request) -> the JSON body (size and depth checked);
    start_chat(raw chat dict) -> (RequestOutputs, ReplyHeader), as the chat route starts one."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request):
        raw = await read(request)
        if not isinstance(raw, dict):
            raise ApiError(400, "the body must be a JSON object")
        prev = raw.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise ApiError(400, "previous_response_id must be a string", param="previous_response_id")
        history = store.get(prev)[1] if prev is not None else []
        chat = chat_body(raw, history)
        out, head = await start_chat(chat)
        rid = "resp_" + uuid.uuid4().hex
        base = {"id": rid, "object": "response", "created_at": head.created, "model": model_name,
                "status": "in_progress", "error": None, "incomplete_details": None, "output": [],
                "text": raw.get("text") or {"format": {"type": "text"}}, "store": raw.get("store") is not False,
                "truncation": "disabled", "reasoning": None, "usage": None,
                **{k: raw.get(k, None) for k in _ECHOED}}
        base["tools"] = raw.get("tools") or []
        base["tool_choice"] = raw.get("tool_choice") or "auto"
        base["parallel_tool_calls"] = raw.get("parallel_tool_calls") is not False
        base["metadata"] = raw.get("metadata") or {}
        items = OutputItems(tok, bool(chat.get("logprobs")))

        def finished() -> dict:
            body = {**base, "output": items.items, "usage": _usage(out, head, items)}
            if items.error is not None:
                body.update(status="failed", error={"code": "server_error" if items.error[0] >= 500 else
                                                    "invalid_request", "message": items.error[1]})
            elif items.finish == "length":
                body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            else:
                body["status"] = "completed"
            if base["store"] and items.error is None:
                store.put(rid, body, stored_messages(raw, chat, items.items))
            return body

        if chat.get("stream"):
            return StreamingResponse(_events(out, items, base, finished), media_type="text/event-stream")

        async def collect():
            async for d in out.deltas():
                items.push(d)
                if items.error is not None:
                    return error_response(*items.error)
            return JSONResponse(finished())

        return await out.until_done(request, collect())

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        return JSONResponse(store.get(rid, None)[0])

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str):
        store.get(rid, None)
        raise ApiError(400, "only a background response can be cancelled, and memra runs none; this one is "
                            "complete", param="response_id")


def _usage(out: RequestOutputs, head: ReplyHeader, items: OutputItems) -> dict:
    u = out._usage(head)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens":
            u["prompt_tokens_details"]["cached_tokens"]}, "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": items.reasoning_tokens}, "total_tokens": u["total_tokens"]}


async def _events(out: RequestOutputs, items: OutputItems, base: dict, finished) -> AsyncIterator[str]:
    def sse(event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    try:
        yield sse(items.event("response.created", response=base)) + sse(items.event("response.in_progress",
                                                                                    response=base))
        async for d in out.deltas():
            events = items.push(d)
            if items.error is not None:
                status, message = items.error
                body = finished()
                yield (sse(items.event("error", code=str(status), message=message, param=None))
                       + sse(items.event("response.failed", response=body)))
                return
            if events:
                yield "".join(sse(e) for e in events)
        # response.completed whatever the status (incomplete where max_output_tokens cut it), as vLLM ends a
        # stream: the openai client's stream helper reads its final response from that event alone
        yield sse(items.event("response.completed", response=finished()))
    finally:  # the client went away, or the answer is complete: nothing more runs for it
        out.cancel_open()
