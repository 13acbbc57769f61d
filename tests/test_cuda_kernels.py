"""The GDN prefill and batch-sampler kernels at real sizes on the GPU (what tools/gpu_kernel_check.py and
tools/gpu_gdn_prefill.py used to print): the kernels the model's kernel table picks on CUDA, against
their pure-torch twins.

- GDN's three-launch chunked prefill, one layer of the Qwen3.5-9B shape (4096 tokens, 32 heads,
  Dk = Dv = 128): close to the reference's chunk loop (fp32: a product replaces the triangular solve),
  and the same bits when the prompt comes in two 64-aligned pieces; with the state in bf16 too
  (MEMRA_GDN_STATE_DTYPE), a wave of pieces and the verify's scan against decode steps;
- the one-launch batch sampler at B=128 over a 248k vocabulary: device_sample's token in every row
  (greedy, plain, top-k, top-p, min-p).

Small shapes of the same checks run on CPU in Triton's interpreter: tests/test_triton_kernels.py and
tests/test_sample_kernel.py (which MEMRA_TEST_DEVICE=cuda also compiles). Timings: tools/gpu_gdn_prefill.py
and tools/gpu_profile_sampler.py.
"""

from __future__ import annotations

import torch

from cuda_marks import needs_cuda
from memra.kernels import reference
from memra.kernels.exact import gdn_prefill_inputs
from memra.kernels.table import KernelTable
from memra.sampling import DevSamp, device_sample
from memra.settings import Settings

pytestmark = needs_cuda


def table() -> KernelTable:
    return KernelTable.build("cuda", Settings())  # what a model loaded on CUDA with the default doors runs


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@torch.inference_mode()
def test_gdn_prefill_kernel_at_the_9b_layer_shape():
    ops = table()
    assert ops.gdn_kernel, "the kernel table did not pick the GDN Triton kernel on CUDA"
    t, h, dk, dv = 4096, 32, 128, 128
    q, k, v, beta, decay, s0 = gdn_prefill_inputs(t, h, dk, dv)
    o_ref, s_ref = reference.gdn_prefill(q, k, v, beta, decay, s0, 0)
    o, s = ops.gdn_prefill(q, k, v, beta, decay, s0, 0)
    # fp32 noise only (the tf32x3 products are fp32-level): a wrong kernel is off by O(1)
    assert rel(o, o_ref) < 5e-4 and rel(s, s_ref) < 5e-4, f"output {rel(o, o_ref):.2e}, state {rel(s, s_ref):.2e}"
    cut = t // 2 // 64 * 64
    o1, s1 = ops.gdn_prefill(q[:cut], k[:cut], v[:cut], beta[:cut], decay[:cut], s0, 0)
    o2, s2 = ops.gdn_prefill(q[cut:], k[cut:], v[cut:], beta[cut:], decay[cut:], s1, cut)
    assert same_bits(torch.cat((o1, o2)), o), "the output's bits depend on the 64-aligned piece"
    assert same_bits(s2, s), "the final state's bits depend on the 64-aligned piece"


