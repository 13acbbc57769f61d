"""Every MEMRA_* door, parsed, validated and explained in one place, and read once.

`Settings.from_env()` reads the process environment once, when a model is loaded; from then on every
part of the engine reads the frozen `Settings` it was handed (model.settings) and nothing reads
os.environ again, so no step can change behaviour halfway through a run. A comparison of two modes
(exact against fast, graphs on against off, a pipeline split against none) builds a second view of the
model with other settings (HybridModel.with_settings: the same weights); nothing mutates the
environment. The doors' names, defaults and refusals mirror the reference system's.

This is also the one module that touches the process environment at all: the launcher's variables
(torchrun's WORLD_SIZE, RANK, ...) and the MEMRA_PP_DIST_* doors are read through `process_env()`,
and whether a progress bar may draw (`show_progress`) looks at CI here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from memra.errors import MemraError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
DECODE_PLANS = ("auto", "row", "stacked", "bucket")
ADMISSION_ORDERS = ("auto", "fcfs", "lof")  # MEMRA_ADMISSION_ORDER's values: the waiting queue's order (memra.engine.admission)
MIXED_TOKEN_LIMITS = (512, 1024, 2048)  # MEMRA_MIXED_TOKENS's values: the largest captured prompt bucket
GDN_STATE_CHOICES = ("auto", "float32", "bfloat16")  # MEMRA_GDN_STATE_DTYPE's values (config.model.GDN_STATE_DTYPES)


def gdn_state_choice(value, name: str) -> str:
    """vLLM's mamba_ssm_cache_dtype (`name` as the caller spells it) as Settings.gdn_state_dtype, or one line."""
    if value not in GDN_STATE_CHOICES:
        raise MemraError(f"{name} {value!r} is not supported: memra stores the GDN state in float32 or bfloat16 "
                         "(auto: the checkpoint's mamba_ssm_dtype, else float32)")
    return value


def process_env() -> Mapping[str, str]:
    """The process environment, for the launcher's variables (torchrun) and the dist doors."""
    return os.environ


def flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise MemraError(f"{name}={raw!r} is not a boolean; use 1/0 (or true/false, on/off)")


def _auto_flag(env: Mapping[str, str], name: str) -> str:
    """A door that is auto (unset or "auto") or a boolean -> "auto", "1" or "0"."""
    raw = env.get(name)
    if raw is None or raw.strip().lower() in ("", "auto"):
        return "auto"
    v = raw.strip().lower()
    if v not in _TRUE | _FALSE:
        raise MemraError(f"{name}={raw!r} is not auto, 1 or 0 (or true/false, on/off)")
    return "1" if v in _TRUE else "0"


