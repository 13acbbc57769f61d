"""Giving an engine's device memory back: memra.LLM.close(), its context manager and its finalizer (Releasing).

What an LLM holds on its device: the model's weights (when the LLM loaded them), the engine's KV and
recurrent pools, and the captured steps over those pools (memra.graphs) with the memory pools they share. The
model and the engine sit in reference cycles (the executor and the model name each other; the engine and
its scoring jobs too), so dropping the last name of an LLM leaves them to Python's cycle collector, which
may not run before the next LLM asks for the same memory. Closing breaks that: the engine shuts down
(its backend drops the captured steps and the pools), the cycles are collected at once, and on CUDA the
caching allocator gives the freed blocks back to the driver (release_memory).
"""

from __future__ import annotations

import gc

import torch

from memra.errors import MemraError


class Closed:
    """What a closed LLM holds in place of its engine and model: any use is a one-line error."""

    def __getattr__(self, name: str):
        raise MemraError("this memra.LLM is closed (close(), or its `with` block ended); create a new one")

    def __bool__(self) -> bool:
        return False


CLOSED = Closed()


def release_memory(device: torch.device) -> None:
    """Collect the cycles a closed engine left (its pools and graphs with them) now, not when the cycle
    collector next runs, and on CUDA hand the freed blocks back to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Releasing:
    """memra.LLM's release: close(), the context manager and the finalizer. The class sets `engine`, `model`
    and `_owns_model` (whether it loaded the model itself, so that its weights go too)."""

    def close(self) -> None:
        """Give back the device memory this LLM holds: its KV and state pools, its captured graphs, and the
        model's weights where the LLM loaded them. Later calls are refused in one line. Also done when a
        `with memra.LLM(...) as llm:` block ends and when the LLM is collected."""
        if not self.__dict__.get("engine"):  # never made (the constructor failed), or closed already
            return
        device = self.model.device
        self.engine.shutdown(drain_timeout=0.0)
        self.engine = CLOSED
        if self._owns_model:
            self.model = CLOSED
        release_memory(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: modules may be gone; nothing to report to
            pass
