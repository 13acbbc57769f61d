"""The floor of an offline workload on this device: the time its unavoidable work takes at the device's matmul
peak and read bandwidth (memra.bench.probes, measured in the same run), so a throughput figure can be read
against what the device allows for that workload, not only against a peer's figure on another one.

    seconds >= matmul FLOPs / matmul peak + cache bytes / read bandwidth

- matmul FLOPs: every prompt token and every generated token after the first through the trunk's matmuls
  (roofline.token_flops), the LM head once per generated token (the prompt's last position and each decode
  row), attention over each token's prefix (a prompt's causal square, each decode token's whole prefix) and
  the delta rule's estimate (roofline.prefill_flops' parts).
- cache bytes: each decode token reads its prefix's K and V and reads and writes its GDN state (roofline
  .state_bytes at that token's prefix).

The two add rather than overlap because an engine's step runs its linears and its attention one after the
other (memra's, vLLM's and SGLang's alike). Weight reads are left out: the steps that approach the floor are
large enough for their matmuls to hide them, so this is a floor no schedule beats, not a prediction; the
schedule's cost (the tail's small steps, padding, host time) is the distance from it. A request's first
output token comes from its prefill's logits; the other output_len - 1 are decode steps at positions
p .. p + output_len - 2, attending to p + 1 .. p + output_len - 1 keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra.bench.report import si
from memra.bench.roofline import attention_flops, cache_parts, gdn_flops, token_flops


@dataclass(frozen=True)
class WorkloadFloor:
    matmul_flops: float
    cache_bytes: float
    matmul_flops_per_s: float
    read_bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.matmul_flops / self.matmul_flops_per_s + self.cache_bytes / self.read_bytes_per_s

    def describe(self, output_tokens: int) -> str:
        """The floor and its parts: '14.06 s (17,578 output tok/s) = matmuls ... + cache reads ...'."""
        return (f"{self.seconds:.2f} s ({output_tokens / self.seconds:,.0f} output tok/s) = "
                f"matmuls {si(self.matmul_flops)}FLOP at {si(self.matmul_flops_per_s)}FLOP/s + "
                f"cache reads {si(self.cache_bytes)}B at {si(self.read_bytes_per_s)}B/s")

    def line(self, output_tokens: int, seconds: float) -> str:
        """One line for a run's report: the floor on its device, and the run's share of it."""
        return f"floor on this device: {self.describe(output_tokens)}; this run {self.seconds / seconds:.0%} of it"


def decode_keys(prompt_len: int, output_len: int) -> float:
    """(query, key) pairs of a request's decode steps: the step feeding position p + k attends to p + k + 1 keys,
    k = 0 .. output_len - 2 (the first output token is its prefill's)."""
    return (output_len - 1) * (2 * prompt_len + output_len) / 2


def workload_work(model, lengths: list[tuple[int, int]]) -> tuple[float, float]:
    """(matmul FLOPs, cache bytes) of generating output_len tokens after each (prompt_len, output_len)."""
    cfg = model.cfg
    per_token, head = token_flops(model), 2 * cfg.vocab_size * cfg.hidden_size
    kv_per_position, recurrent = cache_parts(cfg, model.dtype, 1)
    flops = cache = 0.0
    for p, o in lengths:
        steps, keys = o - 1, decode_keys(p, o)  # decode steps; the first output token is the prefill's
        flops += (per_token * (p + steps) + head * o + attention_flops(cfg, p * (p + 1) / 2 + keys)
                  + gdn_flops(cfg, p + steps))
        cache += kv_per_position * keys + 2 * recurrent * steps
    return flops, cache


def workload_floor(model, lengths: list[tuple[int, int]], matmul_flops_per_s: float,
                   read_bytes_per_s: float) -> WorkloadFloor:
    flops, cache = workload_work(model, lengths)
    return WorkloadFloor(flops, cache, matmul_flops_per_s, read_bytes_per_s)


def meta_model(cfg, dtype: torch.dtype = torch.bfloat16):
    """A model of cfg's shape whose weights are meta tensors (in `dtype`, norms fp32 as random_model holds them):
    every count above, no memory, on any machine (tools/workload_floor.py)."""
    from memra.model.hybrid import HybridModel
    from memra.random_model import FP32_WEIGHTS, canonical_shapes

    weights = {k: torch.empty(shape, device="meta", dtype=torch.float32 if k.rsplit(".", 1)[-1] in FP32_WEIGHTS else dtype)
               for k, shape in canonical_shapes(cfg).items()}
    return HybridModel(cfg, weights, torch.device("meta"), dtype, source="meta")
