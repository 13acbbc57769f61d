"""What `memra bench throughput` reports about the space between steps and how the batch is sized: the
step clock's host gaps (every step after the first of a busy stretch has one), the decode steps' row
histogram, --max-batch auto (the largest graph bucket the KV budget holds), --variants parsing and its
one table; on CUDA, the GPU's idle share from events, with no stream-draining call in the loop."""

from __future__ import annotations

import types

import pytest
import torch

import memra
from conftest import DEVICE
from cuda_marks import cuda_only
from memra.bench.throughput import ThroughputConfig, prepare, run_on
from memra.bench.throughput_variants import parse_variants, run_variants, variants_table
from memra.cli import main
from memra.engine.batch_size import AUTO_CAP, auto_max_batch, largest_bucket, sequence_bytes
from memra.engine.step_mix import StepMix, row_bin
from memra.errors import MemraError
from memra.graphs import BUCKETS
from memra.random_model import SHAPES
from memra.sampling import SamplingParams


def test_row_bins_and_the_mix_keep_gaps_and_the_histogram():
    assert [row_bin(r) for r in (1, 31, 32, 100, 255, 256, 511, 512, 900)] == \
        ["<32", "<32", "<64", "<128", "<256", "<512", "<512", ">=512", ">=512"]
    mix = StepMix()
    mix.add("decode", 40, 0, 0.010, host_gap=None)
    mix.add("decode", 300, 0, 0.012, host_gap=0.002)
    mix.add("mixed", 200, 300, 0.030, host_gap=0.004)
    before = mix.copy()
    mix.add("decode", 10, 0, 0.008, host_gap=0.001)
    mix.add_device("decode", 0.0005, 0.0075, 0.0015)
    later = mix.since(before)
    assert later.kinds["decode"].steps == 1 and later.kinds["decode"].host_gap == pytest.approx(0.001)
    assert later.rows["<32"] == 1 and sum(later.rows.values()) == 1
    assert mix.rows == {"<32": 1, "<64": 1, "<128": 0, "<256": 0, "<512": 1, ">=512": 0}
    assert mix.idle_share == pytest.approx(0.0005 / 0.008) and mix.wait_share == pytest.approx(0.0015 / 0.008)
    text = "\n".join(mix.lines())
    assert "host gap" in text and "decode steps by rows: <32 1  <64 1" in text and "GPU idle between steps: 6.2% of the device's step time, and within steps 18.8%" in text
    assert "device time a step (its first launch on the stream to its last, CUDA events): decode 7.50 ms; 0.01 s in all" \
        in text  # the device's own time a step, beside the host's launch-to-end


