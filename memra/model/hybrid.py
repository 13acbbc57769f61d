"""HybridModel: the whole network as a list of blocks, walked over a layer range.

One range [0, n_layers) is the unsplit model; pipeline parallelism walks N ranges with a boundary
between them. The model is built with the executor that runs its steps (memra.runner.choose: unsplit,
or the in-process pipeline its doors describe — placed, sharded and probed here, at load); the step
API's front is memra.step, its bodies memra.runner.bodies, which call the pieces here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from memra import step
from memra.cache import PRIME_CHUNK_MAX_TOKENS, Cache, CacheSnapshot
from memra.config import ModelConfig, RopeConfig
from memra.errors import MemraError
from memra.kernels.table import KernelTable, linear_module
from memra.model.block import Block
from memra.model.context import Segments, StackedStep, StepContext
from memra.model.ffn import merge_moe_fronts
from memra.model.mtp import MtpBlock
from memra.pools import KvBudget, ModelPools
from memra.runner.choose import choose_executor
from memra.settings import Settings
from memra.state_trail import StateTrail
from memra.upload import upload


def rope_inv_freq(rope: RopeConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [R/2] fp32, computed the way the reference implementations do (fp32 torch),
    with Llama-3 / linear scaling, or GGUF's per-frequency divisors (`rope_freqs.weight`)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.int64).float() / rope.dim))
    if rope.zero_pairs:  # proportional: the last pairs unrotated (angle 0: cos 1, sin 0)
        inv[inv.numel() - rope.zero_pairs:] = 0.0
    if freq_factors is not None:
        return inv / freq_factors.float()
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def per_layer_inputs(model, ids: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Gemma 4's per-layer embeddings: ids [T], scaled embeddings e [T, E] -> [T, E + L*P], e then each
    layer's input: (RMSNorm(e @ proj^T * E^-1/2) + ple_embed[ids] * P^1/2) * 2^-1/2, per layer [P]."""
    cfg, w = model.cfg, model._ple_weights
    t, n, p = ids.shape[0], cfg.n_layers, cfg.ple_dim
    if t > 1 and not model.ops.invariant:  # row by row where a row's bits depend on M (the row plan's
        # decode embeds one token, and its verify columns must be those bits): torch's CPU matmul and norms
        return torch.cat([per_layer_inputs(model, ids[j : j + 1], e[j : j + 1]) for j in range(t)])
    tok = model.ple[ids] * w["ple_embed_scale"]  # [T, L*P]
    proj = model.ops.linear(e, w["ple_model_proj"]) * cfg.hidden_size ** -0.5
    proj = model.ops.rms_norm(proj.view(t, n, p), w["ple_proj_norm"], cfg.norm_eps, True)
    side = (proj + tok.view(t, n, p)) * 2.0 ** -0.5
    return torch.cat((e, side.reshape(t, n * p)), dim=-1)


# The weights the blocks pass to ops.linear (memra.model.*), by the last part of their names; embed is the head
# of a tied model.
LINEAR_WEIGHTS = frozenset(("wqkv", "wo", "w_in", "w_gate_up", "w_down", "shared_gate_up", "shared_down", "shared_gate",
                            "router", "fc", "ple_gate", "ple_proj", "ple_model_proj", "lm_head", "embed"))


