"""Exactness promises on CPU: E1 (batch invariance), E3 (seeded device sampling), E5 (chunked prime)."""

import random

import pytest
import torch

from conftest import HF_ARCHS, hf_dir
from memra import counters
from memra.errors import MemraError
from memra.kernels.exact import self_test
from memra.sampling import DevSamp


def prompts(seed: int, n: int, vocab: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def isolated_stream(model, prompt, feed, dtype_model=None):
    """B=1 reference: decode_step_batch with one row, fed the given tokens."""
    c = model.new_cache(128)
    model.prime(prompt, c)
    return [model.decode_step_batch([t], [c])[0] for t in feed]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", HF_ARCHS)
def test_batched_rows_equal_isolated_runs(arch, dtype, load_model):
    """E1: uneven prompts, rows in shuffled order each step; every row's logits equal its B=1 run's bits."""
    model = load_model(hf_dir(arch), dtype=dtype)
    rng = random.Random(arch)
    ps = prompts(hash(arch) % 1000, 5, model.cfg.vocab_size)
    feeds = [[rng.randrange(3, model.cfg.vocab_size) for _ in range(4)] for _ in ps]
    caches = [model.new_cache(128) for _ in ps]
    for p, c in zip(ps, caches):
        model.prime(p, c)
    batched = [[] for _ in ps]
    for step in range(4):
        order = list(range(len(ps)))
        rng.shuffle(order)
        rows = model.decode_step_batch([feeds[i][step] for i in order], [caches[i] for i in order])
        for r, i in enumerate(order):
            batched[i].append(rows[r])
    for i, p in enumerate(ps):
        for a, b in zip(batched[i], isolated_stream(model, p, feeds[i])):
            assert torch.equal(a, b)


def test_every_batch_size_1_to_64_and_every_row_position(load_model):
    """Seeded random compositions: for every B in 1..64, B of 64 sequences (uneven prompts) in random
    order; every row — so every row position — must equal that sequence's isolated B=1 logits."""
    model = load_model(hf_dir("qwen3_5_moe"))
    pool = prompts(7, 64, 1024, 1, 24)
    feed = [(31 * i + 5) % 1024 for i in range(64)]
    ref = [isolated_stream(model, p, [t])[0] for p, t in zip(pool, feed)]
    rng = random.Random(3)
    for b in range(1, 65):
        chosen = rng.sample(range(64), b)
        caches = [model.new_cache(32) for _ in chosen]
        for i, c in zip(chosen, caches):
            model.prime(pool[i], c)
        rows = model.decode_step_batch([feed[i] for i in chosen], caches)
        for r, i in enumerate(chosen):
            assert torch.equal(rows[r], ref[i]), f"B={b} row {r} (sequence {i})"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma4", "step3p5", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_prime_at_64_aligned_cuts_leaves_identical_caches(arch, dtype, load_model):
    """E5: a 150-token prompt primed in one shot, in 64-token chunks, and in 128-token chunks: the same
    logits, KV and recurrent state, bit for bit."""
    model = load_model(hf_dir(arch), dtype=dtype)
    ids = prompts(5, 1, model.cfg.vocab_size, 150, 151)[0]
    results = []
    for chunk in (None, 64, 128):
        c = model.new_cache(160)
        logits = model.prime(ids, c, all_logits=True, chunk_size=chunk)
        results.append((logits, c))
    ref, rc = results[0]
    for logits, c in results[1:]:
        assert torch.equal(logits, ref)
        for layer in (i for i in rc.kv.layers if i < model.cfg.n_layers):  # not an MTP block's: prime does
            # not write it (the drafter does, from position 0), so a reused block still holds old bytes there
            assert torch.equal(kv_prefix(c, layer, len(ids)), kv_prefix(rc, layer, len(ids)))
        for layer in (rc.rec.layers if rc.rec else ()):
            assert torch.equal(c.ssm_state(layer), rc.ssm_state(layer))
            assert torch.equal(c.conv_state(layer), rc.conv_state(layer))
    if model.cfg.gdn_layers:  # negative control: a cut that is not 64-aligned changes the GDN chunks
        c = model.new_cache(160)
        model.prime(ids, c, chunk_size=7)
        assert any(not torch.equal(c.ssm_state(i), rc.ssm_state(i)) for i in rc.rec.layers)


def kv_prefix(cache, layer, n):
    """K and V of positions 0..n-1, in position order, gathered from the paged pool."""
    rows = cache.read_rows(n, cache.kv.k[layer].device)
    k, v = cache.kv.k[layer], cache.kv.v[layer]
    return torch.cat((k.view(-1, *k.shape[2:])[rows], v.view(-1, *v.shape[2:])[rows]))


def test_device_sampling_rows_do_not_depend_on_batchmates(load_model):
    """E3: greedy rows pick the host argmax of their returned row; sampled rows pick the same token at
    B=N as alone; lean mode parks exactly the row it would have returned."""
    model = load_model(hf_dir("qwen3_5"))
    ps = prompts(11, 4, 1024)
    specs = [DevSamp(0.0, 0, 0), DevSamp(0.9, 17, 3, top_p=0.9), None, DevSamp(1.3, 5, 9, top_k=20, min_p=0.02)]
    feed = [5, 6, 7, 8]

    def run(lean, rows_idx):
        caches = [model.new_cache(64) for _ in rows_idx]
        for i, c in zip(rows_idx, caches):
            model.prime(ps[i], c)
        rows, toks = model.decode_step_batch_sampled([feed[i] for i in rows_idx], caches, [specs[i] for i in rows_idx], lean=lean)
        return rows, toks, caches

    before = counters.snapshot()
    rows, toks, _ = run(False, [0, 1, 2, 3])
    assert toks[0] == int(rows[0].argmax()) and toks[2] is None and rows[2] is not None
    for i in (0, 1, 3):  # alone, each row's token is the same
        alone_rows, alone_toks, _ = run(False, [i])
        assert alone_toks[0] == toks[i] and torch.equal(alone_rows[0], rows[i])
    lean_rows, lean_toks, lean_caches = run(True, [0, 1, 2, 3])
    assert lean_toks == toks
    assert lean_rows[0] is None and lean_rows[1] is None and lean_rows[3] is None and torch.equal(lean_rows[2], rows[2])
    for i in (0, 1, 3):
        assert torch.equal(lean_caches[i].last_logits_dev.cpu(), rows[i])
        assert lean_caches[i].last_logits_dev.device.type == model.device.type
    d = counters.delta(before)
    assert d["device_sampled_rows"] == 3 + 3 + 3 and d["lean_parked_rows"] == 3 and d["decode_batch_rows"] == 4 + 3 + 4


def test_batch_refusals_leave_caches_untouched(load_model):
    model = load_model(hf_dir("qwen3"))
    a, b = model.new_cache(8), model.new_cache(4)
    model.prime([1, 2, 3], a)
    model.prime([1, 2, 3, 4], b)  # full
    with pytest.raises(MemraError, match="row 1: its cache is full"):
        model.decode_step_batch([5, 6], [a, b])
    with pytest.raises(MemraError, match="same cache twice"):
        model.decode_step_batch([5, 6], [a, a])
    with pytest.raises(MemraError, match="outside the vocabulary"):
        model.decode_step_batch([5, 99999], [a, model.new_cache(8)])
    assert a.pos == 3 and b.pos == 4


def test_self_test_reports_what_cpu_breaks():
    """The exact path relies on determinism only; the self-test also records which batched shortcuts
    this CPU would break (measured: elementwise softplus/sigmoid bits depend on a value's offset)."""
    for dtype in (torch.float32, torch.bfloat16):
        failed = self_test(dtype, "cpu")
        assert not [f for f in failed if "repeat" in f], failed  # determinism must hold
        assert not [f for f in failed if f.startswith("linear[64x")], failed  # 64-row tiles are row-invariant here


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_fast_stacked_path_is_right_but_not_exact_and_the_gate_sees_it(arch, load_model):
    """MEMRA_EXACT=0 runs the batch as one stacked forward: the same math (within 1e-4), different bits
    (so it is never the default) — and the gate must FAIL on it, which proves gate2 has teeth."""
    from conftest import rel_err
    from memra.gate import run_battery

    model = load_model(hf_dir(arch))
    # Eight rows: with three, this CPU's BLAS happened to give the fast rows the exact bits for one
    # fixture (a coincidence of these prompts, not a property); wider batches differ everywhere.
    ps = prompts(21, 8, model.cfg.vocab_size)

    def step():
        caches = [model.new_cache(64) for _ in ps]
        for p, c in zip(ps, caches):
            model.prime(p, c)
        return model.decode_step_batch(list(range(4, 12)), caches)

    exact = step()
    model = model.with_doors(MEMRA_EXACT="0")  # the same weights, the fast path
    fast = step()
    assert rel_err(fast, exact) <= 1e-4  # fp32 sums reordered in every layer: a few ulps of the max logit
    assert not torch.equal(fast, exact)
    lines = []
    assert not run_battery(model, steps=3, batch=3, plen=10, out=lines.append)
    assert any(l.startswith("gate2 (") and l.endswith("FAIL") for l in lines)


def test_bad_door_values_are_refused_when_the_settings_are_read(load_model, monkeypatch):
    """The doors are read once, at load: a bad value is refused there, before anything runs."""
    import memra

    model = load_model(hf_dir("llama"))  # loaded before the bad values are set: its view is what with_doors checks
    monkeypatch.setenv("MEMRA_EXACT", "maybe")
    with pytest.raises(MemraError, match="MEMRA_EXACT='maybe'"):
        memra.load(hf_dir("llama"), tokenizer=False)
    monkeypatch.setenv("MEMRA_EXACT", "1")
    monkeypatch.setenv("MEMRA_DECODE_PLAN", "sideways")
    with pytest.raises(MemraError, match="MEMRA_DECODE_PLAN='sideways'"):
        memra.load(hf_dir("llama"), tokenizer=False)
    with pytest.raises(MemraError, match="MEMRA_TRITON='2'"):
        model.with_doors(MEMRA_TRITON="2")


def test_exact_mode_fails_closed_on_a_nondeterministic_platform(load_model, monkeypatch):
    from memra.kernels import exact

    model = load_model(hf_dir("qwen3"))
    monkeypatch.setattr(exact, "_VERIFIED", {(model.device.type, str(model.dtype), "bucket"): ["linear[1x64] repeat"]})
    c = model.new_cache(16)
    with pytest.raises(exact.ExactnessError, match="exact mode refused.*MEMRA_EXACT=0"):
        model.prime([1, 2, 3], c)
    with pytest.raises(exact.ExactnessError):
        model.decode_step_batch([1], [c])
    assert c.pos == 0 and not c.blocks
    fast = model.with_doors(MEMRA_EXACT="0")  # the door lets a user run anyway, knowingly
    c = fast.new_cache(16)
    fast.prime([1, 2, 3], c)
    assert c.pos == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_moe", "qwen3_next"])
def test_bucket_plan_is_exact_where_verified_and_refused_elsewhere(arch, dtype, load_model):
    """MEMRA_DECODE_PLAN=bucket stacks rows in fixed 64-row buckets. Where the on-model check passes,
    E1 holds through it (and gate2 sees the same bits); where it fails, or for an MoE without the
    M-invariant kernels (its experts' row counts follow the neighbours' routing), decoding is refused
    before any cache moves."""
    from memra.decode_plan import verify_bucket
    from memra.kernels.exact import ExactnessError

    model = load_model(hf_dir(arch), dtype=dtype).with_doors(MEMRA_DECODE_PLAN="bucket")
    c = model.new_cache(64)
    model.prime([5, 6, 7], c)
    if (model.cfg.moe is not None and not model.ops.invariant) or not verify_bucket(model):
        with pytest.raises(ExactnessError, match="MEMRA_DECODE_PLAN=row"):
            model.decode_step_batch([1], [c])
        assert c.pos == 3
        return
    ps = prompts(hash(arch) % 97, 70, model.cfg.vocab_size, 2, 12)  # 70 rows: two buckets
    caches = [model.new_cache(32) for _ in ps]
    for p, cc in zip(ps, caches):
        model.prime(p, cc)
    rows = model.decode_step_batch([9] * len(ps), caches)
    for i in (0, 33, 63, 64, 69):
        assert torch.equal(rows[i], isolated_stream(model, ps[i], [9])[0]), f"row {i}"
    lines = []
    assert run_battery_quick(model, lines), "\n".join(lines)


def run_battery_quick(model, lines):
    from memra.gate import run_battery

    return run_battery(model, steps=3, batch=5, plen=8, out=lines.append)


def test_decode_plan_door(load_model):
    from memra.decode_plan import decode_plan
    from memra.kernels.exact import ExactnessError

    model = load_model(hf_dir("llama"))
    live = model.ops.invariant  # CUDA + Triton: the batch-invariant kernels run
    # on CPU an fp32 model stacks its rows on the row-invariant linear (MEMRA_CPU_FLIN); MKL's keeps the row plan
    assert decode_plan(model) == ("stacked" if live or model.ops.flin else "row")
    if not live:
        model = model.with_doors(MEMRA_CPU_FLIN="0")
        assert decode_plan(model) == "row"
        # an explicit stacked plan where its kernels do not run: refused before the cache moves
        stacked = model.with_doors(MEMRA_DECODE_PLAN="stacked")
        c = stacked.new_cache(8)
        stacked.prime([1, 2], c)
        with pytest.raises(ExactnessError, match="not live here.*MEMRA_DECODE_PLAN=row"):
            stacked.decode_step_batch([1], [c])
        assert c.pos == 2


def test_whole_chunk_prefill_only_where_nothing_can_see_the_forward_size(load_model, monkeypatch):
    """exact_piece: the 64-token pieces unless the invariant kernels run and the self-test found no
    failure a token's bits could take from its forward's size. (The kernels' presence and the platform
    report are substituted, so the decision is what is under test on CPU and GPU alike.)"""
    from memra import step

    import dataclasses

    base = load_model(hf_dir("qwen3_5"))
    monkeypatch.setattr(step, "platform_report", lambda dtype, device, linear_family="bucket": [])
    model = base.with_settings(base.settings)  # a view whose kernel table this test may swap
    model.ops = dataclasses.replace(base.ops, invariant=False)
    assert step.exact_piece(model) == step.EXACT_PIECE  # no invariant kernels (torch's ops)
    model.ops = dataclasses.replace(base.ops, invariant=True, gdn_kernel=True)
    for failures, piece in (([], step.INVARIANT_PIECE),
                            (["linear[64x256] row 7"], step.INVARIANT_PIECE),  # torch's matmul: not on this path
                            (["triton prefill attention[300] queries 0:64 as a piece"], step.EXACT_PIECE),
                            (["softplus at offset 3"], step.EXACT_PIECE),
                            (["row softmax [64x256] row 5 vs alone"], step.EXACT_PIECE)):
        monkeypatch.setattr(step, "platform_report", lambda dtype, device, linear_family="bucket", f=failures: f)
        assert step.exact_piece(model) == piece, failures
    model.ops = dataclasses.replace(base.ops, invariant=True, gdn_kernel=False)  # a GDN probe it does not run
    monkeypatch.setattr(step, "platform_report", lambda dtype, device, linear_family="bucket": ["triton gdn prefill[300] in 64-aligned pieces"])
    assert step.exact_piece(model) == step.INVARIANT_PIECE
    monkeypatch.setattr(step, "platform_report", lambda dtype, device, linear_family="bucket": [])
    model.ops = dataclasses.replace(base.ops, invariant=True)
    assert step.forward_cuts(model, 5000, 100, exact=True) == [(0, 3996), (3996, 5000)]  # cut at 4096
    assert step.forward_cuts(model, 5000, 100, exact=False) == [(0, 5000)]
