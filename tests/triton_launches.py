"""What a CUDA model would launch in Triton, recorded on CPU: every kernel, with the argument types and the
constexprs its launcher computes there (tests/test_triton_compile.py compiles each one for real).

How. The models run on CPU under a kernel table (RecordingTable) that answers every op twice: first as a
CUDA model's table in exact mode would (the op's own dispatch, the Triton family's launcher with its
real arithmetic of tiles, buckets, splits and flags), but with each kernel object swapped for a recorder
that keeps the launch instead of running it; then through the pure-torch twin, whose value the model
goes on with. Two things make the first answer the GPU's and not the interpreter's:
- the launchers ask `_interpreting()` to choose tiles (LINEAR_INTERPRET_CONFIG), IEEE dots, libdevice and
  integer rounding; while recording it answers False in every family, so they choose what a GPU gets;
- no kernel runs while recording (the interpreter could not run some GPU choices, libdevice's exp), and
  the values come from the twin, so a model at the reference's speed drives every launch path.
A launch is kept as Triton specializes it (a tensor: dtype and 16-byte alignment; an int: 1, a multiple
of 16, its width; constexprs and options by value), so equal records compile to one kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import torch

import memra
from memra.kernels.table import KernelTable

MEMRA = Path(memra.__file__).parent
JIT_DECORATOR = re.compile(r"@triton\.jit\b")


@functools.cache
def triton_modules() -> tuple:
    """Every memra module whose source holds a @triton.jit, found by reading the files (not a list)."""
    names = []
    for info in pkgutil.walk_packages([str(MEMRA)], "memra."):
        path = MEMRA.joinpath(*info.name.split(".")[1:])
        path = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
        if path.exists() and JIT_DECORATOR.search(path.read_text()):
            names.append(info.name)
    return tuple(importlib.import_module(n) for n in sorted(names))


def _jit(obj):
    """The @triton.jit function of a module global (a Lean launcher wraps one), or None."""
    obj = getattr(obj, "fn", obj) if type(obj).__name__ == "Lean" else obj
    return obj if type(obj).__name__ in ("JITFunction", "InterpretedFunction") else None


@functools.cache
def jit_functions() -> dict[str, object]:
    """'module.name' -> every @triton.jit function defined in memra (launched kernels and the helpers they call)."""
    found = {}
    for mod in triton_modules():
        for name, obj in vars(mod).items():
            fn = _jit(obj)
            if fn is not None and fn.fn.__module__ == mod.__name__:
                found[f"{mod.__name__}.{name}"] = fn
    return found


def _int_like(a: int) -> int:
    """A stand-in int that Triton specializes as it specializes `a` (1; a multiple of 16; 32- or 64-bit)."""
    if a == 1:
        return 1
    wide = not -(2**31) <= a < 2**31
    if a % 16 == 0:
        return 2**32 if wide else 16
    return 2**32 + 1 if wide else 3


def describe(a) -> list:
    """One runtime argument as Triton's specialization sees it (JSON)."""
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0]
    if isinstance(a, bool):
        return ["bool", a]
    if isinstance(a, int):
        return ["int", _int_like(a)]
    if isinstance(a, float):
        return ["float"]
    if a is None:
        return ["none"]
    raise TypeError(f"a kernel launch took a {type(a).__name__}: describe() does not know it")


class Launches:
    """The distinct launches recorded: {json of (kernel, args, kwargs): count}."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def add(self, kernel: str, args, kwargs) -> None:
        key = json.dumps([kernel, [describe(a) for a in args], kwargs], sort_keys=True)
        self.seen[key] = self.seen.get(key, 0) + 1

    def records(self) -> list:
        return [json.loads(k) for k in sorted(self.seen)]


class _Recorder:
    """Stands in for a kernel object in its module: `kernel[grid](...)` is recorded, not run."""

    def __init__(self, qualname: str, launches: Launches):
        self.qualname, self.launches = qualname, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.add(self.qualname, args, kwargs)


@contextlib.contextmanager
def gpu_launches_recorded(launches: Launches):
    """While inside: every memra Triton kernel launch is recorded in `launches` (and not run), and every
    family's launcher computes its constexprs as it does on a GPU (`_interpreting()` is False)."""
    saved = []
    for qualname in jit_functions():
        mod, name = sys.modules[qualname.rsplit(".", 1)[0]], qualname.rsplit(".", 1)[1]
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, _Recorder(qualname, launches))
    for mod in triton_modules():
        if callable(getattr(mod, "_interpreting", None)):
            saved.append((mod, "_interpreting", mod._interpreting))
            mod._interpreting = lambda: False
    try:
        yield
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


