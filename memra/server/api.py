"""The OpenAI-compatible HTTP API over the engine (FastAPI; run by memra.server.http under uvicorn).

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks in OpenAI's format, then [DONE])
    POST /v1/responses, GET /v1/responses/{id}  (the chat route's answer as Response items: memra.server.responses)
    POST /v1/update_weights                      (memra.server.weights_route)
    GET  /v1/models, /health, /metrics           POST /tokenize, /detokenize

What each request costs the others is bounded (memra.server.options): the body is read within its size
limit and parsed strictly (memra.server.bodies); a prompt whose text is too long for the context is
refused before it is tokenized; tokenizing, chat templates and detokenizing run on a worker pool (the
tokenizer releases the GIL while it works), never on the engine thread, and on the event loop only for a
prompt of at most INLINE_ENCODE_CHARS characters, which encodes faster than the hand-off to the pool
and back would take (a 1,000-character prompt in ~0.1 ms); generated text
and stop strings are made on one text thread in time linear in the text (memra.server.choices).
Errors have OpenAI's shape on every route and status (memra.server.errors); the key check and which
routes stay open are in memra.server.auth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from memra.errors import ContextOverflowError, MemraError
from memra.structured import compile_for
from memra.server.access import install_cors, install_request_log
from memra.server.auth import install_api_key
from memra.server.bodies import read_json, validate
from memra.server.choices import ReplyHeader, RequestOutputs, TextWorker, reply_body
from memra.engine.engine import Engine, QueueFull, Unavailable
from memra.engine.scoring import ScoreJob
from memra.server.errors import ApiError, error_response, install_error_handlers, model_not_found, too_many_requests
from memra.server.options import ServerOptions
from memra.sampling import fresh_seed, truncate_prompt
from memra.server.reasoning import ReasoningFormat
from memra.server.responses import install_responses
from memra.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, sampling_defaults
from memra.server.scored import Scored, ScoredReply
from memra.server.tools import ChoiceCalls, forced_constraint, tool_spec
from memra.server.unhonoured import CHAT, CMPL, refuse_unhonoured
from memra.server.weights_route import install_update_weights
from memra.tools import detect_format, template_messages

# A token decodes to at most `max_piece_chars` characters, so a text longer than that many per token of
# the context cannot fit; the factor leaves room for normalizers that merge characters (NFC and kin).
_CHARS_SLACK = 2
INLINE_ENCODE_CHARS = 1024  # a prompt this short is encoded on the event loop (module docstring)


def build_app(engine: Engine, model_name: str | tuple[str, ...], options: ServerOptions = ServerOptions(),
              metrics=None, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """model_name: the name clients send, or several (vLLM's --served-model-name; answers carry the first)."""
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    model_name = names[0]
    seeds = random.Random(options.seed) if options.seed is not None else None  # --seed: a repeatable stream
    defaults = sampling_defaults(options.sampling_defaults)
    tok = engine.model.tokenizer
    max_len = engine.max_len
    pool = ThreadPoolExecutor(options.tokenizer_threads, thread_name_prefix="memra-tokenize")
    text_worker = TextWorker()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            if engine._thread is None:
                engine.start()
            app.state.max_chars = await asyncio.get_running_loop().run_in_executor(
                pool, lambda: max_len * tok.max_piece_chars * _CHARS_SLACK)
        except Exception as e:  # uvicorn only logs it and exits: keep it for ServerThread's one-line error
            app.state.startup_error = f"{type(e).__name__}: {e}"
            raise
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, options.shutdown_timeout)
        pool.shutdown(wait=False, cancel_futures=True)
        text_worker.close()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="memra", lifespan=lifespan)
    app.state.engine, app.state.options = engine, options
    install_error_handlers(app)
    install_api_key(app, options.api_key)
    install_cors(app, options.allowed_origins)  # after the key check is added: outside it, so preflights pass
    install_request_log(app, options.log_requests)  # outermost: it times the whole response
    install_update_weights(app, engine, options, pool)  # POST /v1/update_weights (memra.weights)

    reasoning = ReasoningFormat.named(options.reasoning_parser) if options.reasoning_parser else None
    honoured = frozenset({"include_reasoning"} if reasoning is not None else ())
    tool_format = options.tool_call_parser or detect_format(tok.chat_template)  # auto's format (memra.server.tools)

    async def read(request: Request):
        return await read_json(request, options.max_body_bytes, options.max_json_depth)

    async def body_of(request: Request, schema, route: str | None = None):
        return checked(schema, await read(request), route)

    def checked(schema, raw, route: str | None = None):
        """A request body validated as `schema`, for a model this server serves, with the server's
        sampling defaults where it leaves a field out."""
        if route is not None:
            refuse_unhonoured(raw, route, honoured)
        body = validate(schema, raw)
        if body.model is not None and body.model not in names:
            raise model_not_found(body.model, names)
        for key, value in defaults.get(schema, ()):  # --generation-config: the fields the request left out
            if getattr(body, key) is None:
                setattr(body, key, value)
        return body

    async def off_loop(fn, *args):
        """Run tokenizer work on the worker pool."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def encode(text: str, add_special: bool) -> list[int]:
        """A prompt's ids: short ones on the loop, longer ones on the pool (module docstring)."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return tok.encode(text, add_special)
        return await off_loop(tok.encode, text, add_special)

    def check_chars(text_chars: int) -> None:
        """Refuse a prompt too long to fit before any tokenizing is spent on it."""
        if text_chars > app.state.max_chars:
            raise ContextOverflowError(
                f"this model's maximum context length is {max_len} tokens; the prompt's {text_chars:,} characters "
                f"cannot fit in it (no token is longer than {tok.max_piece_chars} characters); shorten the prompt")

    def chat_ids(messages, add_special: bool = False, kwargs: dict | None = None, tools=None) -> list[int]:
        return chat_prompt(messages, add_special, kwargs, tools)[0]  # on the pool

    def chat_prompt(messages, add_special: bool, kwargs: dict | None, tools=None) -> tuple[list[int], bool]:
        """The prompt's ids (kwargs: chat_template_kwargs, as template variables; tools: the request's, as
        the template's `tools`), and whether its generation prompt leaves a reasoning block open (with a
        reasoning parser: the answer starts inside it). On the pool."""
        if not tok.chat_template:
            raise MemraError("this model has no chat template; use /v1/completions")
        msgs = template_messages([m.for_template() for m in messages])
        if tools:
            kwargs = {**(kwargs or {}), "tools": list(tools)}
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, **(kwargs or {}))
        opened = False
        if reasoning is not None:  # the generation prompt: what add_generation_prompt adds to the text
            bare = tok.apply_chat_template(msgs, add_generation_prompt=False, **(kwargs or {}))
            opened = reasoning.opened_by(text[len(bare):] if text.startswith(bare) else text)
        return tok.encode(text, add_special=add_special), opened

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return error_response(503, problem)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return PlainTextResponse("", status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "memra", "max_model_len": max_len,
                                            "weights_version": getattr(engine.model, "weights_version", 0)}
                                           for name in names]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            check_chars(sum(len(m.text()) for m in body.messages))
            if {"messages", "add_generation_prompt"} & set(body.chat_template_kwargs or ()):
                raise ApiError(400, "chat_template_kwargs may not set messages or add_generation_prompt: the server "
                                    "sets them", param="chat_template_kwargs")
            tool_spec(body, None, generates=False)  # the chat route's checks of the tools
            ids = await off_loop(chat_ids, body.messages, False, body.chat_template_kwargs, body.tools)
        else:
            check_chars(len(body.prompt))
            ids = await encode(body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request, DetokenizeRequest)
        vocab = engine.model.cfg.vocab_size
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < vocab:
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": await off_loop(tok.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        body = await body_of(request, CompletionRequest, CMPL)
        body.check_supported()
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        if max_tokens or not body.echo:  # echo with max_tokens 0 only scores (lm-eval's loglikelihood)
            body.sampling(max_tokens, 0)  # refuse bad sampling before tokenizing anything
        prompts = body.prompts()
        for p in prompts:
            if isinstance(p, str):
                check_chars(len(p))
        ids = [p if isinstance(p, list) else await encode(p, body.add_special_tokens) for p in prompts]
        ids = [truncated(body, p) for p in ids]
        texts = [p if isinstance(p, str) else None for p in prompts]
        scored = await scored_reply(body, ids, texts, body.echo, body.logprobs if body.echo else None)
        if not max_tokens:
            return echo_only(body, ids, scored)
        out, head = await launch(body, ids, chat=False, logprobs=body.logprobs, max_tokens=max_tokens, scored=scored)
        return await respond(request, body, out, head, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        body = await body_of(request, ChatRequest, CHAT)
        return await respond(request, body, *await start_chat(body), arrival)

    async def start_chat(body: ChatRequest) -> tuple[RequestOutputs, ReplyHeader]:
        """A validated chat request queued on the engine: its outputs and its reply's header (the chat
        route and /v1/responses, which builds a ChatRequest, answer from these)."""
        body.check_supported()
        want = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if want is not None:
            body.sampling(want, 0)
        tools = tool_spec(body, tool_format)
        check_chars(sum(len(m.text()) for m in body.messages))
        ids, opened = await off_loop(chat_prompt, body.messages, body.add_special_tokens, body.chat_template_kwargs,
                                     body.tools)
        ids = truncated(body, ids)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        scored = await scored_reply(body, [ids], [None], False, None)
        return await launch(body, [ids], chat=True, logprobs=logprobs,
                            max_tokens=want if want is not None else max(max_len - len(ids), 1),
                            scored=scored, opened=opened, tools=tools)

    install_responses(app, read, lambda chat: start_chat(checked(ChatRequest, chat)), model_name, tok)

    def truncated(body, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k ids (-1: the context's length)."""
        return truncate_prompt(ids, body.truncate_prompt_tokens, max_len)

    async def scored_reply(body, ids: list[list[int]], texts: list, echo: bool, echo_top: int | None):
        """The prompts' scores where the body asks for them (memra.engine.scoring, on the engine thread
        between steps), as a ScoredReply; None where it asks for neither echo nor prompt_logprobs."""
        if not echo and body.prompt_logprobs is None:
            return None
        top = max(echo_top or 0, body.prompt_logprobs or 0)
        scores = [[] for _ in ids]
        if echo_top is not None or body.prompt_logprobs is not None:
            try:
                futures = [engine.score_jobs.submit(ScoreJob(tuple(p), body.continuation_start, top)) for p in ids]
                scores = [await asyncio.wrap_future(f) for f in futures]
            except QueueFull as err:
                raise too_many_requests(str(err)) from None
            except Unavailable as err:
                raise ApiError(503, str(err)) from None
        made = [t if t is not None else await off_loop(tok.decode, p, True) for p, t in zip(ids, texts)]
        return ScoredReply(tuple(Scored(p, s, t) for p, s, t in zip(ids, scores, made)), body.n, echo, echo_top,
                           body.prompt_logprobs, bool(body.return_tokens_as_token_ids))

    def echo_only(body, ids: list[list[int]], scored: ScoredReply) -> JSONResponse:
        """echo with max_tokens 0: each choice is its prompt, nothing generated."""
        head = ReplyHeader("cmpl-" + uuid.uuid4().hex[:24], int(time.time()), model_name, False,
                           sum(len(p) for p in ids), False, scored=scored)  # a prompt counts once, whatever its n
        choices = []
        for i in range(len(ids) * body.n):
            choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length"})
            scored.extend(tok, choices[-1], i)
        usage = {"prompt_tokens": head.prompt_tokens, "completion_tokens": 0, "total_tokens": head.prompt_tokens}
        return JSONResponse(reply_body(head, choices, usage, getattr(engine.model, "weights_version", 0)))

    async def launch(body, prompts: list[list[int]], chat: bool, logprobs: int | None, max_tokens: int,
                     scored: ScoredReply | None = None, opened: bool = False,
                     tools=None) -> tuple[RequestOutputs, ReplyHeader]:
        seed = body.seed if body.seed is not None else seeds.getrandbits(62) if seeds is not None else fresh_seed()
        params = body.sampling(max_tokens, seed)
        if tools is not None and tools.forced:  # required / named: the tools' grammar (memra.server.tools)
            params = dataclasses.replace(params, structured_outputs=forced_constraint(tools, params.structured_outputs))
        if body.speculative and not engine.spec.enabled:
            raise ApiError(400, "speculative: this server does not speculate; start it with --speculative mtp|ngram "
                                "or leave the field out", param="speculative")
        if params.structured_outputs is not None:  # compiled (and cached) on the pool: submit finds it there
            await off_loop(compile_for, tok, params.structured_outputs)
        # required / named: the grammar writes the calls' JSON from the first token, so there is no reasoning
        # to split off, even where the generation prompt opened <think> (it would take the whole answer)
        split = ((lambda: reasoning.splitter(opened)) if chat and reasoning is not None
                 and not (tools is not None and tools.forced) else None)
        out = RequestOutputs(engine, tok, params, len(prompts) * body.n, text_worker, split,
                             getattr(body, "include_reasoning", None) is not False,
                             ChoiceCalls.for_choices(tools, tool_format, len(prompts) * body.n))
        try:
            for i, ids in enumerate(prompts):
                out.rids += engine.submit(ids, params, out.sink_for(i * body.n), n=body.n, logprobs=logprobs,
                                          eos_ids=params.stop_ids(tok.eos_ids), speculative=body.speculative is not False)
        except QueueFull as err:
            engine.cancel(out.rids)
            raise too_many_requests(str(err)) from None
        except Unavailable as err:
            engine.cancel(out.rids)
            raise ApiError(503, str(err)) from None
        except MemraError:
            engine.cancel(out.rids)
            raise
        head = ReplyHeader(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), model_name,
                           chat, sum(len(p) for p in prompts), logprobs is not None,
                           bool(body.return_tokens_as_token_ids), scored, body.n)
        return out, head

    async def respond(request: Request, body, out: RequestOutputs, head: ReplyHeader, arrival: float):
        """The answer in OpenAI's chat / completion shape: a stream of chunks, or one body."""
        if body.stream:
            first = None if metrics is None else lambda: metrics.http_ttft.observe(time.perf_counter() - arrival)
            return StreamingResponse(out.events(head, body.include_usage, first), media_type="text/event-stream")
        return await out.whole(request, head)

    return app
