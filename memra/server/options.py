"""The HTTP server's own settings (the engine's are memra.engine.engine.EngineConfig), fixed at start.

Limits keep one request from costing the others: a body is refused (413) before it is read past
`max_body_bytes`, JSON nested deeper than `max_json_depth` is refused (400) before anything walks it,
and the per-request work that does scale with the body (tokenizing, chat templates, detokenizing)
runs on `tokenizer_threads` worker threads, never on the engine thread, and on the event loop only for
a short prompt (memra.server.api.INLINE_ENCODE_CHARS), which costs less there than the hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memra.errors import MemraError
from memra.server.reasoning import PARSERS
from memra.tools import FORMATS

DEFAULT_MAX_BODY_MB = 4.0  # a 128k-token prompt as text or as ids is ~1 MB of JSON; 4 leaves room for chats


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # Authorization: Bearer KEY on every route but /health and /v1/models
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * (1 << 20))
    max_json_depth: int = 32  # our request bodies nest 4 deep (messages -> content parts); 32 is ample
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    tokenizer_threads: int = 2
    allowed_origins: tuple[str, ...] = ()  # CORS (memra.server.access): browser origins allowed, "*" = any
    log_requests: bool = False  # one access-log line per request (memra serve turns it on)
    reasoning_parser: str | None = None  # chat answers' <think>…</think> -> reasoning_content (memra.server.reasoning)
    tool_call_parser: str | None = None  # tool_choice auto's call format (memra.tools); None: the template's
    seed: int | None = None  # --seed: the stream unseeded requests draw their seeds from; None: a random one
    # --generation-config / --override-generation-config: (request field, value) defaults for fields a
    # chat or completion request leaves out (memra.server.vllm_flags.generation_defaults)
    sampling_defaults: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise MemraError("the API key is empty; give a non-empty key or none")
        if self.max_body_bytes < 1024:
            raise MemraError(f"the request body limit must be at least 1 KiB, got {self.max_body_bytes} bytes")
        if not 4 <= self.max_json_depth <= 1000:
            raise MemraError(f"max_json_depth must be in 4..1000, got {self.max_json_depth}")
        if not 0 <= self.shutdown_timeout <= 3600:
            raise MemraError(f"--shutdown-timeout must be in 0..3600 seconds, got {self.shutdown_timeout:g}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise MemraError(f"--reasoning-parser {self.reasoning_parser}: memra knows {', '.join(sorted(PARSERS))}")
        if self.tool_call_parser is not None and self.tool_call_parser not in FORMATS:
            raise MemraError(f"--tool-call-parser {self.tool_call_parser}: memra knows {', '.join(sorted(FORMATS))}")
        if not 1 <= self.tokenizer_threads <= 64:
            raise MemraError(f"tokenizer_threads must be in 1..64, got {self.tokenizer_threads}")


def resolve_api_key(flag: str | None, key_file: str | None, env: str | None) -> str | None:
    """The API key from --api-key, --api-key-file or MEMRA_API_KEY, in that order; None = no auth.
    The flag shows in the process list, so the file and the variable are the ways to keep it private."""
    if flag is not None and key_file is not None:
        raise MemraError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise MemraError(f"--api-key-file {key_file}: cannot read it ({e})") from None
        if not key:
            raise MemraError(f"--api-key-file {key_file} is empty")
        return key
    if flag is not None:
        return flag
    return env if env else None
