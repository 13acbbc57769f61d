"""The OpenAI-compatible HTTP API over the engine (FastAPI; run by uvicorn in `memra serve`).

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks in OpenAI's format, then [DONE])
    GET  /v1/models, /health, /metrics           POST /tokenize, /detokenize

Errors follow OpenAI's body: {"error": {"message", "type", "param", "code"}} — 400 for a bad request
(malformed JSON, wrong types, out-of-range values, a prompt over the context), 401 for a wrong API
key, 429 when the waiting queue is at its bound, 503 while shutting down or once the engine cannot serve
(stopped after an error, a pipeline rank gone: the message names it). A request in flight when the
engine fails ends with a 500 body (or, streaming, an error event) carrying the engine's message. A
streaming client that disconnects cancels its request at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from memra.errors import MemraError
from memra.server.engine import Engine, QueueFull, TokenEvent, Unavailable, fresh_seed
from memra.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc) or None
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), where


class _Job:
    """One HTTP request's view of its n choices: events arrive from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int):
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.loop, self.open = loop, n
        self.rids: list[str] = []
        self.logprobs: int | None = None  # top-n asked for (0 = the chosen token's only), None = off

    def sink(self, ev: TokenEvent) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)

    async def events(self) -> AsyncIterator[TokenEvent]:
        while self.open:
            ev = await self.queue.get()
            if ev.finish_reason is not None:
                self.open -= 1
            yield ev


def build_app(engine: Engine, model_name: str, api_key: str | None = None, metrics=None,
              drain_timeout: float = 30.0, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    tok = engine.model.tokenizer
    max_len = min(engine.cfg.max_ctx, engine.model.cfg.max_position)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine._thread is None:
            engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, drain_timeout)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="memra", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        if any(e.get("type") == "json_invalid" for e in err.errors()):
            message = "the request body is not valid JSON"
        return error_body(400, message, param=param)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path not in ("/health", "/metrics"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_body(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")
        return await call_next(request)

    async def parse(request: Request, schema):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _HttpError(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            raise _HttpError(400, "the request body must be a JSON object")
        try:
            return schema.model_validate(body)
        except ValidationError as err:
            message, param = _validation_message(err)
            raise _HttpError(400, message, param=param)

    @app.exception_handler(_HttpError)
    async def _http_error(request: Request, err: _HttpError):
        return err.response()

    @app.exception_handler(MemraError)
    async def _memra_error(request: Request, err: MemraError):
        return error_body(400, str(err))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        return error_body(500, f"internal error: {type(err).__name__}: {err}", "server_error")

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return error_body(503, problem, "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return PlainTextResponse("", status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "memra", "max_model_len": max_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            return error_body(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            ids = _chat_ids(tok, body.messages)
        else:
            ids = tok.encode(body.prompt, add_special=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest)
        vocab = engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return error_body(400, f"token ids must be in 0..{vocab - 1}")
        return {"prompt": tok.decode(body.tokens, skip_special=False)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        body.check_supported()
        prompts = [p if isinstance(p, list) else tok.encode(p, add_special=True) for p in body.prompts()]
        return await _serve(request, body, prompts, chat=False, logprobs=body.logprobs, default_max=body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        body.check_supported()
        ids = _chat_ids(tok, body.messages)
        want = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(request, body, [ids], chat=True, logprobs=logprobs,
                            default_max=want if want is not None else max(max_len - len(ids), 1))

    async def _serve(request: Request, body, prompts: list[list[int]], chat: bool, logprobs: int | None, default_max):
        seed = body.seed if body.seed is not None else fresh_seed()
        params = body.sampling(default_max if default_max is not None else 16, seed)
        loop = asyncio.get_running_loop()
        job = _Job(loop, len(prompts) * body.n)
        job.logprobs = logprobs
        try:
            for i, ids in enumerate(prompts):
                rids = engine.submit(ids, params, _offset_sink(job, i * body.n), n=body.n, logprobs=logprobs,
                                     eos_ids=tok.eos_ids)
                job.rids += rids
        except QueueFull as err:
            engine.cancel(job.rids)
            return error_body(429, str(err), "rate_limit_error")
        except Unavailable as err:
            engine.cancel(job.rids)
            return error_body(503, str(err), "server_error")
        except MemraError as err:
            engine.cancel(job.rids)
            return error_body(400, str(err))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        if body.stream:
            return StreamingResponse(_stream(job, rid, created, chat, prompt_tokens, body.include_usage),
                                     media_type="text/event-stream")
        return await _collect(job, rid, created, chat, prompt_tokens)

    def _offset_sink(job: _Job, offset: int):  # prompt i's choices are indices i*n .. i*n+n-1
        return lambda ev: job.sink(dataclasses.replace(ev, index=ev.index + offset))

    async def _collect(job: _Job, rid: str, created: int, chat: bool, prompt_tokens: int):
        n = job.open
        texts = [[] for _ in range(n)]
        logs = [[] for _ in range(n)]
        finish = [None] * n
        completion = 0
        try:
            async for ev in job.events():
                if ev.error:
                    return error_body(503 if "shut down" in ev.error else 500, ev.error, "server_error")
                texts[ev.index].append(ev.text)
                if ev.token_id is not None:
                    completion += 1
                    logs[ev.index].append(ev)
                if ev.finish_reason:
                    finish[ev.index] = ev.finish_reason
        finally:
            if job.open:
                engine.cancel(job.rids)
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            lp = _logprobs(tok, logs[i], chat) if job.logprobs is not None else None
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    async def _stream(job: _Job, rid: str, created: int, chat: bool, prompt_tokens: int, usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        completion = 0
        want_lp = job.logprobs is not None

        def chunk(choices, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                          "choices": choices, **extra}) + "\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(job.open)])
            async for ev in job.events():
                if ev.error:
                    yield "data: " + json.dumps({"error": {"message": ev.error, "type": "server_error", "code": 500}}) + "\n\n"
                    continue
                if ev.token_id is not None:
                    completion += 1
                lp = _logprobs(tok, [ev], chat) if want_lp and ev.token_id is not None else None
                if chat:
                    delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                    yield chunk([{"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}])
                else:
                    yield chunk([{"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}])
            if usage:
                yield chunk([], usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                       "total_tokens": prompt_tokens + completion})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): nothing more runs for this request
            if job.open:
                engine.cancel(job.rids)

    return app


class _HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return error_body(self.status, self.message, param=self.param)


def _chat_ids(tok, messages) -> list[int]:
    if not tok.chat_template:
        raise MemraError("this model has no chat template; use /v1/completions")
    text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages], add_generation_prompt=True)
    return tok.encode(text, add_special=False)


def _logprobs(tok, events: list[TokenEvent], chat: bool):
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


# --- running it -----------------------------------------------------------------------------------------


class ServerThread:
    """uvicorn serving `app` on a background thread (tests, `memra bench serve`). port=0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=30))
        self.thread = threading.Thread(target=self.server.run, name="memra-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise MemraError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
