"""One exception family for everything a user can get wrong.

The CLI catches `MemraError` and prints its message without a traceback, so every message must
name the thing that is wrong and, where there is one, the fix.
"""


class MemraError(Exception):
    """Base class: a clear, user-facing error."""


class ConfigError(MemraError):
    """A checkpoint's configuration is missing a field, has a bad value, or names an unknown architecture."""


class CheckpointError(MemraError):
    """A weight file is corrupt, truncated, missing a tensor, or holds a tensor of the wrong shape or type."""


class TokenizerError(MemraError):
    """A tokenizer or chat template cannot be built or applied."""


class ContextOverflowError(MemraError):
    """A prompt or generation does not fit in the cache's context."""


class CaptureMemoryError(MemraError):
    """A max_batch whose captured steps did not fit in device memory beside the cache pools (memra.engine.warmup):
    the engine gave its memory back before taking any request, so a smaller max_batch may be tried."""