def test_the_engine_clocks_a_host_gap_before_every_step_but_the_first():
    llm = memra.LLM("demo", device=DEVICE, max_batch=4, max_ctx=256, warm_up=False)
    llm.generate(["ROMEO:", "JULIET:", "HAMLET:"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    kinds = llm.engine.step_mix.kinds
    steps = sum(t.steps for t in kinds.values())
    assert steps == llm.engine.steps and steps >= 6
    assert sum(t.gaps for t in kinds.values()) == steps - 1  # the first step follows an idle engine
    assert all(t.host_gap > 0 for t in kinds.values() if t.gaps)
    assert sum(llm.engine.step_mix.rows.values()) == kinds["decode"].steps
    if llm.model.device.type != "cuda":
        assert llm.engine.step_mix.idle_share is None and all(t.timed == 0 for t in kinds.values())


def test_auto_max_batch_is_the_largest_bucket_the_budget_holds():
    assert largest_bucket(100, 1) == 96 and largest_bucket(10**9, 1) == BUCKETS[-1] and largest_bucket(5, 10) == 1
    llama = types.SimpleNamespace(cfg=SHAPES["llama-3-8b"](), dtype=torch.bfloat16)
    per = sequence_bytes(llama, 510)  # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes a token, 32 blocks of 16
    assert per == 32 * 16 * 32 * 8 * 128 * 2 * 2
    assert auto_max_batch(llama, 510, budget_bytes=int(49.7 * (1 << 30)))[0] == 768  # an H100's 0.8 of the rest
    assert auto_max_batch(llama, 510, budget_bytes=per * 511)[0] == 384
    batch, said = auto_max_batch(llama, 510, budget_bytes=per * 5000)  # room for 4,096 rows: auto stops at its cap
    assert batch == AUTO_CAP == 768 and "1024 would fit; auto stops at 768" in said
    hybrid = types.SimpleNamespace(cfg=SHAPES["qwen3.5-9b"](), dtype=torch.bfloat16)
    assert sequence_bytes(hybrid, 16) > sequence_bytes(hybrid, 16) - 1 > 0  # its recurrent slot counts
    with pytest.raises(MemraError, match="--max-batch must be"):
        ThroughputConfig(max_batch="all")


def test_variants_parse_and_run_on_one_model_into_one_table(capsys):
    assert parse_variants("256, 256/512,auto/512 ,auto,256/0") == [(256, None), (256, 512), ("auto", 512), ("auto", None),
                                                                   (256, 0)]
    for bad in ("", "0", "x/512", "256/-4", "-1"):
        with pytest.raises(MemraError, match="--variants"):
            parse_variants(bad)
    cfg = ThroughputConfig(model="demo", num_prompts=6, input_len=70, output_len=5, device=DEVICE, check=1)
    reports = run_variants(cfg, [(2, None), (4, 64)], log=lambda line: None)
    assert [(r.max_batch, r.prefill_budget) for r in reports] == [(2, None), (4, 64)]  # 2 rows: shared by default
    assert all(r.output_tokens == 30 and r.check_failures == [] and r.length_failures == 0 for r in reports)
    for r in reports:  # the counters of the timed run: no graphs off CUDA
        assert r.captures == 0 and 0 <= r.one_forward <= r.steps["mixed"]["steps"]
    table = variants_table(reports)
    assert table.count("\n") == 4 and "shared" in table and "equal" in table
    assert f"{reports[1].one_forward}/{reports[1].steps['mixed']['steps']}" in table
    assert main(["bench", "throughput", "demo", "--variants", "2,2/8"]) == 2  # refused before the load
    assert "--prefill-budget must be an integer of at least 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "demo", "--max-batch", "many"])
    assert "is not a positive integer or auto" in capsys.readouterr().err


def test_max_batch_auto_on_a_loaded_model():
    cfg = ThroughputConfig(model="demo", num_prompts=3, input_len=8, output_len=3, device=DEVICE, check=0,
                           max_batch="auto")
    model, reqs, workload = prepare(cfg)
    lines = []
    report = run_on(model, reqs, workload, cfg, log=lines.append)
    assert report.max_batch in BUCKETS and report.max_batch == auto_max_batch(model, 11)[0]
    assert report.sizing.startswith("max_batch auto:") and report.sizing in lines
    assert report.output_tokens == 9


@cuda_only
def test_the_gpu_idle_share_is_read_from_events_without_draining_the_stream():
    import warnings

    llm = memra.LLM("demo", device="cuda", max_batch=8, max_ctx=256)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=20)
    llm.generate(["ROMEO:"] * 6, params, use_tqdm=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(["JULIET:"] * 6, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not [w for w in caught if "synchroniz" in str(w.message) and "step_clock" in w.filename]
    llm.engine.clock.flush()
    kinds = llm.engine.step_mix.kinds
    assert sum(t.timed for t in kinds.values()) == llm.engine.steps
    share, wait = llm.engine.step_mix.idle_share, llm.engine.step_mix.wait_share
    assert share is not None and 0.0 <= share < 1.0 and 0.0 <= wait < 1.0


def test_the_mixed_graph_warm_up_is_bounded_by_blocks_written_not_by_whole_contexts():
    """memra.engine.warmup.graph_rows: the rows it decodes hold one block each; a pool that holds few whole
    contexts (24k blocks, 2,048-token contexts: 190) still warms every bucket up to max_batch."""
    from memra.engine.warmup import graph_rows

    def backend(blocks, slots=None):
        return types.SimpleNamespace(blocks=blocks, slots=slots)

    assert graph_rows(backend(24_000), 768, 2048) == 767  # and the prefilling prompt, one of max_batch
    assert graph_rows(backend(24_000, slots=300), 768, 2048) == 299  # one slot is the prefilling prompt's
    assert graph_rows(backend(100), 768, 2048) == 100 - (512 + 512) // 16 - 2
    assert graph_rows(backend(200), 768, 4096, largest=2048) == 200 - (512 + 2048) // 16 - 2  # MEMRA_MIXED_TOKENS
    assert graph_rows(backend(10), 64, 2048) == 0
    # a short context: its prompts are at most cache_ctx - 1 tokens and no row passes a split (the demo's
    # 4-row engine at 75 tokens had 20 blocks, warmed no mixed step, and captured two mid-run on an H100)
    assert graph_rows(backend(20, slots=4), 4, 75) == 3


@cuda_only
def test_no_mixed_graph_is_captured_mid_run_when_the_pool_holds_few_contexts():
    from memra import counters
    from memra.pools import KvBudget

    probe = memra.LLM("demo", device="cuda", max_batch=1, max_ctx=256, warm_up=False)
    block, slot = probe.engine.backend.kv.block_bytes, probe.engine.backend.rec.slot_bytes
    probe.close()
    # 150 blocks: room for 9 whole 256-token contexts (the old bound: mixed graphs up to 8 rows), and for
    # 16 rows of short sequences, which start while others decode (mixed steps of up to 16 rows); beside
    # them the recurrent slots of 16 rows and the scratch row (no prefix snapshots: caching off)
    budget = KvBudget(gib=(151 * block + 17 * slot) / (1 << 30))
    llm = memra.LLM("demo", device="cuda", max_batch=16, max_ctx=256, kv_budget=budget, enable_prefix_caching=False)
    assert llm.engine.backend.blocks * 16 // 256 < 16
    before = counters.snapshot()
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 9)] for i in range(40)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 11) for i in range(40)]
    llm.generate(prompts, params, use_tqdm=False)
    got = counters.delta(before)
    assert got.get("mixed_steps", 0) > 0 and got.get("graph_captures", 0) == 0
