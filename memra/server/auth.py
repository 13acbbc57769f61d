"""The API key check: `Authorization: Bearer KEY` on every route except the open ones.

Open: GET /health (load balancers and orchestrators probe it without credentials) and GET /v1/models
(the model's name and context length, which clients read before they authenticate), as llama.cpp's
server keeps them. Everything else needs the key, /metrics included: its counters describe the traffic.

The comparison is constant-time (hmac.compare_digest), so the time a wrong key takes to refuse says
nothing about how much of it was right (vLLM fixed a plain `!=` here as CVE-2025-59425). The scheme is
matched case-insensitively, as RFC 9110 says auth schemes are.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from memra.server.errors import error_response

OPEN_ROUTES = frozenset({"/health", "/v1/models"})


def presented_key(header: str) -> bytes:
    """The credentials of an `Authorization: Bearer KEY` header (b"" for any other header)."""
    scheme, _, credentials = header.strip().partition(" ")
    return credentials.strip().encode() if scheme.lower() == "bearer" else b""


def install_api_key(app: FastAPI, api_key: str | None) -> None:
    if api_key is None:
        return
    expected = api_key.encode()

    @app.middleware("http")
    async def _require_key(request: Request, call_next):
        if request.url.path not in OPEN_ROUTES:
            if not hmac.compare_digest(presented_key(request.headers.get("authorization", "")), expected):
                return error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                      headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