@torch.inference_mode()
def test_a_bf16_gdn_state_keeps_its_bits_at_the_9b_layer_shape():
    """MEMRA_GDN_STATE_DTYPE=bfloat16 on the GPU: the chunked prefill rounds its carry at every chunk, so a
    prompt in 64-aligned pieces and a wave of pieces in a pool keep the one-shot bits; the verify's scan keeps
    decode's (the state rounded after every token either way); the twins agree within one rounding of the
    state (2^-7 of the largest value, tests/test_gdn_state_dtype.py says why)."""
    from memra.kernels.pieces import RecurrentPieces
    from memra.kernels.triton import gdn as gdn_triton

    q, k, v, beta, decay, s0 = gdn_prefill_inputs(1000, 32, 128, 128)
    s0 = s0.bfloat16()
    o, s = gdn_triton.gdn_prefill(q, k, v, beta, decay, s0, 40)
    assert s.dtype == torch.bfloat16
    o_ref, s_ref = reference.gdn_prefill(q, k, v, beta, decay, s0, 40)
    assert rel(o, o_ref) < 2 ** -7 and rel(s, s_ref) < 2 ** -7, f"output {rel(o, o_ref):.2e}, state {rel(s, s_ref):.2e}"
    cut = 472  # position 512
    o1, s1 = gdn_triton.gdn_prefill(q[:cut], k[:cut], v[:cut], beta[:cut], decay[:cut], s0, 40)
    o2, s2 = gdn_triton.gdn_prefill(q[cut:], k[cut:], v[cut:], beta[cut:], decay[cut:], s1, 40 + cut)
    assert same_bits(torch.cat((o1, o2)), o) and same_bits(s2, s), "the bits depend on the 64-aligned piece"
    pool = torch.stack([s0 * (0.5 + i) for i in range(4)])
    before = pool.clone()
    sizes, pos0s, slots = [1, 299, 700], [7, 40, 0], [3, 0, 2]
    o_wave = gdn_triton.gdn_prefill_pieces(q, k, v, beta, decay, pool, RecurrentPieces.of([0, 1, 300], sizes, pos0s,
                                                                                          slots, q.device))
    for first, t, pos0, slot in zip([0, 1, 300], sizes, pos0s, slots):
        rows = slice(first, first + t)
        o_solo, s_solo = gdn_triton.gdn_prefill(q[rows], k[rows], v[rows], beta[rows], decay[rows], before[slot], pos0)
        assert same_bits(o_wave[rows], o_solo) and same_bits(pool[slot], s_solo), f"the wave's piece {slot}"
    scan_o, states = gdn_triton.delta_rule_scan(q[None, :4], k[None, :4], v[None, :4], beta[None, :4],
                                                decay[None, :4], s0[None])
    state = s0
    for j in range(4):
        oj, state = gdn_triton.delta_rule_step(q[j], k[j], v[j], beta[j], decay[j], state)
        assert same_bits(oj, scan_o[0, j]) and same_bits(state, states[0, j]), f"the verify's token {j}"


@torch.inference_mode()
def test_batch_sampler_at_full_vocabulary():
    ops = table()
    assert ops.sample_kernel, "the kernel table did not pick the one-launch sampler on CUDA"
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(128, 248320, device="cuda", generator=g) * 4
    filters = [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05)]
    specs = [DevSamp(0.0 if i % 8 == 0 else 0.6 + (i % 5) / 5, 1000 + i, 7 * i, **filters[i % 4]) for i in range(128)]
    want = [int(device_sample(row, s)) for row, s in zip(logits, specs)]
    got = ops.sample_batch(logits, specs).tolist()
    wrong = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not wrong, f"{len(wrong)}/128 rows differ from device_sample, e.g. rows {wrong[:8]}"
    split = KernelTable.build("cuda", Settings(sample_split=True))  # MEMRA_SAMPLE_SPLIT: parts, then the combine
    pruned = KernelTable.build("cuda", Settings(sample_split=True, sample_prune=True))  # MEMRA_SAMPLE_PRUNE
    for rows in (slice(0, 1), slice(1, 4), slice(None)):  # 1 and 3 rows: many parts a row; 128: eight
        assert split.sample_batch(logits[rows], specs[rows]).tolist() == want[rows], f"split rows {rows}"
        assert pruned.sample_batch(logits[rows], specs[rows]).tolist() == want[rows], f"pruned rows {rows}"


