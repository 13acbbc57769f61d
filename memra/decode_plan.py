"""How a decode step groups its rows: the exactness seam of batched decode.

    row      each row runs alone with B=1 shapes. Exact by construction (determinism is all it needs);
             B rows cost B forwards. The default wherever the batch-invariant kernels are not live.
    stacked  all rows in one forward, every op a batch-invariant kernel (memra.kernels.triton: frozen
             tiles, one program per row), so a row's bits cannot depend on B or on its neighbours. Only
             where those kernels run (CUDA + Triton, memra.kernels.table.KernelTable.invariant), and only after
             the self-test's kernel probes and an on-model check (`verify_plan`) pass. B=1 uses it too.
    bucket   rows run stacked in fixed buckets of BUCKET rows, padded with inert rows (scratch caches at
             position 0, never seen by a real sequence), so a row's bits come from calls of one fixed
             shape. Opt-in; verified on the model like `stacked`. Refused outright for an MoE where the
             linear is not M-invariant (CPU): each expert runs over the rows that chose it, so its M
             depends on the neighbours' routing — the bucket fixes the batch, not the experts' shapes
             (a CI CPU passed the on-model check and then changed a bf16 MoE row's bits).

MEMRA_DECODE_PLAN = auto (default: stacked where the invariant kernels are live and verified, else row)
| row | stacked | bucket. An explicit plan that fails its check is refused (ExactnessError); `auto` falls
back to row with a one-time warning, because row is exact everywhere — only slower.
"""

from __future__ import annotations

import random
import warnings

import torch

from memra.cache import BLOCK_SIZE
from memra.graphs import drop_graphs
from memra.kernels.exact import ExactnessError, platform_report
from memra.pools import ModelPools
from memra.runner.bodies import decode_stacked

BUCKET = 64
CHECK_SEQUENCES = 2 * BUCKET  # what verify_plan holds at once: an arrangement's caches and a bucket's pad rows
CPU_CHECK_ROWS = 4  # verify_plan's sequences for the stacked plan on CPU (why 4: verify_plan)
FLIN_CHECK_ROWS = 8  # ... for an fp32 model on the row-invariant linear (why 8: verify_plan)


def cpu_rows_invariant(model) -> bool:
    """Are a step's rows independent of each other on CPU? Under MEMRA_CPU_DECODE, for an fp32 model:
    - a packed dense model whose every layer the one-call plan covers (memra.kernels.cpu_layer: packed
      projections the integer-dot kernel reads, C norms, SwiGLU and attention) and whose head is packed too;
    - or, under MEMRA_CPU_FLIN too, a model whose every linear is an fp32 weight on the row-invariant kernel
      (memra.kernels.cpu_flin), its FFNs dense SwiGLU (C), its mixers attention (C norms and decode attention)
      or GDN (C q / k norms and delta-rule step, gates in whole vectors; torch's conv step and gated norm).
    Each of those kernels computes a row from that row alone (tests/test_cpu_decode.py, test_cpu_qdot.py,
    test_cpu_flin.py), and what is left is the embedding lookup, residual adds and elementwise torch ops;
    the on-model check (verify_plan) must still pass before the stacked plan is used. An MoE (its experts' row
    counts), sandwich norms or per-layer inputs (torch's GeGLU), or an fp32 linear on MKL (which picks its
    kernel by M) are not held to that, and keep the row plan."""
    ops = model.ops
    if not (ops.cpu_ops and model.device.type == "cpu" and model.dtype == torch.float32):
        return False
    head, blocks = getattr(model, "lm_head", None), getattr(model, "blocks", None)
    if head is None or blocks is None:  # a pipeline of stages (memra.pp): its layers live in other processes
        return False
    known = model.plan_verified.get(("rows_invariant",))  # decided once per model (view): a step asks each time
    if known is None:
        known = model.plan_verified[("rows_invariant",)] = _rows_invariant(model, ops, head, blocks)
    return known


def _rows_invariant(model, ops, head, blocks) -> bool:
    if _packed_layers(model):
        return True
    return (ops.flin and model.cfg.hidden_size % 8 == 0  # C norms (cpu_decode.rows_ok) for every residual norm
            and _fp32_weight(head) and all(_flin_block(b) for b in blocks))


def _packed_layers(model) -> bool:
    """Is every layer (and the head) the packed one-call plan's? (cpu_rows_invariant's first kind)"""
    from memra.kernels import cpu_layer, cpu_qdot, split

    head = model.lm_head
    return (model.ops.qdot and isinstance(head, split.SPLIT_TYPES) and cpu_qdot.supports(head)
            and all(cpu_layer.plan_for(b) is not None for b in model.blocks))