class _Pass:
    mode: str | None = None  # "gpu": the recording answer; "twin": the value's; None: outside an op


class RecordingTable(KernelTable):
    """A CUDA model's table in exact mode (every Triton family on) whose ops each answer twice: recorded as
    the GPU would launch them, then computed by the twin (module docstring). Nested ops (an op calling
    another through the table) run inside the outer op's pass."""

    launches: Launches  # set by recording_table

    def _gpu(self, x) -> bool:
        return _Pass.mode == "gpu"


def _answer_twice(name: str):
    op = getattr(KernelTable, name)

    def both(self, *args, **kwargs):
        if _Pass.mode is not None:
            return op(self, *args, **kwargs)
        try:
            _Pass.mode = "gpu"
            with gpu_launches_recorded(self.launches):
                op(self, *args, **kwargs)
            _Pass.mode = "twin"
            return op(self, *args, **kwargs)
        finally:
            _Pass.mode = None

    return both


# Every public op of the table (read off the class, so a new op answers twice without being listed here).
for _name, _value in list(vars(KernelTable).items()):
    if not _name.startswith("_") and callable(_value) and not isinstance(_value, (staticmethod, classmethod)) \
            and _name != "grouped_moe":
        setattr(RecordingTable, _name, _answer_twice(_name))


def recording_table(launches: Launches, persistent_linear: bool = False, shaped_linear: bool = False,
                    sample_split: bool = False, rope_tile: bool = False, attn_short_rows: bool = False,
                    attn_skip_empty: bool = False, attn_split_walk: bool = False, attn_walk_combine: bool = False,
                    moe_fused_act: bool = False, moe_fused_gate: bool = False,
                    sample_prune: bool = False) -> RecordingTable:
    """persistent_linear: the table of a model loaded with MEMRA_LINEAR_PERSISTENT=1; shaped_linear: with
    MEMRA_LINEAR_SHAPED=1 too; sample_split: with MEMRA_SAMPLE_SPLIT=1; sample_prune: with MEMRA_SAMPLE_PRUNE=1;
    rope_tile: with MEMRA_ROPE_TILE=1; attn_short_rows: with MEMRA_ATTN_SHORT_ROWS=1; attn_skip_empty: with
    MEMRA_ATTN_SKIP_EMPTY=1; attn_split_walk: with MEMRA_ATTN_SPLIT_WALK=1; attn_walk_combine: with
    MEMRA_ATTN_WALK_COMBINE=1; moe_fused_act: with
    MEMRA_MOE_FUSED_ACT=1; moe_fused_gate: with MEMRA_MOE_FUSED_GATE=1."""
    table = RecordingTable(invariant=True, triton=True, exact=True, gdn_kernel=True, sample_kernel=True,
                           persistent_linear=persistent_linear or shaped_linear, shaped_linear=shaped_linear,
                           sample_split=sample_split, sample_prune=sample_prune, rope_tile=rope_tile,
                           attn_short_rows=attn_short_rows, attn_skip_empty=attn_skip_empty,
                           attn_split_walk=attn_split_walk, attn_walk_combine=attn_walk_combine,
                           moe_fused_act=moe_fused_act, moe_fused_gate=moe_fused_gate)
    object.__setattr__(table, "launches", launches)
    return table


# --- what drives the launches: models through the engine, on the paths a GPU takes ----------------------

PROMPT_LENGTHS = (3, 12, 70, 300)  # decode rows, and prefill waves in several of the projections' M buckets


def _prompts(vocab: int, lengths) -> list[list[int]]:
    return [[(11 * i + 7 * j) % (vocab - 5) + 5 for j in range(n)] for i, n in enumerate(lengths)]


@contextlib.contextmanager
def self_test_passed():
    """The kernel self-test's report, as on a GPU where it passed: nothing broken. (On CPU it reports the
    twin's rows that change with the batch, which would keep the engine off the paths a GPU takes: whole
    invariant pieces, prompts of several sequences in one wave, stacked decode.)"""
    import memra.decode_plan
    import memra.step

    saved = [(m, m.platform_report) for m in (memra.step, memra.decode_plan)]
    for m, _ in saved:
        m.platform_report = lambda dtype, device, linear_family="bucket": []
    try:
        yield
    finally:
        for m, f in saved:
            m.platform_report = f


