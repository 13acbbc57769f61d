"""Every error the HTTP API answers has OpenAI's shape, whatever produced it:

    {"error": {"message": ..., "type": ..., "param": ... | null, "code": ...}}

400 invalid_request_error  a body that is not JSON, a wrong type, a value out of range (the message
                           and `param` name the field), a prompt over the context. Validation
                           failures are 400, as OpenAI and vLLM answer, never FastAPI's 422.
401 authentication_error   a missing or wrong API key
404 invalid_request_error  an unknown route (an endpoint of OpenAI's that memra does not serve is named as
                           not supported), or an unknown model (code "model_not_found")
405 invalid_request_error  a known route with another method (the Allow header says which)
413 invalid_request_error  a body over the server's limit (--max-body-mb)
429 rate_limit_error       the waiting queue is full; Retry-After says when to come back
500 server_error           a bug: the body says only that, with an id; the server log has the traceback
503 server_error           shutting down, or the engine cannot serve (the message says why)
"""

from __future__ import annotations

import sys
import traceback
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from memra.errors import MemraError

# OpenAI's and vLLM's endpoints that memra does not serve (path prefix -> what it is): a request for one
# is told so, not answered with a bare "no route"
UNSUPPORTED = (("/v1/embeddings", "embeddings"), ("/v1/audio", "audio"), ("/v1/images", "images"),
               ("/v1/moderations", "moderations"), ("/v1/files", "files"), ("/v1/batches", "batches"),
               ("/v1/fine_tuning", "fine-tuning"), ("/v1/uploads", "uploads"), ("/v1/vector_stores", "vector stores"),
               ("/v1/assistants", "assistants"), ("/v1/threads", "threads"), ("/v1/realtime", "realtime"),
               ("/v1/conversations", "conversations"), ("/v1/containers", "containers"), ("/v1/videos", "videos"),
               ("/v1/evals", "evals"), ("/v1/score", "scoring"), ("/v1/rerank", "reranking"),
               ("/v2/rerank", "reranking"), ("/rerank", "reranking"), ("/score", "scoring"),
               ("/pooling", "pooling"), ("/classify", "classification"), ("/v1/load_lora_adapter", "LoRA adapters"),
               ("/v1/unload_lora_adapter", "LoRA adapters"))
SERVED = "/v1/completions, /v1/chat/completions and /v1/responses"
RETRY_AFTER_S = 1  # what a 429 tells a client to wait: the queue drains by whole requests, so soon

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ApiError(Exception):
    """Raised anywhere in a route to answer with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def too_many_requests(message: str) -> ApiError:
    return ApiError(429, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def model_not_found(name: str, served: str | tuple[str, ...]) -> ApiError:
    served = (served,) if isinstance(served, str) else served
    return ApiError(404, f"the model {name!r} does not exist; this server serves {' or '.join(map(repr, served))}",
                    param="model", code="model_not_found")


def _not_found(path: str) -> str:
    for prefix, what in UNSUPPORTED:
        if path == prefix or path.startswith(prefix + "/"):
            return f"{path}: {what} is not supported by memra, which serves text generation ({SERVED})"
    return f"no route {path}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, err: StarletteHTTPException):  # 404 no such route, 405 wrong method
        message = {404: _not_found(request.url.path), 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(err.status_code, message.get(err.status_code, str(err.detail)),
                              headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where)

    @app.exception_handler(MemraError)
    async def _refused(request: Request, err: MemraError):
        return error_response(400, str(err))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        incident = uuid.uuid4().hex[:12]
        print(f"memra serve: internal error {incident} on {request.method} {request.url.path}:", file=sys.stderr)
        traceback.print_exception(err, file=sys.stderr)
        return error_response(500, f"internal server error (incident {incident}); the server log has the details")
