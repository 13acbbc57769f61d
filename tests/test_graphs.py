"""CUDA-graphed decode (memra.graphs) is the eager stacked decode, bit for bit.

On CPU (CI) there are no graphs, but the graph's static step is ordinary code: run eagerly it must
give the eager stacked step's bits and leave the same KV and recurrent state. On the GPU
(MEMRA_TEST_DEVICE=cuda) the replayed graphs are held to the eager path with graphs off: B=1 on a
private cache, and a shared-pool batch whose bucket has inert padding rows.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, hf_dir
from memra import counters, graphs
from memra.cache import Cache, RecurrentPool, kv_pool
from memra.graphs import BUCKETS, SPLIT_BLOCKS, StaticDecode, bucket_for, long_tables, step_blocks, table_blocks
from memra.runner.bodies import decode_stacked as _decode_stacked

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [43, 38, 32]]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need the GPU (run with MEMRA_TEST_DEVICE=cuda)")


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _shared_caches(model, n: int, max_ctx: int = 64, spare: int = 0):
    """n sequences in one KV pool and one recurrent pool (as the server keeps them), primed."""
    cfg = model.cfg
    kv = kv_pool(cfg, n * (-(-max_ctx // 16)) + spare, model.dtype, model.device)
    rec = RecurrentPool(cfg, n + spare, model.dtype, model.device) if cfg.gdn_layers else None
    caches = [Cache(kv=kv, rec=rec, max_ctx=max_ctx, slot=rec.allocate() if rec else None) for _ in range(n)]
    first = [int(model.prime(p, c).argmax()) for p, c in zip(PROMPTS * n, caches)]
    for c in caches:
        c.reserve(max_ctx - c.pos)  # every block now: the static step reads block tables, not a growing list
    return caches, first


def _state(model, caches) -> list[torch.Tensor]:
    """Every byte the sequences own: their KV blocks and their recurrent slots."""
    kv, rec = caches[0].kv, caches[0].rec
    blocks = torch.tensor([b for c in caches for b in c.blocks], device=model.device)
    trunk = [i for i in kv.layers if i < model.cfg.n_layers]  # an MTP block's KV is the drafter's, unwritten here
    out = [kv.k[i][blocks] for i in trunk] + [kv.v[i][blocks] for i in trunk]
    if rec is not None:
        slots = torch.tensor([c.slot for c in caches], device=model.device)
        out += [rec.conv[i][slots] for i in rec.layers] + [rec.ssm[i][slots] for i in rec.layers]
    return out


def test_buckets_and_table_widths():
    assert [bucket_for(b) for b in (1, 2, 3, 5, 9, 33, 129)] == [1, 2, 4, 8, 16, 48, 192]
    assert bucket_for(BUCKETS[-1] + 1) is None
    assert table_blocks(1) == 16 and table_blocks(256) == 16 and table_blocks(257) == 32 and table_blocks(4096) == 256


def test_a_captured_steps_logits_are_kept_in_the_heads_dtype_and_widened_once_on_read_out():
    """The buffer holds the head's bf16; the read-out is a new fp32 tensor with the widened bits (exact), the
    rows of several ranges in order, and no view of the buffer the next replay overwrites. A head of another
    dtype than its buffer is refused: the copy would round its logits."""
    buffer = torch.randn(6, 50).to(torch.bfloat16)
    got = graphs.widened(buffer[:2], buffer[4:5])
    assert got.dtype == torch.float32 and _bits(got, torch.cat((buffer[:2], buffer[4:5])).float())
    buffer.zero_()
    assert got.abs().sum() > 0  # its own memory
    fp32 = torch.randn(3, 50)
    assert graphs.widened(fp32).data_ptr() != fp32.data_ptr()  # an fp32 head's buffer is copied out all the same
    with pytest.raises(AssertionError, match="float32 logits for a torch.bfloat16 buffer"):
        graphs.held(buffer, fp32)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_static_step_run_eagerly_is_the_stacked_step(load_model, arch):
    """The graph's body (block tables, slots by index, flat prefix rows) against _decode_stacked,
    from identical states, several steps: logits and every KV / recurrent byte equal."""
    model = load_model(hf_dir(arch)).with_doors(MEMRA_CUDA_GRAPHS="0")  # the eager step, on any device
    eager, toks = _shared_caches(model, 3)
    static_caches, toks_s = _shared_caches(model, 3)
    assert toks == toks_s
    static = StaticDecode(model, static_caches[0].kv, static_caches[0].rec, 3, table_blocks(64))
    for _ in range(4):
        ids = torch.tensor(toks, device=model.device)
        want = _decode_stacked(model, ids, eager)
        static.fill(ids, static_caches, None)
        got = graphs.widened(static.body()[:3])
        for c in static_caches:
            c.pos += 1
        assert _bits(got, want)
        toks = want.argmax(-1).tolist()
    assert all(_bits(a, b) for a, b in zip(_state(model, eager), _state(model, static_caches)))


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_graphed_b1_decode_equals_eager(load_model, arch):
    base = load_model(hf_dir(arch))
    streams = {}
    for flag in ("0", "1"):
        model = base.with_doors(MEMRA_CUDA_GRAPHS=flag)
        before = counters.snapshot()
        cache = model.new_cache(64)
        tok = int(model.prime(PROMPTS[0], cache).argmax())
        rows = []
        for _ in range(12):
            row = model.decode_step(tok, cache)
            rows.append(row)
            tok = int(row.argmax())
        streams[flag] = torch.stack(rows)
        d = counters.delta(before)
        assert (d["graph_replays"] > 0) == (flag == "1")  # liveness: the graph path really ran
    assert _bits(streams["0"], streams["1"])


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_graphed_batch_with_padding_rows_equals_eager(load_model, arch):
    """3 live rows in a bucket of 4 (one inert row on the pools' scratch block and slot)."""
    base = load_model(hf_dir(arch))
    out = {}
    for flag in ("0", "1"):
        model = base.with_doors(MEMRA_CUDA_GRAPHS=flag)
        caches, toks = _shared_caches(model, 3, spare=1)
        rows = []
        for _ in range(10):
            logits = model.decode_step_batch(toks, caches)
            rows.append(logits)
            toks = logits.argmax(-1).tolist()
        out[flag] = (torch.stack(rows), _state(model, caches))
    assert _bits(out["0"][0], out["1"][0])
    assert all(_bits(a, b) for a, b in zip(out["0"][1], out["1"][1]))  # the padding row touched only scratch


def test_rows_within_one_split_take_a_narrower_table_with_the_same_bits(load_model):
    """memra.graphs.step_blocks: while every row fits in one attention split the step's table is that
    split's width, whatever the rows' max_ctx (their block lists are longer: only the first blocks
    go in). Run eagerly, the narrow static step and the wide one give the same bits and states."""
    assert long_tables(1024) and not long_tables(512) and SPLIT_BLOCKS == 32
    model = load_model(hf_dir("llama")).with_doors(MEMRA_CUDA_GRAPHS="0")
    wide, toks = _shared_caches(model, 3, max_ctx=1024)
    narrow, _ = _shared_caches(model, 3, max_ctx=1024)
    assert step_blocks(wide, [c.pos + 1 for c in wide]) == SPLIT_BLOCKS < len(wide[0].blocks)
    assert step_blocks(wide, [600, 1, 1]) == table_blocks(1024)  # a row past one split: the whole width
    statics = [StaticDecode(model, cs[0].kv, cs[0].rec, 3, nb) for cs, nb in ((wide, table_blocks(1024)),
                                                                             (narrow, SPLIT_BLOCKS))]
    for _ in range(3):
        ids = torch.tensor(toks, device=model.device)
        got = []
        for static, caches in zip(statics, (wide, narrow)):
            static.fill(ids, caches, None)
            got.append(graphs.widened(static.body()[:3]))
            for c in caches:
                c.pos += 1
        assert _bits(*got)
        toks = got[0].argmax(-1).tolist()
    assert all(_bits(a, b) for a, b in zip(_state(model, wide), _state(model, narrow)))


@cuda_only
def test_graphs_of_both_table_widths_equal_eager(load_model):
    """A batch decodes in the narrow table's graph, then one row is primed past one attention split and
    the batch goes on in the full width's (a split launch and its combine): bit for bit the eager step."""
    base = load_model(hf_dir("llama"))
    out = {}
    for flag in ("0", "1"):
        model = base.with_doors(MEMRA_CUDA_GRAPHS=flag)
        caches, toks = _shared_caches(model, 3, max_ctx=1024, spare=1)
        rows = []
        for i in range(6):
            if i == 3:
                model.prime([5 + j % 50 for j in range(520)], caches[0])
            logits = model.decode_step_batch(toks, caches)
            rows.append(logits)
            toks = logits.argmax(-1).tolist()
        out[flag] = (torch.stack(rows), _state(model, caches))
        if flag == "1":
            # both widths captured (the load's plan check may have captured a third, its own caches')
            assert {SPLIT_BLOCKS, table_blocks(1024)} <= {k.table_blocks for k in model.decode_graphs}
            # one memory pool for every decode capture, one logits buffer per bucket (memra.graphs.StaticDecode)
            statics = [s for k, s in model.decode_graphs.items()
                       if k.bucket == graphs.bucket_for(3) and k.kv == id(caches[0].kv)]
            assert len(statics) >= 2 and len({s.logits.data_ptr() for s in statics}) == 1
            assert model.decode_graph_pool is not None
    assert _bits(out["0"][0], out["1"][0])
    assert all(_bits(a, b) for a, b in zip(out["0"][1], out["1"][1]))


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within fp32 rounding of a differently shaped product: max |a - b| <= 1e-5 max |b| (zeros stay zeros)."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


def _rows_then_fewer(model, caches, toks, widths):
    """Decode steps over the first `w` caches for each w in widths -> the logits of every step."""
    out = []
    for w in widths:
        logits = model.decode_step_batch(toks[:w], caches[:w])
        out.append(logits)
        toks = logits.argmax(-1).tolist() + toks[w:]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_bucket_first_run_by_a_full_batch_pads_a_smaller_one(load_model, arch, monkeypatch):
    """A bucket's static step first run by a batch that fills it (no padding) and then by a smaller
    batch, which pads with the pools' scratch block and slot: the server at full load (issue 18, point 9:
    the padding rows took the graph's stored scratch, which a full batch had left as None). On CPU the
    static step runs eagerly (graphs.graphable forced). CPU BLAS rounds a [4, E] product differently from
    a [3, E] one, so here only the first (unpadded) step is held to the stacked step's bits and the
    rest within fp32 rounding (max |a - b| <= 1e-5 max |b|); the CUDA test below holds every step to the bit."""
    model = load_model(hf_dir(arch)).with_doors(MEMRA_CUDA_GRAPHS="0")
    widths = [4, 3, 4, 1, 2]  # bucket 4 full, then padded; then buckets 1 and 2
    eager, toks = _shared_caches(model, 4, spare=1)
    want, t = [], list(toks)
    for w in widths:
        logits = _decode_stacked(model, torch.tensor(t[:w], device=model.device), eager[:w])
        want.append(logits)
        t = logits.argmax(-1).tolist() + t[w:]
    model = model.with_doors(MEMRA_CUDA_GRAPHS="1")
    monkeypatch.setattr(graphs, "graphable", lambda m, c: True)
    static_caches, toks_s = _shared_caches(model, 4, spare=1)
    assert toks_s == toks
    got, t = [], list(toks)
    for w in widths:
        logits = graphs.graphed_decode(model, torch.tensor(t[:w], device=model.device), static_caches[:w])
        got.append(logits)
        t = logits.argmax(-1).tolist() + t[w:]
    assert _bits(got[0], want[0])
    assert all(_near(a, b) for a, b in zip(got, want))
    assert all(_near(a, b) for a, b in zip(_state(model, eager), _state(model, static_caches)))


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_graphed_full_bucket_then_smaller_batch_equals_eager(load_model, arch):
    """The same on the GPU with real graphs: bucket 4 captured by 4 rows, replayed for 3."""
    base = load_model(hf_dir(arch))
    out = {}
    for flag in ("0", "1"):
        model = base.with_doors(MEMRA_CUDA_GRAPHS=flag)
        caches, toks = _shared_caches(model, 4, spare=1)
        before = counters.snapshot()
        out[flag] = (torch.stack(_rows_then_fewer(model, caches, toks, [4, 3, 3, 4])[1:3]), _state(model, caches))
        assert (counters.delta(before)["graph_replays"] > 0) == (flag == "1")
    assert _bits(out["0"][0], out["1"][0])
    assert all(_bits(a, b) for a, b in zip(out["0"][1], out["1"][1]))


def test_an_enlarged_pool_gets_a_graph_of_its_own(load_model):
    """A captured step holds the pools' tensors by address: when the recurrent pool (or the KV pool) is
    enlarged, the key changes, so the old graph is never replayed over the new tensors."""
    model = load_model(hf_dir("qwen3_5"))
    kv = kv_pool(model.cfg, 8, model.dtype, model.device)
    rec = RecurrentPool(model.cfg, 2, model.dtype, model.device, max_slots=8)
    before = graphs.graph_key(2, 16, kv, rec)
    rec.enlarge(4)
    assert graphs.graph_key(2, 16, kv, rec) != before
    kv.enlarge(16)
    assert graphs.graph_key(2, 16, kv, rec) != graphs.graph_key(2, 16, kv_pool(model.cfg, 8, model.dtype, model.device), rec)


@cuda_only
def test_graphed_decode_after_the_state_pool_grows_equals_eager(load_model):
    """Two rows captured in bucket 2, then the recurrent pool doubles and two rows in its new slots run
    the same bucket: a new graph, and the eager step's bits."""
    base = load_model(hf_dir("qwen3_5"))
    out = {}
    for flag in ("0", "1"):
        model = base.with_doors(MEMRA_CUDA_GRAPHS=flag)
        kv = kv_pool(model.cfg, 16, model.dtype, model.device)
        rec = RecurrentPool(model.cfg, 2, model.dtype, model.device, max_slots=8)
        rows = []
        for _ in range(2):  # the second pair's slots only exist once the pool has grown past the first's graph
            caches = [Cache(kv=kv, rec=rec, max_ctx=64, slot=rec.allocate()) for _ in range(2)]
            toks = [int(model.prime(p, c).argmax()) for p, c in zip(PROMPTS, caches)]
            rows.append(model.decode_step_batch(toks, caches))
        assert rec.n_slots == 4
        out[flag] = torch.cat(rows)
    assert _bits(out["0"], out["1"])


def test_a_buckets_table_widths_share_one_logits_buffer_and_closing_drops_it(load_model):
    """The decode statics of one bucket over one engine's pools (a narrow and a full table width) write one
    logits buffer (the head's dtype), widened out after each replay, and their captures share one memory pool
    (memra.graphs): a 512-row Qwen3.5-9B engine on an H100 ran out of memory while capturing, its buckets' private
    pools and per-width buffers holding ~7 GiB. Dropping the pools' graphs drops their buffers."""
    loaded = load_model(hf_dir("llama"))
    model = loaded.with_settings(loaded.settings)  # a fresh view: none of the earlier tests' decode graphs
    kv = kv_pool(model.cfg, 64, model.dtype, model.device)
    narrow, wide = StaticDecode(model, kv, None, 4, SPLIT_BLOCKS), StaticDecode(model, kv, None, 4, 2 * SPLIT_BLOCKS)
    assert narrow.logits is wide.logits and narrow.logits.shape == (4, model.cfg.vocab_size)
    assert StaticDecode(model, kv, None, 8, SPLIT_BLOCKS).logits is not narrow.logits
    other = kv_pool(model.cfg, 64, model.dtype, model.device)  # another engine's pools: buffers of their own
    assert StaticDecode(model, other, None, 4, SPLIT_BLOCKS).logits is not narrow.logits
    graphs.drop_graphs(model, kv, None)
    assert list(model.decode_logits) == [(4, id(other))] and model.decode_graph_pool is None