def stacked(model):
    """The model with a GPU's decode plan (stacked rows) and mixed steps. The plan's on-model check compares
    the twin's bits, which change with the batch on CPU; the launches of a stacked step are what is wanted
    here, so the check is taken as passed."""
    model = model.with_doors(MEMRA_DECODE_PLAN="stacked", MEMRA_MIXED_STEP="1")
    model.plan_verified[("stacked", str(model.device), True)] = True
    return model


def drive_model(model, lengths=PROMPT_LENGTHS) -> None:
    """A model through the engine as a GPU serves it: stacked decode, mixed steps, prefill waves of
    several prompts' pieces, greedy, sampled and filtered rows."""
    from memra.engine.llm import LLM
    from memra.sampling import SamplingParams

    model = stacked(model)
    llm = LLM(model, max_batch=4, max_ctx=max(lengths) + 8)
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, temperature=0.8, seed=1),
              SamplingParams(max_tokens=3, temperature=0.7, top_k=20, top_p=0.9, seed=2), SamplingParams(max_tokens=3)]
    llm.generate(_prompts(model.cfg.vocab_size, lengths), params, use_tqdm=False)


def drive_api(model, lengths) -> None:
    """The model API's batched paths (for a model with no tokenizer, which the engine refuses): the prompts
    primed as waves of their pieces, then a stacked decode step of every row."""
    model = stacked(model)
    with torch.inference_mode():
        caches = [model.new_cache(n + 8) for n in lengths]
        lasts = model.prime_batch(_prompts(model.cfg.vocab_size, lengths), caches)
        model.decode_step_batch([int(x.argmax()) for x in lasts], caches)


def drive_ffn_alone(model) -> None:
    """Each MoE block's FFN called without the residual, as Gemma's sandwich norms call it
    (h + norm(ffn(norm(h))): memra.model.block): a decode row and a few prompt rows."""
    with torch.inference_mode():
        for block in model.blocks:
            if type(block.ffn).__name__ == "Moe":
                for rows in (1, 8):
                    block.ffn.forward(torch.randn(rows, model.cfg.hidden_size).to(model.dtype))


def drive_solo(model) -> None:
    """The model API's own one-sequence paths (memra.load users, the gates): a prompt primed alone (the
    prefill kernels without a pieces table) and a lone decode step."""
    model = stacked(model)
    with torch.inference_mode():
        cache = model.new_cache(96)
        logits = model.prime(_prompts(model.cfg.vocab_size, (70,))[0], cache)
        model.decode_step(int(logits.argmax()), cache)


