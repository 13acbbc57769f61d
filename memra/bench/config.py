"""What one `memra bench model` run measures: the model shapes, batch widths, modes, weight format and
budgets (BenchConfig), validated when built so a bad flag fails before any model is allocated.

Also the names the other bench modules share: the weight formats, memra's modes (exact | fast), the
user paths timed beside them (engine | newcache) and the HF peers (hf | hf-static).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from memra.cache import PRIME_CHUNK_MAX_TOKENS
from memra.errors import MemraError
from memra.random_model import SHAPES

# name -> (activation dtype, packed format for random_model(quant=...) or None)
WEIGHT_FORMATS = {"bf16": (torch.bfloat16, None), "q8_0": (torch.bfloat16, "q8_0"), "q4_k": (torch.bfloat16, "q4_k")}
MODES = ("exact", "fast")  # memra's exact path, and the non-exact stacked path (MEMRA_EXACT=0)
PATHS = ("engine", "newcache")  # the paths users run, timed beside the pooled step (memra.bench.user_paths)
# HF transformers `generate` on the same weights: with its default dynamic cache, and with
# cache_implementation="static" (which makes transformers compile the forward on a GPU)
PEERS = ("hf", "hf-static")
GIB = 2**30


def check_weights(weights: str) -> torch.dtype:
    """The dtype a weights format builds, or a MemraError that says what is possible."""
    if weights in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[weights][0]
    raise MemraError(f"unknown weights format {weights!r}; available: {', '.join(WEIGHT_FORMATS)}")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = tuple(SHAPES)
    batches: tuple[int, ...] = (1, 8, 32, 128)
    prefill_chunk: int = 4096  # tokens primed as one chunk (at most PRIME_CHUNK_MAX_TOKENS)
    ttft_tokens: int = 512  # prompt length of the time-to-first-token cell
    prompt_tokens: int = 32  # each decode row's primed prompt (also the HF peer's prompt)
    decode_steps: int = 32  # timed decode steps per cell (the HF peer generates this many + 1)
    warmup: int = 2  # untimed decode steps first (kernel compile, decode-plan check); 0 = none
    repeats: int = 3  # prefill / TTFT / probes: best of this many
    layers: tuple[tuple[str, int], ...] = ()  # per-model layer count, e.g. (("qwen3.5-35b-a3b", 20),)
    weights: str = "bf16"
    peers: tuple[str, ...] = ("hf",)  # which of PEERS run; () = none
    exact_modes: tuple[str, ...] = MODES
    device: str = "cuda"
    json_path: str | None = None  # also write the report here (after each model, so a crash keeps results)
    budget_s: float | None = None  # start no cell after this many seconds; the rest are recorded as skipped
    seed: int = 0
    # Builds a model: (name, device, dtype, n_layers, seed) -> HybridModel. None = memra.random_model,
    # which knows only SHAPES; a factory may use other names (tests use tiny shapes this way).
    model_factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_weights(self.weights)
        if not self.models:
            raise MemraError("no models to benchmark")
        known = set(SHAPES)
        if self.model_factory is None:
            for name in self.models:
                if name not in known:
                    raise MemraError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
        for name, n in self.layers:
            if name not in self.models:
                raise MemraError(f"a layer count is given for {name!r}, which is not among the models "
                                 f"({', '.join(self.models)})")
            if n <= 0:
                raise MemraError(f"layer count for {name!r} must be positive, got {n}")
        if not self.batches or min(self.batches) <= 0:
            raise MemraError(f"batch widths must be positive, got {self.batches}")
        if bad := [m for m in self.exact_modes if m not in MODES + PATHS]:
            raise MemraError(f"unknown mode(s) {bad}; modes are {', '.join(MODES + PATHS)}")
        if bad := [p for p in self.peers if p not in PEERS]:
            raise MemraError(f"unknown peer(s) {bad}; peers are {', '.join(PEERS)}")
        if not 1 <= self.prefill_chunk <= PRIME_CHUNK_MAX_TOKENS:
            raise MemraError(f"prefill_chunk must be in 1..{PRIME_CHUNK_MAX_TOKENS}, got {self.prefill_chunk}")
        for name in ("ttft_tokens", "prompt_tokens", "decode_steps", "repeats"):
            if getattr(self, name) <= 0:
                raise MemraError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise MemraError(f"warmup must be >= 0, got {self.warmup}")
        if self.budget_s is not None and self.budget_s < 0:
            raise MemraError(f"budget_s must be >= 0, got {self.budget_s}")

    @property
    def dtype(self) -> torch.dtype:
        return check_weights(self.weights)

    def layers_for(self, name: str) -> int | None:
        return dict(self.layers).get(name)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model_factory"}
        d["layers"] = dict(self.layers)
        f = self.model_factory
        d["model_factory"] = None if f is None else getattr(f, "__name__", type(f).__name__)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BenchConfig":
        """A config read back from JSON. A custom factory cannot be serialized: a config that had one
        comes back with a placeholder that refuses to build (so its model names are not checked
        against SHAPES), and compares equal to the original."""
        d = dict(d)
        factory = d.pop("model_factory", None)
        if "peer_hf" in d:  # a report written before there was more than one peer
            d["peers"] = ("hf",) if d.pop("peer_hf") else ()
        for k in ("models", "batches", "exact_modes", "peers"):
            d[k] = tuple(d[k])
        d["layers"] = tuple((k, int(v)) for k, v in d["layers"].items())
        return cls(**d, model_factory=None if factory is None else _UnserializedFactory(factory))


class _UnserializedFactory:
    """Stands in for a custom model factory in a config read back from JSON: keeps its name, refuses to build."""

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise MemraError(f"this config was read back from JSON; its model factory {self.__name__!r} was not saved")