def dense_linear_shapes(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> set[tuple[int, int]]:
    """(N, K) of every plain 2-D weight of the model's dtype that a step multiplies (LINEAR_WEIGHTS)."""
    return {tuple(w.shape) for name, w in weights.items()
            if name.rsplit(".", 1)[-1] in LINEAR_WEIGHTS and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype == dtype}


class HybridModel:
    """A loaded model: its weights, its Settings (read once, at load) and the kernel table they fix,
    its cache pools, and the step API (bodies in memra.step)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 tokenizer=None, source: str = "", kv_budget: KvBudget = KvBudget(), settings: Settings | None = None,
                 view: bool = False):
        self.settings = settings if settings is not None else Settings()
        self.checkpoint_cfg = cfg  # as the checkpoint gave it: a view with other settings resolves it again
        cfg = cfg.with_gdn_state(self.settings.gdn_state_dtype)  # the GDN state's dtype: fixed now, as the kernels
        self.cfg, self.device, self.dtype, self.tokenizer, self.source = cfg, device, dtype, tokenizer, source
        self.ops = KernelTable.build(device, self.settings)  # which kernel every op runs: fixed now
        if self.ops.cublas_linear:  # cuBLAS's rows held to this model's shapes now; others keep Triton (linear_cublas)
            linear_module("cublas").hold_rows(dense_linear_shapes(weights, dtype), dtype, device)
        if self.ops.invariant and not view:  # one tensor for each MoE layer's three front weights, whatever the
            merge_moe_fronts(weights)  # door: a view may open MEMRA_MOE_FRONT (the values stay as they were)
        self._weights = weights  # what a view with other settings is built from (with_settings)
        self.is_view = view  # built by with_settings: the weights belong to the model it views
        self.embed = weights["embed"]  # [V, E]
        self.final_norm = weights["final_norm"]  # [E] fp32
        self.lm_head = weights.get("lm_head", self.embed)  # [V, E]; tied models share the embedding
        # [sum R/2] fp32: every RoPE's inverse frequencies joined (one rotary table per step; each layer
        # takes its own columns, cfg.rope_slot)
        self.inv_freq = torch.cat([rope_inv_freq(cfg.rope, weights.get("rope_freqs"))]
                                  + [rope_inv_freq(r) for r in cfg.ropes]).to(device)
        # Gemma: the embedding scale as the reference multiplies it (a 0-d tensor cast to the model dtype)
        self.embed_scale = (None if cfg.embed_scale is None
                            else torch.tensor(cfg.embed_scale).to(device=device, dtype=dtype))
        self.ple = weights.get("ple_embed")  # [V, L*P] per-layer embeddings (Gemma 4 E-variants) | None
        self._ple_weights = {} if self.ple is None else {
            "ple_model_proj": weights["ple_model_proj"], "ple_proj_norm": weights["ple_proj_norm"],
            "ple_embed_scale": torch.tensor(cfg.ple_dim ** 0.5).to(device=device, dtype=dtype)}

        def sub(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}

        self.plan_verified: dict[tuple, bool] = {}  # decode_plan: on-model checks already run, by (plan, device, kernels)
        self.pad_caches: list[Cache] = []  # scratch caches for the inert rows that fill a decode bucket
        self.decode_graphs: dict = {}  # memra.graphs: captured decode steps, by bucket and pools
        self.decode_logits: dict = {}  # ... their logits buffers, one per bucket and KV pool (read out after each replay)
        self.decode_graph_pool = None  # ... the one memory pool their captures share (they never run at once)
        self.graph_scratch: dict = {}  # memra.graphs: each pool's scratch block and slot for inert rows
        self.mixed_graphs: dict = {}  # memra.mixed_graphs: captured mixed steps, by buckets and pools
        self.mixed_logits: dict = {}  # ... their logits buffers, one per batch bucket (read out after each replay)
        self.mixed_graph_pool = None  # ... the one memory pool their captures share (they never run at once)
        self.kv_budget = kv_budget  # how much memory the cache pools may grow to (memra.pools.KvBudget)
        self._pools: dict[tuple, ModelPools] = {}  # by placement: the pools every new_cache draws from
        self.blocks = [Block(cfg, i, cfg.mixers[i], cfg.ffns[i], sub(f"layers.{i}."), self.ops)
                       for i in range(cfg.n_layers)]
        self.mtp = [MtpBlock(cfg, j, sub(f"mtp.{j}."), self.ops) for j in range(cfg.n_mtp)]
        self.executor = choose_executor(self)  # where the steps run: fixed now, with the placement

    def with_settings(self, settings: Settings) -> "HybridModel":
        """A second view of this model with other settings (another kernel table, plan, graphs, pools,
        placement) over the same weight tensors: how a gate or a benchmark compares two modes without
        touching the environment."""
        if self._weights is None:
            raise MemraError("this model's weights were sharded over a pipeline's devices; a view with other "
                             "settings needs the unsharded model (load it again)")
        return HybridModel(self.checkpoint_cfg, self._weights, self.device, self.dtype, tokenizer=self.tokenizer,
                           source=self.source, kv_budget=self.kv_budget, settings=settings, view=True)

    def with_doors(self, **doors: str | None) -> "HybridModel":
        """This model as it runs with these MEMRA_* doors set (or unset: None): a view over the same weights
        (with_settings), or the model itself where nothing changes. `m.with_doors(MEMRA_EXACT="0")`."""
        settings = self.settings.with_doors(**doors)
        return self if settings == self.settings else self.with_settings(settings)

    # --- pieces of a step ---
    def context(self, cache: Cache, pos0: int, n_tokens: int, recurrent: bool, device: torch.device | None = None,
                trail: StateTrail | None = None, column: int = 0) -> StepContext:
        """The step facts for T tokens at pos0, on `device` (a pipeline stage's; default the model's).
        A verify column passes the trail its GDN layers record their state into, and its index."""
        device = self.device if device is None else device
        positions = torch.arange(pos0, pos0 + n_tokens, device=device)
        cos, sin = self.ops.rope_cos_sin(positions, self.inv_freq.to(device), self.dtype)
        read_rows = cache.read_rows(pos0 + n_tokens, device)  # shared by every attention layer
        return StepContext(cache=cache, pos0=pos0, n_tokens=n_tokens, cos=cos, sin=sin, recurrent=recurrent,
                           kv_write_rows=read_rows[pos0:], kv_read_rows=read_rows, trail=trail, column=column)

    def column_contexts(self, cache: Cache, pos0: int, n: int, device: torch.device | None = None,
                        trail: StateTrail | None = None) -> list[StepContext]:
        """context(cache, pos0 + j, 1, recurrent=True, trail=trail, column=j) for each of a verify's n columns,
        from one read-rows table (each column's prefix is a slice of it) and one rotary call for all of them
        rather than ~10 small ops a column: the same values, as wave_contexts' (the tables are elementwise in
        the position: tests/test_cpu_flin_plan.py holds a row's tables alone to the same row among 3000)."""
        device = self.device if device is None else device
        cos, sin = self.ops.rope_cos_sin(torch.arange(pos0, pos0 + n, device=device), self.inv_freq.to(device),
                                         self.dtype)
        read_rows = cache.read_rows(pos0 + n, device)
        return [StepContext(cache=cache, pos0=pos0 + j, n_tokens=1, cos=cos[j : j + 1], sin=sin[j : j + 1],
                            recurrent=True, kv_write_rows=read_rows[pos0 + j : pos0 + j + 1],
                            kv_read_rows=read_rows[: pos0 + j + 1], trail=trail, column=j) for j in range(n)]

    def wave_contexts(self, caches, pos0s: list[int], sizes: list[int],
                      device: torch.device | None = None) -> list[StepContext]:
        """context(caches[i], pos0s[i], sizes[i], recurrent=False) for every piece of a prefill wave, from
        one upload and one rotary call for the whole wave rather than ~14 launches per piece: the same
        values (the tables are elementwise in the position; the pool rows are read_rows' arithmetic on
        the block tables, done on the host)."""
        device = self.device if device is None else device
        total = sum(sizes)
        rows = [c.host_block_rows(pos0 + n) for c, pos0, n in zip(caches, pos0s, sizes)]
        # Each piece's rows start 16 bytes into the upload's alignment (the positions padded to an even
        # count): Triton compiles a kernel per pointer alignment, and a view at an odd int64 offset would
        # cost a compile in the middle of serving.
        host = np.concatenate([np.arange(pos0, pos0 + n, dtype=np.int64) for pos0, n in zip(pos0s, sizes)]
                              + [np.zeros(total % 2, dtype=np.int64)] + rows)
        flat = upload(torch.from_numpy(host), device)  # [N positions (+1), then each piece's whole blocks' rows]
        cos, sin = self.ops.rope_cos_sin(flat[:total], self.inv_freq.to(device), self.dtype)
        ctxs, at, row_at = [], 0, total + total % 2
        for c, pos0, n, piece_rows in zip(caches, pos0s, sizes, rows):
            read_rows = flat[row_at : row_at + pos0 + n]
            ctxs.append(StepContext(cache=c, pos0=pos0, n_tokens=n, cos=cos[at : at + n], sin=sin[at : at + n],
                                    recurrent=False, kv_write_rows=read_rows[pos0:], kv_read_rows=read_rows))
            at, row_at = at + n, row_at + len(piece_rows)
        return ctxs

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, W] the layers' input: the token embeddings [T, E] (Gemma: scaled), then with
        per-layer embeddings every layer's input [T, L*P] (W = cfg.stream_width)."""
        e = self.embed[ids] if self.embed_scale is None else self.embed[ids] * self.embed_scale
        return e if self.ple is None else per_layer_inputs(self, ids, e)

    def forward_layers(self, h: torch.Tensor, ctx: StepContext, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Walk decoder layers [start, stop) — the seam pipeline parallelism cuts along."""
        for block in self.blocks[start : self.cfg.n_layers if stop is None else stop]:
            h = block.forward(h, ctx)
        return h

    def forward_layers_segments(self, h: torch.Tensor, ctxs: list[StepContext], bounds: list[tuple[int, int]],
                                start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Prompt pieces of several sequences in one walk over layers [start, stop): h [N, E], piece i in
        rows bounds[i], at the positions ctxs[i] describes (cross-request prefill, memra.step.prime_batch)."""
        wave = Segments.of(ctxs, bounds)
        for block in self.blocks[start : self.cfg.n_layers if stop is None else stop]:
            h = block.forward_segments(h, wave)
        return h

    def forward_layers_mixed(self, h: torch.Tensor, step: StackedStep, ctxs: list[StepContext],
                             bounds: list[tuple[int, int]]) -> torch.Tensor:
        """A decode step and a prefill wave in one walk over every layer: h [B + N, E], the decode rows
        (step) first, then the prompt pieces (ctxs[i] in rows B + bounds[i]; memra.step.mixed_step)."""
        wave = Segments.of(ctxs, bounds)
        for block in self.blocks:
            h = block.forward_mixed(h, step, wave)
        return h

    def forward_layers_stacked(self, h: torch.Tensor, ctxs: list[StepContext], start: int = 0,
                               stop: int | None = None, tokens: bool = False) -> torch.Tensor:
        """The stacked walk over layers [start, stop): h [B, E], one new token per row — B sequences of a
        batched decode, or (tokens=True) the T consecutive tokens of one sequence in a verify."""
        step = StackedStep.of(ctxs)
        for block in self.blocks[start : self.cfg.n_layers if stop is None else stop]:
            h = block.forward_tokens(h, step) if tokens else block.forward_stacked(h, step)
        return h

    def norm_out(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, W] (the stream) -> [T, E] final-normed."""
        if h.shape[-1] != self.cfg.hidden_size:  # the per-layer inputs ride to the end, unread now
            h = h[:, : self.cfg.hidden_size].contiguous()
        return self.ops.rms_norm(h, self.final_norm, self.cfg.norm_eps, self.cfg.zero_centered_norm)

    def logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, V] fp32: head_logits widened (exactly)."""
        return self.head_logits(h_normed).float()

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, V] in the head's own dtype (the model's: bf16 on a GPU), soft-capped in it where the model
        caps them, as its reference does. A captured step keeps these, half fp32's bytes, and widens them once as
        it reads them out (memra.graphs.widened)."""
        out = self.ops.linear(h_normed, self.lm_head)
        if self.cfg.final_softcap is not None:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out

    # --- the public step API (its front: memra.step) ---
    def pools(self, layer_devices: dict[int, torch.device] | None = None) -> ModelPools:
        """The model's cache pools for a placement (None: every layer on the model's device), made on first
        use with the model's KV budget."""
        key = tuple(sorted((i, str(d)) for i, d in (layer_devices or {}).items()))
        pools = self._pools.get(key)
        if pools is None:
            pools = self._pools[key] = ModelPools(self.cfg, self.dtype, self.device,
                                                  self.kv_budget.bytes_on(self.device), layer_devices)
        return pools

    def new_cache(self, max_ctx: int) -> Cache:
        """A sequence's cache, drawn from the pools of the model's placement: any caches of one model decode
        as one batch (decode_step_batch), on the CUDA-graphed step where it applies."""
        return step.new_cache(self, max_ctx)

    def prime(self, ids, cache: Cache, all_logits: bool = False, chunk_size: int | None = None, hidden: bool = False):
        return step.prime(self, ids, cache, all_logits=all_logits, chunk_size=chunk_size, hidden=hidden)

    def prime_batch(self, prompts, caches, chunk_size: int | None = None,
                    wave_tokens: int = PRIME_CHUNK_MAX_TOKENS) -> list[torch.Tensor]:
        return step.prime_batch(self, prompts, caches, chunk_size=chunk_size, wave_tokens=wave_tokens)

    def decode_step(self, token: int, cache: Cache) -> torch.Tensor:
        return step.decode_step(self, token, cache)

    def decode_step_batch(self, tokens, caches) -> torch.Tensor:
        return step.decode_step_batch(self, tokens, caches)

    def decode_step_batch_sampled(self, tokens, caches, samp, lean: bool = False):
        return step.decode_step_batch_sampled(self, tokens, caches, samp, lean=lean)

    def decode_step_t(self, chunk, pos0: int, cache: Cache, trail: StateTrail | None = None):
        return step.decode_step_t(self, chunk, pos0, cache, trail=trail)

    def restore(self, cache: Cache, snap: CacheSnapshot) -> None:
        cache.restore(snap)

    def __repr__(self) -> str:
        return f"HybridModel({self.cfg.arch}, {self.cfg.n_layers} layers, {self.dtype}, {self.device}, from {self.source!r})"