def _k_quant(qtype, n: int, k: int, dtype):
    """A K-quant weight of random bytes with finite scales (memra quantizes only to Q8_0 and Q4_K)."""
    from memra.kernels import quant
    from memra.kernels.split import split_layout
    from memra.loading.dequant import SCALE_FIELDS

    gen = torch.Generator().manual_seed(3)
    block, block_bytes = quant.PACKABLE[qtype]
    data = torch.randint(0, 256, (n, k // block, block_bytes), generator=gen, dtype=torch.uint8)
    for at in SCALE_FIELDS[qtype]:
        data[..., at: at + 2] = torch.randn(n, k // block, 1, generator=gen).mul(0.01).half().view(torch.uint8)
    return split_layout(quant.QuantWeight(qtype, data.reshape(n, -1).contiguous(), (n, k), dtype))


def packed_weight(kind: type, n: int, k: int, dtype):
    """One weight of each packed layout the loaders produce (memra.kernels.split.SPLIT_TYPES), by class name."""
    from gguf import GGMLQuantizationType as QType

    from memra.kernels import quant, split
    from memra.loading.gguf import cat_rows

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    builders = {
        "Q8Split": lambda: split.split_layout(quant.quantize(w, QType.Q8_0, dtype)),
        "Q4KSplit": lambda: split.split_layout(quant.quantize(w, QType.Q4_K, dtype)),
        "Q5KSplit": lambda: _k_quant(QType.Q5_K, n, k, dtype),
        "Q6KSplit": lambda: _k_quant(QType.Q6_K, n, k, dtype),
        "SplitRows": lambda: split.split_layout(cat_rows([quant.quantize(w, QType.Q4_K, dtype),
                                                          quant.quantize(w[:32], QType.Q8_0, dtype)])),
        "Fp8BlockSplit": lambda: split.Fp8BlockSplit((w * 8).to(torch.float8_e4m3fn), torch.ones(n, -(-k // 128)),
                                                     128, dtype),
        "Nvfp4Split": lambda: split.Nvfp4Split(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                               torch.ones(n, -(-k // 16)), dtype),
    }
    if kind.__name__ not in builders:
        raise AssertionError(f"no packed weight of {kind.__name__} to drive its kernel: add one to packed_weight")
    made = builders[kind.__name__]()
    assert isinstance(made, kind), f"packed_weight built a {type(made).__name__} for {kind.__name__}"
    return made


def drive_packed(table, dtype) -> None:
    """Every packed layout through the table's linear, as a packed checkpoint's projections: a decode row
    (K split into chunks summed apart) and a prefill wave past the decode bucket, with and without a bias."""
    from memra.kernels.split import SPLIT_TYPES

    n, k = 64, 2048
    for kind in SPLIT_TYPES:
        w = packed_weight(kind, n, k, dtype)
        for m in (1, 65):
            x = torch.randn(m, k).to(dtype)
            table.linear(x, w)
            table.linear(x, w, torch.zeros(w.shape[0], dtype=dtype))


def drive_dense(table, dtype) -> None:
    """The table's dense linears as a model's projections call them, at a decode row and a prefill wave past
    the persistent kernel's threshold: plain, with a bias (Qwen2's qkv), with the residual (o / down), and the
    gate|up projection with its activation. Also a [256 x 1024] weight at 200 and 300 rows and a [6144 x 256]
    one at 256, where MEMRA_LINEAR_SHAPED's table takes its other tiles (triton.linear_shaped's candidates:
    64x64 and the persistent 128x128, then the bucket kernel's 128x128)."""
    e, f = 64, 96
    w, w_gate_up = torch.randn(e, e).to(dtype), torch.randn(2 * f, e).to(dtype)
    for m in (1, 300):
        x = torch.randn(m, e).to(dtype)
        table.linear(x, w)
        table.linear(x, w, torch.zeros(e, dtype=dtype))
        table.linear_add(x, w, x)
        table.linear_silu_mul(x, w_gate_up)
    wide, wide_gate_up = torch.randn(256, 1024).to(dtype), torch.randn(512, 1024).to(dtype)
    for m in (200, 300):
        x = torch.randn(m, 1024).to(dtype)
        table.linear(x, wide)
        table.linear(x, wide, torch.zeros(256, dtype=dtype))
        table.linear_add(x, wide, torch.randn(m, 256).to(dtype))
        table.linear_silu_mul(x, wide_gate_up)
    table.linear_add(torch.randn(256, 256).to(dtype), torch.randn(6144, 256).to(dtype), torch.randn(256, 6144).to(dtype))


def drive_split_walk(table) -> None:
    """A split decode attention launch of rows enough that MEMRA_ATTN_SPLIT_WALK=1's table (with the skip: the
    walk's terms; with or without the short rows and the walk's own combine, as the table has them) walks each
    row's splits in one program, in bf16 at the Llama-3-8B and Qwen3.5 attention shapes."""
    from memra.kernels.triton.attention import WALK_PROGRAMS

    for hq, hkv, d in ((32, 8, 128), (16, 4, 256)):
        many = -(-WALK_PROGRAMS // hkv)
        q = torch.randn(many, hq, d).to(torch.bfloat16)
        kv = torch.randn(40, 16, hkv, d).to(torch.bfloat16)  # 640 positions: a row past one attention split
        table.paged_attention_rows(q, kv, kv, torch.arange(640), torch.zeros(many, dtype=torch.long),
                                   torch.tensor([3] * (many - 1) + [600]), 0.1, 640)


def drive_doors(table) -> None:
    """The ops whose launch a door reshapes, outside a model: the batch sampler over a vocabulary of many
    blocks (the fixtures' are one or two), plain and filtered rows (with MEMRA_SAMPLE_SPLIT=1's table, the
    split walk and its combine; with MEMRA_SAMPLE_PRUNE=1's, the pruned walk), the fused RoPE with its K/V write in bf16 (MEMRA_ROPE_TILE=1's heads), a
    split decode attention launch of a short and a long row (MEMRA_ATTN_SHORT_ROWS=1's and MEMRA_ATTN_SKIP_EMPTY=1's), GDN's chunked
    prefill at the model's head sizes and its state in bf16 (MEMRA_GDN_STATE_DTYPE's
    scan and recurrent step), and the grouped experts with their activation fused
    (MEMRA_MOE_FUSED_ACT=1's) and the shared expert's gate in their combine (MEMRA_MOE_FUSED_GATE=1's), a decode
    step's pairs and a prefill's, in both dtypes, and MEMRA_MOE_FRONT's decode rows (one product, read in parts)."""
    from memra.sampling import DevSamp

    logits = torch.randn(3, 20_000)
    table.sample_batch(logits, [DevSamp(1.0, 1, 0), DevSamp(0.0, 0, 0), DevSamp(0.8, 2, 1, top_k=20)])
    table.sample_batch(logits[:2], [DevSamp(1.0, 1, 0), DevSamp(0.7, 2, 1)])
    t, hq, hkv, d = 5, 12, 2, 64
    q, k, v = (torch.randn(t, h, d).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cos, sin = torch.randn(t, d).to(torch.bfloat16), torch.randn(t, d).to(torch.bfloat16)
    pool = lambda: torch.zeros(2, 16, hkv, d, dtype=torch.bfloat16)  # noqa: E731
    table.rope_write_kv(q, k, v, cos, sin, pool(), pool(), torch.arange(t))
    table.apply_rope(q, cos, sin)
    kv = torch.randn(40, 16, hkv, d).to(torch.bfloat16)  # 640 positions: a row past one attention split
    lens = torch.tensor([3, 600])
    table.paged_attention_rows(q[:2], kv, kv, torch.arange(640), torch.zeros(2, dtype=torch.long), lens, 0.1, 640)
    # GDN's chunked prefill at the Qwen3.5 head sizes (128), over two chunks: the prep's registers at its size
    qk = torch.nn.functional.normalize(torch.randn(2, 70, 2, 128), dim=-1)
    table.gdn_prefill(qk[0], qk[1], torch.randn(70, 2, 128), torch.rand(70, 2), -torch.rand(70, 2),
                      torch.zeros(2, 128, 128), 0)
    # MEMRA_GDN_STATE_DTYPE=bfloat16: the scan and the recurrent step with the state stored in bf16
    state = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    table.gdn_prefill(qk[0], qk[1], torch.randn(70, 2, 128), torch.rand(70, 2), -torch.rand(70, 2), state, 0)
    for s in (state, state.float()):  # the decode step at the 9B's head size, its state in either dtype
        table.delta_rule_step(qk[0, :3], qk[1, :3], torch.randn(3, 2, 128), torch.rand(3, 2), -torch.rand(3, 2),
                              s.expand(3, -1, -1, -1).contiguous())
    for dtype in (torch.bfloat16, torch.float32):
        w_gate_up, w_down = torch.randn(16, 64, 64).to(dtype), torch.randn(16, 64, 32).to(dtype)
        for rows in (1, 40):  # a tile per pair; tiles per expert
            x = torch.randn(rows, 64).to(dtype)
            weights, ids = table.moe_route(torch.randn(rows, 16), 2, True, dtype)
            table.moe_experts(x, weights, ids, w_gate_up, w_down, shared=x, residual=x, shared_gate=x[:, :1])
        for rows in (1, 16):  # MEMRA_MOE_FRONT's decode rows: router, gate and gate/up in one product, then its parts
            x = torch.randn(rows, 64).to(dtype)
            y = table.linear(x, torch.randn(16 + 1 + 48, 64).to(dtype))  # [rows, 65]: rows of an odd stride
            weights, ids = table.moe_route(y[:, :16], 2, True, dtype)
            shared = table.linear(table.silu_mul(y[:, 17:]), torch.randn(64, 24).to(dtype))
            table.moe_experts(x, weights, ids, w_gate_up, w_down, shared=shared, residual=x, shared_gate=y[:, 16:17])


def tiny_models(dtype) -> list:
    """Random-weight models of shapes the fixtures lack: a context past ATTN_SPLIT (the split decode) and a
    prefill wave past the projections' last bucket; an MoE with many experts beside its top-k (a decode
    step's per-pair plan), no shared expert and no renormalisation."""
    import memra.random_model as rm
    from memra.config import MoeConfig

    shapes = {"tiny-long": lambda n: rm._llama(n or 2, 64, 4, 2, 128, 256),
              "tiny-moe": lambda n: rm._hybrid(n or 4, 64, 4, 2, 16, 2, 4, 16, 0, 256,
                                               moe=MoeConfig(16, 2, 32, 0, False, False))}
    made = []
    for name, shape in shapes.items():
        rm.SHAPES[name] = shape
        try:
            made.append(rm.random_model(name, "cpu", dtype))
        finally:
            del rm.SHAPES[name]
    return made