@torch.inference_mode()
def test_rope_tile_keeps_the_bits_at_model_shapes():
    """MEMRA_ROPE_TILE: the fused RoPE and K/V write with ROPE_TILE_HEADS heads a program, against one head
    a program, bit for bit: a 770-token wave of the Llama-3-8B shape (32 / 8 heads of 128) and of the
    Qwen3.5 attention's (16 / 4 heads of 256, a quarter rotated)."""
    from memra.kernels.triton import rope

    g = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d, r in ((32, 8, 128, 128), (16, 4, 256, 64)):
        t = 770
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(torch.bfloat16)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        cos, sin = (torch.randn(t, r, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        rows = torch.randperm(2 * t, device="cuda", generator=g)[:t]
        outs = []
        for heads in (1, rope.ROPE_TILE_HEADS):
            # every row of 2t must be in the pool: cdiv(2t, 16) blocks (2t // 16 left 4 rows past its end,
            # written out of bounds by whichever launch, so the two launches' neighbours differed)
            k_pool, v_pool = (torch.zeros(-(-2 * t // 16), 16, hkv, d, device="cuda", dtype=torch.bfloat16)
                              for _ in range(2))
            outs.append((rope.rope_write_kv(q, k, v, cos, sin, k_pool, v_pool, rows, heads), k_pool, v_pool,
                         rope.apply_rope(q, cos, sin, heads)))
        assert all(same_bits(a, b) for a, b in zip(*outs)), f"heads of {d}: the tiled launch moved bits"


def test_short_rows_keep_the_bits_of_a_split_attention_launch():
    """MEMRA_ATTN_SHORT_ROWS: 256 rows of 170 positions beside 2 of 600 in one launch told a 1,024-position table
    (two splits), the Llama-3-8B and Qwen3.5 attention shapes: every row has the bits of the launch without the
    door, and the short rows the bits of their own unsplit launch."""
    from memra.kernels.triton import attention

    g = torch.Generator(device="cuda").manual_seed(1)
    for hq, hkv, d in ((32, 8, 128), (16, 4, 256)):
        lens = torch.tensor([170] * 256 + [600] * 2, device="cuda")
        blocks = int(lens.sum()) // 16 + 1
        k_pool, v_pool = (torch.randn(blocks, 16, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        rows = torch.randperm(blocks * 16, device="cuda", generator=g)[: int(lens.sum())]
        starts = torch.cumsum(lens, 0) - lens
        q = torch.randn(len(lens), hq, d, device="cuda", generator=g).to(torch.bfloat16)
        plain = attention.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, d ** -0.5, max_len=1024)
        short = attention.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, d ** -0.5, max_len=1024,
                                               short_rows=True)
        alone = attention.paged_attention_rows(q[:256], k_pool, v_pool, rows, starts[:256], lens[:256], d ** -0.5,
                                               max_len=170)
        assert same_bits(short, plain) and same_bits(short[:256], alone), f"heads of {d}: short rows moved bits"


def test_walked_splits_keep_the_bits_of_a_split_attention_launch():
    """MEMRA_ATTN_SPLIT_WALK (with MEMRA_ATTN_SKIP_EMPTY, its terms): 382 rows of 170 positions beside 2 of 1,500
    told a 2,048-position table (four splits), the Llama-3-8B and Qwen3.5 attention shapes: a program walking its
    row's positions gives every row the bits of a program a split, and of the launch without the skip; so does
    one whose short rows end their walk in their output (MEMRA_ATTN_SHORT_ROWS as well), and one that merges its
    splits itself (MEMRA_ATTN_WALK_COMBINE: the partials read back after a barrier, no combine launched)."""
    from memra.kernels.triton import attention

    g = torch.Generator(device="cuda").manual_seed(3)
    for hq, hkv, d in ((32, 8, 128), (16, 4, 256)):
        lens = torch.tensor([170] * 382 + [1500] * 2, device="cuda")
        assert len(lens) * hkv >= attention.WALK_PROGRAMS  # the launch walks
        blocks = int(lens.sum()) // 16 + 1
        k_pool, v_pool = (torch.randn(blocks, 16, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        rows = torch.randperm(blocks * 16, device="cuda", generator=g)[: int(lens.sum())]
        starts = torch.cumsum(lens, 0) - lens
        q = torch.randn(len(lens), hq, d, device="cuda", generator=g).to(torch.bfloat16)
        plain, skipped, walked, short, merged = (
            attention.paged_attention_rows(q, k_pool, v_pool, rows, starts, lens, d ** -0.5, max_len=2048, **door)
            for door in ({}, dict(skip_empty=True), dict(skip_empty=True, split_walk=True),
                         dict(skip_empty=True, split_walk=True, short_rows=True),
                         dict(skip_empty=True, split_walk=True, walk_combine=True)))
        assert same_bits(walked, skipped) and same_bits(walked, plain), f"heads of {d}: the walk moved bits"
        assert same_bits(short, plain), f"heads of {d}: the walk's short rows moved bits"
        assert same_bits(merged, plain), f"heads of {d}: the walk's own combine moved bits"


def test_the_experts_activation_in_their_gate_up_launch_keeps_the_bits():
    """MEMRA_MOE_FUSED_ACT at the Qwen3.5-35B-A3B expert shapes (256 experts of 2 x 512 by 2,048, top 8): the
    activation in the grouped gate/up launch's epilogue against the launch then silu_mul, bit for bit, for a
    decode step's rows (a tile per pair) and a prefill's (tiles per expert)."""
    from memra.kernels.triton import moe

    g = torch.Generator(device="cuda").manual_seed(2)
    w_gate_up = (torch.randn(256, 1024, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_down = (torch.randn(256, 2048, 512, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    for rows in (1, 16, 512):
        x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
        weights, ids = moe.moe_route(torch.randn(rows, 256, device="cuda", generator=g), 8, True, torch.bfloat16)
        want = moe.moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True)
        got = moe.moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True, fused_act=True)
        assert same_bits(got, want), f"{rows} rows: the fused activation moved bits"


def test_the_shared_experts_gate_in_the_combine_keeps_torchs_bits():
    """MEMRA_MOE_FUSED_GATE at the Qwen3.5-35B-A3B shapes (256 experts of 2 x 512 by 2,048, top 8): the shared
    expert scaled by sigmoid(its gate logit) in the combine, against torch's `torch.sigmoid(g) * shared`
    handed to the combine, bit for bit in bf16 and fp32, for a decode step's rows and a prefill's."""
    from memra.kernels.triton import moe

    g = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        w_gate_up = (torch.randn(256, 1024, 2048, device="cuda", generator=g) * 0.02).to(dtype)
        w_down = (torch.randn(256, 2048, 512, device="cuda", generator=g) * 0.02).to(dtype)
        for rows in (1, 16, 512):
            x, shared, residual = (torch.randn(rows, 2048, device="cuda", generator=g).to(dtype) for _ in range(3))
            gate = (torch.randn(rows, 1, device="cuda", generator=g) * 3).to(dtype)
            weights, ids = moe.moe_route(torch.randn(rows, 256, device="cuda", generator=g), 8, True, dtype)
            want = moe.moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True,
                                   shared=torch.sigmoid(gate) * shared, residual=residual)
            got = moe.moe_experts(x, weights, ids, w_gate_up, w_down, ascending=True, shared=shared,
                                  residual=residual, shared_gate=gate)
            assert same_bits(got, want), f"{dtype}, {rows} rows: the gate in the combine moved bits"
        del w_gate_up, w_down


def test_a_moe_models_logits_keep_their_bits_with_the_gate_in_the_combine(load_model, monkeypatch):
    """MEMRA_MOE_FUSED_GATE through a model (the qwen3_5_moe fixture, bf16, a shared expert with its gate): a
    4-row prime and two decode steps give the same logits with the door open and shut. Liveness: the grouped
    experts were handed the gate logits only with the door open (a spy around triton.moe.moe_experts)."""
    from conftest import hf_dir
    from memra.kernels.triton import moe

    gated = []
    real = moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **k: gated.append(k.get("shared_gate") is not None)
                        or real(*a, **k))
    base = load_model(hf_dir("qwen3_5_moe"), dtype="bfloat16")
    got = []
    for door in ("0", "1"):
        gated.clear()
        model = base.with_doors(MEMRA_MOE_FUSED_GATE=door)
        caches = [model.new_cache(64) for _ in range(4)]
        logits = list(model.prime_batch([[3 + i, 9, 27, 5, 11][: 2 + i] for i in range(4)], caches))
        for step in range(2):
            logits.append(model.decode_step_batch([20 + step + i for i in range(4)], caches))
        got.append(torch.cat([x.float().reshape(-1) for x in logits]))
        for c in caches:
            c.free()
        assert gated and all(gated) == (door == "1") and any(gated) == (door == "1"), f"door {door}: {gated}"
    assert same_bits(got[0], got[1]), "the shared expert's gate in the combine moved a model's logits"