def _fp32_weight(w) -> bool:
    """Is w a plain fp32 weight, whose ops.linear (cpu_flin) gives a row the same bits at any row count? A packed
    model's layers keep the first kind's test: its check runs 4 rows (a larger check's pool was a GGUF model's
    peak resident memory), and a packed hybrid stacked has not been measured against llama.cpp yet."""
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32


def _flin_block(block) -> bool:
    from memra.model.attention import Attention
    from memra.model.ffn import Mlp
    from memra.model.gdn import GatedDeltaNet

    mixer, ffn = block.mixer, block.ffn
    if not (isinstance(ffn, Mlp) and ffn.act is None and not block.sandwich and block.ple is None
            and block.scalar is None and _fp32_weight(ffn.w_gate_up) and _fp32_weight(ffn.w_down)):
        return False
    if isinstance(mixer, Attention):
        return (mixer.head_dim % 8 == 0 and mixer.bqkv is None and not mixer.shared_kv
                and all(_fp32_weight(w) for w in (mixer.wqkv, mixer.wo)))
    if isinstance(mixer, GatedDeltaNet):
        # the C delta-rule step takes an fp32 state only (a bf16 one steps on torch's ops, not held to rows)
        return (all(_fp32_weight(w) for w in (mixer.w_in, mixer.wo)) and mixer.g.k_head_dim % 8 == 0
                and mixer.g.state_dtype == "float32")
    return False


def _plan_ok(model, plan: str) -> tuple[bool, str]:
    """Is `plan` usable on this model now? (verdict, why not). The on-model check runs once per model."""
    if plan == "stacked":
        if not (model.ops.invariant or cpu_rows_invariant(model)):
            return False, "the batch-invariant kernels are not live here (they need CUDA, Triton and MEMRA_TRITON=1)"
        broken = [f for f in platform_report(model.dtype, model.device, model.ops.linear_family) if f.startswith("triton")]
        if broken:
            return False, f"the kernel self-test found rows that change with the batch: {', '.join(broken[:3])}"
    if plan == "bucket" and model.cfg.moe is not None and not model.ops.invariant:
        return False, ("an MoE's experts each run over the rows that chose them, and without the M-invariant "
                       "kernels those row counts (set by the neighbours' routing) change a row's bits")
    key = (plan, str(model.device), model.ops.invariant)
    if key not in model.plan_verified:
        model.plan_verified[key] = verify_plan(model, plan)
    if not model.plan_verified[key]:
        return False, "a row's logits changed with its position or neighbours in the on-model check"
    return True, ""


def decode_plan(model) -> str:
    """The plan for this model now: the door, resolved and verified."""
    want = model.settings.decode_plan  # MEMRA_DECODE_PLAN, checked when the settings were read
    if want == "row":
        return "row"
    if want == "auto":
        if not (model.ops.invariant or cpu_rows_invariant(model)):
            return "row"
        ok, why = _plan_ok(model, "stacked")
        if not ok:
            warnings.warn(f"exact decode falls back to the row plan (one forward per sequence) on {model.device}: {why}",
                          stacklevel=3)
            return "row"
        return "stacked"
    ok, why = _plan_ok(model, want)
    if not ok:
        raise ExactnessError(f"MEMRA_DECODE_PLAN={want} refused for {model.cfg.arch} on {model.device} {model.dtype}: "
                             f"{why}; use MEMRA_DECODE_PLAN=row (exact, per row)")
    return want


def settle_plan(model) -> None:
    """Resolve the exact plan now, before an engine takes its share of the device (decide once), and give
    back the pools its on-model check drew from. The check opens BUCKET caches of the model's own pools,
    which are sized from the memory free when they are first made: made after an engine's pools, they can
    hold fewer sequences than the check asks for (a Qwen3.5-9B at max_batch 256 on an H100 left room for 35
    recurrent slots; the check wanted 64, and the engine stopped before its first token)."""
    if not model.settings.exact:
        return
    before = set(model._pools)
    if () not in model._pools:
        model._pools[()] = check_pools(model)
    decode_plan(model)
    made = [key for key in model._pools if key not in before]
    for key in made:
        pools = model._pools.pop(key)
        drop_graphs(model, pools.kv, pools.rec)  # what the check captured over them (on a GPU) goes with them
    if made and model.device.type == "cuda":
        torch.cuda.empty_cache()  # the freed pools, back to the driver: the engine sizes itself from what is free