def integer(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise MemraError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class Settings:
    """The doors, resolved. Every field is a MEMRA_* variable (DOORS says which and what it does)."""

    exact: bool = True
    triton: bool = True
    gdn_kernel: bool = True
    sample_kernel: bool = True
    sample_split: bool = True  # the batch sampler's rows over several programs each (triton.sampling.split_span)
    sample_prune: bool = False  # its blocks that cannot hold a row's best skip their exact fp64 scores
    rope_tile: bool = True  # the fused RoPE's programs take several heads each (triton.rope.ROPE_TILE_HEADS)
    attn_short_rows: bool = False  # in a split decode attention launch, rows of one split skip partials and combine
    attn_skip_empty: bool = True  # ... and the splits past a row's prefix write and read no partials
    attn_split_walk: bool = True  # ... and where rows are many, one program walks a row's splits
    attn_walk_combine: bool = False  # ... and merges them itself: no combine launch
    moe_fused_act: bool = True  # the experts' SwiGLU activation in their gate/up launch (triton.moe)
    moe_fused_gate: bool = False  # the shared expert's sigmoid gate in the experts' combine (triton.moe)
    moe_front: bool = False  # a MoE layer's router, shared gate and shared gate/up in one decode launch (model.ffn)
    cuda_graphs: bool = True
    decode_plan: str = "auto"
    mixed_step: str = "auto"
    gate_seed: int = 0
    gate_canary: bool = False
    cpu_qdot: bool = True  # packed GGUF linears on CPU as integer block dot products (memra.kernels.cpu_qdot)
    cpu_flin: bool = True  # CPU fp32 dense linears on the row-invariant C kernel (memra.kernels.cpu_flin)
    cpu_decode: bool = True  # CPU fp32 norms, SwiGLU, decode attention, dense layers, GDN steps in C (cpu_decode, cpu_layer, cpu_gdn)
    linear_persistent: bool = True  # large-M dense linears as a persistent TMA kernel (triton.linear_persistent)
    linear_shaped: bool = False  # the dense linears' tiles chosen from N and K as well as M (triton.linear_shaped)
    linear_cublas: bool = True  # dense linears past 64 rows on cuBLASLt without split-K, held at load (triton.linear_cublas)
    mixed_decode_width: bool = True  # a captured mixed step's decode rows on a table width of their own
    inert_padding: bool = True  # a captured step's padding rows name an inert recurrent slot (memra.kernels.slots)
    inert_skip: bool = True  # ... whose GDN step programs return at once, their outputs zeros (triton.gdn)
    mixed_tokens: int = 512  # the largest prompt-token bucket of a captured mixed step (memra.mixed_graphs)
    batched_logprobs: bool = True  # on CUDA, the sampler's logprobs over every asking row in one log-softmax
    admission_order: str = "auto"  # the order waiting requests start in: auto | fcfs | lof (memra.engine.admission)
    gdn_state_dtype: str = "auto"  # what a GDN state is stored in: auto (the checkpoint's) | float32 | bfloat16
    # The pipeline doors as set at load (MEMRA_PP_*, MEMRA_*_PP, MEMRA_PEER_PROBE, ...): memra.pp.fence
    # parses them, with the reference system's rules, when a placement is planned.
    pp_doors: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.decode_plan not in DECODE_PLANS:
            raise MemraError(f"MEMRA_DECODE_PLAN={self.decode_plan!r} is not one of {', '.join(DECODE_PLANS)}")
        if self.mixed_step not in ("auto", "1", "0"):
            raise MemraError(f"MEMRA_MIXED_STEP={self.mixed_step!r} is not auto, 1 or 0")
        if self.linear_shaped and not self.linear_persistent:
            raise MemraError("MEMRA_LINEAR_SHAPED=1 needs MEMRA_LINEAR_PERSISTENT=1: it chooses the persistent kernel's "
                             "tile for calls of more than 256 rows")
        if self.linear_cublas and self.linear_shaped:
            raise MemraError("MEMRA_LINEAR_CUBLAS=1 and MEMRA_LINEAR_SHAPED=1 name two different dense linears; "
                             "set one of them")
        if self.admission_order not in ADMISSION_ORDERS:
            raise MemraError(f"MEMRA_ADMISSION_ORDER={self.admission_order!r} is not one of {', '.join(ADMISSION_ORDERS)}")
        if self.mixed_tokens not in MIXED_TOKEN_LIMITS:
            raise MemraError(f"MEMRA_MIXED_TOKENS={self.mixed_tokens} is not one of "
                             f"{', '.join(map(str, MIXED_TOKEN_LIMITS))}")
        if self.gdn_state_dtype not in GDN_STATE_CHOICES:
            raise MemraError(f"MEMRA_GDN_STATE_DTYPE={self.gdn_state_dtype!r} is not one of {', '.join(GDN_STATE_CHOICES)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """The doors as `env` (default: the process environment, read now) sets them."""
        e = process_env() if env is None else env
        return cls(
            exact=flag(e, "MEMRA_EXACT", True),
            triton=flag(e, "MEMRA_TRITON", True),
            gdn_kernel=flag(e, "MEMRA_GDN_KERNEL", True),
            sample_kernel=flag(e, "MEMRA_SAMPLE_KERNEL", True),
            sample_split=flag(e, "MEMRA_SAMPLE_SPLIT", True),
            sample_prune=flag(e, "MEMRA_SAMPLE_PRUNE", False),
            rope_tile=flag(e, "MEMRA_ROPE_TILE", True),
            attn_short_rows=flag(e, "MEMRA_ATTN_SHORT_ROWS", False),
            attn_skip_empty=flag(e, "MEMRA_ATTN_SKIP_EMPTY", True),
            attn_split_walk=flag(e, "MEMRA_ATTN_SPLIT_WALK", True),
            attn_walk_combine=flag(e, "MEMRA_ATTN_WALK_COMBINE", False),
            moe_fused_act=flag(e, "MEMRA_MOE_FUSED_ACT", True),
            moe_fused_gate=flag(e, "MEMRA_MOE_FUSED_GATE", False),
            moe_front=flag(e, "MEMRA_MOE_FRONT", False),
            cuda_graphs=flag(e, "MEMRA_CUDA_GRAPHS", True),
            decode_plan=(e.get("MEMRA_DECODE_PLAN") or "auto").strip().lower() or "auto",
            mixed_step=_auto_flag(e, "MEMRA_MIXED_STEP"),
            gate_seed=integer(e, "MEMRA_GATE_SEED", 0),
            gate_canary=flag(e, "MEMRA_GATE_CANARY", False),
            cpu_qdot=flag(e, "MEMRA_CPU_QDOT", True),
            cpu_decode=flag(e, "MEMRA_CPU_DECODE", True),
            cpu_flin=flag(e, "MEMRA_CPU_FLIN", True),
            linear_persistent=flag(e, "MEMRA_LINEAR_PERSISTENT", True),
            linear_shaped=flag(e, "MEMRA_LINEAR_SHAPED", False),
            # on unless asked off, or MEMRA_LINEAR_SHAPED=1 asks for the Triton tiles it chooses
            linear_cublas=flag(e, "MEMRA_LINEAR_CUBLAS", not flag(e, "MEMRA_LINEAR_SHAPED", False)),
            mixed_decode_width=flag(e, "MEMRA_MIXED_DECODE_WIDTH", True),
            inert_padding=flag(e, "MEMRA_INERT_PADDING", True),
            inert_skip=flag(e, "MEMRA_INERT_SKIP", True),
            mixed_tokens=integer(e, "MEMRA_MIXED_TOKENS", 512),
            batched_logprobs=flag(e, "MEMRA_BATCHED_LOGPROBS", True),
            admission_order=(e.get("MEMRA_ADMISSION_ORDER") or "auto").strip().lower() or "auto",
            gdn_state_dtype=(e.get("MEMRA_GDN_STATE_DTYPE") or "auto").strip().lower() or "auto",
            pp_doors=tuple(sorted((k, v) for k, v in e.items() if _is_pp_door(k))),
        )

    @property
    def pp_env(self) -> dict[str, str]:
        """The pipeline doors as a mapping, for memra.pp.fence."""
        return dict(self.pp_doors)

    def mixes_steps(self) -> bool:
        """MEMRA_MIXED_STEP: may a step's decode rows and prefill chunks run as one forward
        (memra.step.mixed_step)? auto and 1: yes; 0: never (the two calls)."""
        return self.mixed_step != "0"

    def mixes_eagerly(self, device_type: str) -> bool:
        """... and where no captured mixed step applies (memra.mixed_graphs), launched one kernel at a time?
        auto: only where decode steps are not replayed from CUDA graphs. On a GPU an eager mixed forward
        is host-bound: served, its steps took 28.2 ms against 20.7 for the graphed decode plus the
        prefill (8B shape, H200), although its kernels need 10 ms where the two calls' need 13."""
        if self.mixed_step == "auto":
            return not (device_type == "cuda" and self.cuda_graphs)
        return self.mixed_step == "1"

    def in_one_process(self) -> "Settings":
        """These settings with the in-process fence shut (MEMRA_PP_STAGES unset): how each rank of a
        process-per-stage pipeline loads its model (memra.pp.dist reads the fence for the ranks itself)."""
        return self.replace(pp_doors=tuple((k, v) for k, v in self.pp_doors if k != "MEMRA_PP_STAGES"))

    def replace(self, **changes) -> "Settings":
        """These settings with some doors changed (a second view of a model: HybridModel.with_settings)."""
        return dataclasses.replace(self, **changes)

    def as_env(self) -> dict[str, str]:
        """These settings as the environment variables that give them."""
        on = lambda b: "1" if b else "0"  # noqa: E731
        return {"MEMRA_EXACT": on(self.exact), "MEMRA_TRITON": on(self.triton), "MEMRA_GDN_KERNEL": on(self.gdn_kernel),
                "MEMRA_SAMPLE_KERNEL": on(self.sample_kernel), "MEMRA_SAMPLE_SPLIT": on(self.sample_split),
                "MEMRA_SAMPLE_PRUNE": on(self.sample_prune),
                "MEMRA_ROPE_TILE": on(self.rope_tile), "MEMRA_ATTN_SHORT_ROWS": on(self.attn_short_rows),
                "MEMRA_ATTN_SKIP_EMPTY": on(self.attn_skip_empty), "MEMRA_ATTN_SPLIT_WALK": on(self.attn_split_walk),
                "MEMRA_ATTN_WALK_COMBINE": on(self.attn_walk_combine),
                "MEMRA_MOE_FUSED_ACT": on(self.moe_fused_act), "MEMRA_MOE_FUSED_GATE": on(self.moe_fused_gate),
                "MEMRA_MOE_FRONT": on(self.moe_front),
                "MEMRA_CUDA_GRAPHS": on(self.cuda_graphs),
                "MEMRA_DECODE_PLAN": self.decode_plan, "MEMRA_MIXED_STEP": self.mixed_step,
                "MEMRA_GATE_SEED": str(self.gate_seed), "MEMRA_GATE_CANARY": on(self.gate_canary), "MEMRA_CPU_QDOT": on(self.cpu_qdot),
                "MEMRA_CPU_DECODE": on(self.cpu_decode), "MEMRA_CPU_FLIN": on(self.cpu_flin), "MEMRA_LINEAR_PERSISTENT": on(self.linear_persistent),
                "MEMRA_LINEAR_SHAPED": on(self.linear_shaped), "MEMRA_LINEAR_CUBLAS": on(self.linear_cublas),
                "MEMRA_MIXED_DECODE_WIDTH": on(self.mixed_decode_width), "MEMRA_MIXED_TOKENS": str(self.mixed_tokens),
                "MEMRA_INERT_PADDING": on(self.inert_padding), "MEMRA_INERT_SKIP": on(self.inert_skip),
                "MEMRA_BATCHED_LOGPROBS": on(self.batched_logprobs), "MEMRA_ADMISSION_ORDER": self.admission_order,
                "MEMRA_GDN_STATE_DTYPE": self.gdn_state_dtype, **self.pp_env}

    def with_doors(self, **doors: str | None) -> "Settings":
        """These settings with some doors set (a value, parsed as from the environment) or unset (None):
        `settings.with_doors(MEMRA_EXACT="0", MEMRA_PP_STAGES="2")`."""
        env = self.as_env()
        if "MEMRA_LINEAR_SHAPED" in doors and "MEMRA_LINEAR_CUBLAS" not in doors and self.linear_cublas != self.linear_shaped:
            del env["MEMRA_LINEAR_CUBLAS"]  # at its default, which follows SHAPED's (from_env): it moves with it
        for name, value in doors.items():
            if name not in env and not _is_pp_door(name):
                raise MemraError(f"{name} is not a door Settings holds (see memra.settings.DOORS)")
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return Settings.from_env(env)


# (variable, default, meaning): docs/SETTINGS.md's table of doors is this list.
DOORS: tuple[tuple[str, str, str], ...] = (
    ("MEMRA_EXACT", "1", "the exact path; 0 = the fast path, whose bits may depend on the batch and the chunking"),
    ("MEMRA_TRITON", "1", "the batch-invariant Triton kernels on CUDA; 0 = torch ops (not batch-invariant)"),
    ("MEMRA_GDN_KERNEL", "1", "GDN's chunked prefill as two Triton launches on CUDA; 0 = the torch chunk loop"),
    ("MEMRA_SAMPLE_KERNEL", "1", "a batch's seeded sampling in one Triton launch on CUDA; 0 = row by row"),
    ("MEMRA_SAMPLE_SPLIT", "1", "that launch walks each row's vocabulary in parts, one program a part (more parts the "
     "fewer the rows, none past 1,024 rows), and a second launch keeps each row's best: the same tokens; at one row "
     "of a 248k vocabulary 0.16 ms a call against 0.74 on an H100; 0 = one program a row"),
    ("MEMRA_SAMPLE_PRUNE", "0", "1 = in that launch, a sampled row's block of 1,024 entries whose fp32 scores, with "
     "a margin wider than their error, stay below the row's best so far skips the exact fp64 scores (two fp64 logs "
     "an entry): the same tokens (memra.kernels.triton.sampling); off until a GPU run shows it faster"),
    ("MEMRA_ROPE_TILE", "1", "the fused RoPE and K/V write (memra.kernels.triton.rope) with 8 heads a program, so a "
     "wave of many tokens launches fewer, larger programs (the same bits); 0 = one head a program"),
    ("MEMRA_ATTN_SHORT_ROWS", "0", "1 = in a decode attention launch split at fixed positions (a row past 512 "
     "positions, or a captured step's table that wide), a row whose prefix fits in the first split writes its output "
     "there, as the unsplit launch does (in a walked launch, MEMRA_ATTN_SPLIT_WALK, at its walk's end), and its "
     "other splits and the combine skip it (memra.kernels.triton.attention; the same bits); off until a GPU run "
     "shows it faster"),
    ("MEMRA_ATTN_SKIP_EMPTY", "1", "in a decode attention launch split at fixed positions, a split past a row's "
     "prefix (a captured step's table is as wide as the longest row's max_ctx: four splits at 2,048 positions) "
     "writes no partials and the combine reads none (memra.kernels.triton.attention; the same bits); 0 = each "
     "writes and reads back an empty one"),
    ("MEMRA_ATTN_SPLIT_WALK", "1", "in a decode attention launch split at fixed positions with 1,024 (row, KV "
     "head) programs or more (with MEMRA_ATTN_SKIP_EMPTY), each program walks its row's positions in one loop, "
     "storing each split's partial at its last block (with MEMRA_ATTN_SHORT_ROWS, a short row's output at its end), "
     "so a captured step's many short rows launch no programs for the splits past their prefixes "
     "(memra.kernels.triton.attention; the same bits); 0 = a program a split"),
    ("MEMRA_ATTN_WALK_COMBINE", "0", "1 = a walked decode attention launch (MEMRA_ATTN_SPLIT_WALK) writes every row's "
     "output itself: a row of one split at its walk's end, a longer one by reading its splits' partials back and "
     "merging them with the combine's arithmetic, so no combine is launched (memra.kernels.triton.attention; the same "
     "bits); off until a GPU run shows it faster"),
    ("MEMRA_MOE_FUSED_ACT", "1", "the grouped experts' SwiGLU activation in their gate/up launch's epilogue "
     "(memra.kernels.triton.moe), as the dense linears' fused SwiGLU: one launch fewer a MoE layer and no [pairs, "
     "2F] product in memory; the same bits; 0 = the activation as a launch of its own"),
    ("MEMRA_MOE_FUSED_GATE", "0", "1 = the shared expert's sigmoid gate (Qwen3.5 / Qwen3-Next MoE) in the grouped "
     "experts' combine launch, with torch's steps (memra.kernels.triton.moe): two launches fewer a MoE layer (the "
     "sigmoid and the product); off until a GPU run shows its bits equal to torch's and the step faster"),
    ("MEMRA_MOE_FRONT", "0", "1 = a MoE layer with a gated shared expert reads its router, its shared expert's gate "
     "and its shared gate/up as one weight in one launch at decode (up to 16 rows, the Triton kernel's GEMV bucket, "
     "where a column's bits do not depend on the weight's other rows; memra.model.ffn.merge_moe_fronts lays the "
     "three out as one tensor at load on the exact CUDA path): two launches fewer a layer; off until a GPU run "
     "shows the step faster"),
    ("MEMRA_CUDA_GRAPHS", "1", "replay decode steps from captured CUDA graphs; 0 = eager"),
    ("MEMRA_DECODE_PLAN", "auto", "how a decode batch groups its rows: auto | row | stacked | bucket"),
    ("MEMRA_MIXED_STEP", "auto", "a step's decode rows and prefill chunks in one forward: auto = a captured graph "
     "where decode steps are graphed (else the two calls), eager elsewhere (CPU, MEMRA_CUDA_GRAPHS=0) | 1 = "
     "eager too where no graph fits | 0"),
    ("MEMRA_CPU_QDOT", "1", "packed GGUF linears on CPU as int8 block dot products (a C file built at first use); "
     "0 = the tiled twin (dequantize a tile, then BLAS): other bits, 7-8x slower"),
    ("MEMRA_CPU_DECODE", "1", "fp32 on CPU: RMSNorm, SwiGLU and decode attention (RoPE, K/V write, every head) in C, "
     "in fixed orders of their own (memra.kernels.decode_reference), a packed dense layer's decode step in one call "
     "(memra.kernels.cpu_layer), and GDN's q/k norms and delta-rule step (memra.kernels.cpu_gdn); a packed dense "
     "model's rows then decode as one stacked forward (memra.decode_plan.cpu_rows_invariant); memra.train's walk "
     "mirrors them (E11 holds either way). 0 = torch's ops for those steps (slower, other bits; each row then runs "
     "alone). Without a C++ compiler the torch ops run, with a one-line notice"),
    ("MEMRA_CPU_FLIN", "1", "fp32 on CPU, exact path: the dense linears (projections, FFN, head) on a C kernel whose every output "
     "is 16 fma lanes over K and one fixed tree (memra.kernels.cpu_flin, twin flin_reference), so a row's bits do "
     "not depend on how many rows share the call (MKL picks its kernel by the row count); with MEMRA_CPU_DECODE an "
     "fp32 model's rows then decode as one stacked forward (memra.decode_plan.cpu_rows_invariant) and memra.train "
     "takes a sequence's generated tokens a layer at a time. 0 = torch's (MKL's) linears, each row decoded alone"),
    ("MEMRA_LINEAR_PERSISTENT", "1", "on CUDA in exact mode, the dense linears of more than 256 rows as one persistent "
     "Triton kernel (tensor descriptors, one large tile, tiles walked in grouped order by one program per SM), with "
     "the bucket kernel's bits (memra.kernels.triton.linear_persistent); 0 = the bucket kernel at every M"),
    ("MEMRA_LINEAR_SHAPED", "0", "1 = on CUDA in exact mode, each dense linear call's tile chosen from N and K as well "
     "as M, by a cost model of waves over the SMs (memra.kernels.triton.linear_shaped): at 128-512 rows the narrow "
     "projections (o, down, qkv) then leave fewer SMs idle; the same bits (a tile never changes them); needs "
     "MEMRA_LINEAR_PERSISTENT=1; off until a GPU run shows it faster"),
    ("MEMRA_LINEAR_CUBLAS", "1", "on CUDA in exact mode, the dense linears of more than 64 rows on cuBLASLt with "
     "split-K forbidden (memra.kernels.triton.linear_cublas), with the Triton kernels' bits: at load every dense "
     "weight shape of the model is run at every row count cuBLAS takes (65-1,024, then every 8th to 4,096) against "
     "the Triton kernel's rows; a shape whose rows differ anywhere keeps the Triton kernel, named in one line on "
     "stderr; SwiGLU's activation and the residual add run apart there; sets torch's cuBLAS flags for the process; "
     "0 = the Triton kernels at every M; off by default where MEMRA_LINEAR_SHAPED=1, and not with it"),
    ("MEMRA_MIXED_DECODE_WIDTH", "1", "a captured mixed step's decode rows read a block table of their own width "
     "(one attention split's where every decode row fits in one), not the prompt pieces' (memra.mixed_graphs): a "
     "long prompt piece then no longer sends every decode row through the split attention and its combine; the "
     "same bits, a third table width of mixed graphs to capture; 0 = the pieces' width for every row"),
    ("MEMRA_INERT_PADDING", "1", "a captured step's padding rows (its batch bucket past the live rows) name an "
     "inert recurrent slot, whose state the Triton GDN and conv step kernels neither read nor write "
     "(memra.kernels.slots); no live row's bits change; 0 = they name the pools' scratch slot, which every padding "
     "row then reads and writes whole"),
    ("MEMRA_INERT_SKIP", "1", "under MEMRA_INERT_PADDING, the Triton GDN step's programs of an inert row return "
     "at once, its output zeros; no live row's bits change; 0 = they step a zero state that nothing reads "
     "(tools/gpu_tune_gdn_step.py times the padded launch both ways)"),
    ("MEMRA_MIXED_TOKENS", "512", "the largest prompt-token bucket of a captured mixed step: 512, 1024 or 2048. "
     "Larger buckets let a wide batch's default split budget (EngineConfig.split_budget) prefill that many prompt "
     "tokens a step and still replay one graph, so the running set fills in fewer steps; more graphs to capture at "
     "warm-up, the same bits (every kernel is batch-invariant); 512 until a GPU run shows a larger one faster"),
    ("MEMRA_BATCHED_LOGPROBS", "1", "on CUDA, the sampler takes the logprobs of every row that asks for them in one "
     "log-softmax over those rows, a gather and a count (memra.engine.sampler.logprob_numbers; a vocabulary that is "
     "not a multiple of 4 keeps the rows apart), not some seven launches a row: the same bits (CUDA's softmax "
     "reduces each row alone); 0 = row by row"),
    ("MEMRA_ADMISSION_ORDER", "auto", "the order waiting requests start in: fcfs = first come first served, lof = "
     "longest output first (largest max_tokens first, arrival order among equal ones; SGLang's --schedule-policy "
     "lof), auto = lof where every request of a run comes at once (memra.LLM: `memra generate`, `memra bench "
     "throughput`), fcfs in the server: offline the long requests no longer start late and leave a tail of few-row "
     "steps, served under load short requests would wait behind long ones; changes no output bit "
     "(memra.engine.admission)"),
    ("MEMRA_GDN_STATE_DTYPE", "auto", "what a GDN layer's delta-rule state is stored in between steps (cache slots, "
     "prefix snapshots, a verify's trail): auto = the checkpoint's `mamba_ssm_dtype` (float32 where it names none: "
     "Qwen3.5 names float32), float32, or bfloat16 = half the bytes every decode token reads and writes (vLLM's "
     "--mamba-ssm-cache-dtype bfloat16). The kernels compute in fp32 and round the state wherever a path stores it "
     "(after every token, after every 64-token chunk), so every exactness promise holds within the dtype chosen; "
     "the two dtypes give different tokens"),
    ("MEMRA_GATE_SEED", "0", "`memra gate`: the prompts' seed"),
    ("MEMRA_GATE_CANARY", "0", "`memra gate`: 1 corrupts one arm on purpose; the gate must then fail"),
    ("MEMRA_API_KEY", "unset", "`memra serve`: the API key when neither --api-key nor --api-key-file gives one"),
    ("MEMRA_PP_STAGES / _SPLITS / _SPLIT", "off", "in-process pipeline: stage count, cut layers (memra.pp.fence)"),
    ("MEMRA_PP_DEVICES, MEMRA_PP_SHARD, MEMRA_PP_STREAMS, MEMRA_PP_OVERLAP, MEMRA_DUAL_PP, MEMRA_PP_HOST_BOUNCE, "
     "MEMRA_PEER_PROBE, MEMRA_BATCH_PP, MEMRA_PRIME_PP, MEMRA_PRIME_PIPE, MEMRA_SPEC_PP, "
     "MEMRA_PP_ALLOW_UNSPLIT_BATCH, MEMRA_DUAL_PP_TIMING", "see memra.pp.fence",
     "the pipeline's placement, transports and bodies, as the reference system's doors"),
    ("MEMRA_PP_DIST_*", "see memra.pp.dist_launch", "process pipelines: backend, timeouts, shared GPUs"),
)


# The pipeline's doors (memra.pp.fence parses them): every MEMRA_PP_* variable, and these.
_PP_DOORS = frozenset({"MEMRA_DUAL_PP", "MEMRA_DUAL_PP_TIMING", "MEMRA_PEER_PROBE", "MEMRA_BATCH_PP",
                       "MEMRA_PRIME_PP", "MEMRA_PRIME_PIPE", "MEMRA_SPEC_PP"})


def _is_pp_door(name: str) -> bool:
    return name.startswith("MEMRA_PP_") or name in _PP_DOORS


def api_key() -> str | None:
    """MEMRA_API_KEY: the key `memra serve` requires when no flag gives one (kept out of the process list)."""
    return process_env().get("MEMRA_API_KEY") or None


def show_progress() -> bool:
    """A progress bar draws on an interactive terminal, and never under CI."""
    return sys.stderr.isatty() and not process_env().get("CI")