def check_pools(model) -> ModelPools:
    """Pools for the plan check alone, sized for the sequences it holds at once (an arrangement's caches and
    a bucket's pad rows), not from the model's KV budget: a budget meant for a few contexts (a small
    --kv-memory) holds fewer recurrent slots than the check opens, and the check would stop the engine."""
    per_sequence = -(-32 // BLOCK_SIZE) + 1  # verify_plan's caches hold 32 tokens; one block of slack
    return ModelPools(model.cfg, model.dtype, model.device, budget_bytes=1 << 62, max_slots=CHECK_SEQUENCES,
                      max_blocks=CHECK_SEQUENCES * per_sequence, first_tokens=BLOCK_SIZE)


def pad_caches(model, n: int):
    """n scratch caches reset to an empty sequence: the inert rows that fill a bucket."""
    while len(model.pad_caches) < n:
        model.pad_caches.append(model.new_cache(16))
    pads = model.pad_caches[:n]
    for c in pads:
        c.reset()
        c.reserve(1)
    return pads


def decode_bucketed(model, ids: torch.Tensor, caches, stacked) -> torch.Tensor:
    """Rows in buckets of BUCKET, each padded with inert rows; `stacked(model, ids, caches)` runs one bucket."""
    out = []
    for a in range(0, len(caches), BUCKET):
        group = caches[a : a + BUCKET]
        pad = BUCKET - len(group)
        bucket_ids = torch.cat((ids[a : a + BUCKET], ids.new_zeros(pad)))
        out.append(stacked(model, bucket_ids, list(group) + pad_caches(model, pad))[: len(group)])
    return torch.cat(out)


@torch.inference_mode()
def verify_plan(model, plan: str, seed: int = 0) -> bool:
    """Decode the same BUCKET sequences (uneven prompts) in four arrangements — all in order, all
    shuffled, only the first half, and three of them alone — under `plan` ("stacked" or "bucket"),
    and require every sequence's row to have the same bits in every arrangement. A check on this
    model's real shapes, not a proof: it is the evidence a stacking plan needs before it is used."""
    run = (lambda ids, caches: decode_bucketed(model, ids, caches, decode_stacked)) if plan == "bucket" else \
        (lambda ids, caches: decode_stacked(model, ids, caches))

    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    # On CPU (cpu_rows_invariant: every kernel computes a row from that row alone) a few rows show the same:
    # 4 still change each row's batch (4, 2, 1), place and neighbours. 64 cost a 300M model 11 s of its load,
    # and each row holds a KV block for the check (1.5 MiB on the GGUF bench's 300M Qwen3): at 8 rows the
    # check's pool was that model's peak resident memory (issue 48; tests/test_host_memory.py: the canaries).
    # An fp32 model on the row-invariant linear (cpu_flin) holds 8: its torch elementwise ops run whole vectors
    # of 2 x 16 and finish a call's last elements in scalar code, so a row's bits could change only once the
    # batch's elements fill one (4 rows of a 4-head gate do not, 8 do: cpu_gdn.gates_rows' canary)
    if model.device.type == "cuda" or plan == "bucket":
        want = BUCKET
    else:
        want = CPU_CHECK_ROWS if _packed_layers(model) else FLIN_CHECK_ROWS
    n = _check_rows(model, want)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 15))] for _ in range(n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    arrangements = [list(range(n)), shuffled, list(range(n // 2))] + [[i] for i in range(3)]
    seen: dict[int, torch.Tensor] = {}
    for order in arrangements:
        caches = [model.new_cache(32) for _ in order]
        for i, c in zip(order, caches):
            model.prime(prompts[i], c)
            c.reserve(1)
        ids = torch.tensor([tokens[i] for i in order], device=model.device)
        rows = run(ids, caches)
        for r, i in enumerate(order):
            if i in seen and not torch.equal(rows[r], seen[i]):
                return False
            seen.setdefault(i, rows[r])
        for c in caches:
            c.free()
    return True


def _check_rows(model, want: int) -> int:
    """How many sequences verify_plan holds at once: `want`, or fewer where a hybrid's recurrent pool cannot
    hand out that many slots (a 35B MoE on an 80 GB card keeps 18-31 beside its weights), never fewer than
    the three it decodes alone. Fewer rows still change each row's batch size, place and neighbours."""
    rec = model.pools().rec if hasattr(model, "pools") else None
    if rec is None:
        return want
    obtainable = rec.max_slots - (rec.n_slots - len(rec.free))
    return max(3, min(want, obtainable))


def verify_bucket(model, seed: int = 0) -> bool:
    return verify_plan(model, "bucket", seed)
