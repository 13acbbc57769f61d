"""`memra bench model` (memra.bench: model_bench and the modules beside it) on CPU, with tiny shapes
built by a model factory.

The real shapes are far too big for a CPU test (one Qwen3.5 embedding alone is 1G parameters), so the
harness is driven through its `model_factory` hook with tiny configs of the same architectures; the
code paths (probes, cells, rooflines, the HF peer, ratios, budget, JSON) are the ones a GPU run takes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import FIXTURES
from memra.bench.config import BenchConfig
from memra.bench.fit import fit_layers
from memra.bench.hf_peer import hf_peer
from memra.bench.memra_cells import prompt_ids
from memra.bench.model_bench import _Progress, planned_cells, run_bench
from memra.bench.probes import Probes, measure_matmul_peak, measure_read_bandwidth
from memra.bench.report import BenchReport
from memra.bench.roofline import (decode_step_bytes, experts_touched, prefill_flops, roofline_decode_tokens_per_s,
                                  roofline_prefill_tokens_per_s, state_bytes, trunk_weights, weight_bytes)
from memra.config import MoeConfig
from memra.errors import MemraError
from memra.config import FP32_WEIGHTS
from memra.model.hybrid import HybridModel
from memra.random_model import SHAPES, _hybrid, _llama, canonical_shapes

TINY = {
    "tiny-llama": lambda n=None: _llama(n or 2, 64, 4, 2, 128, 256),
    "tiny-hybrid": lambda n=None: _hybrid(n or 4, 64, 4, 2, 16, 2, 4, 16, 128, 256),
    "tiny-moe": lambda n=None: _hybrid(n or 4, 64, 4, 2, 16, 2, 4, 16, 0, 256, moe=MoeConfig(8, 2, 32, 48, True, True)),
}


def tiny_model(cfg, device="cpu", dtype=torch.bfloat16, seed=0, perturb_norms=False) -> HybridModel:
    """random_model's recipe for any config (random_model itself knows only SHAPES). With perturb_norms
    the norm multipliers are not all 1, so a `w` vs `1 + w` slip in a weight mapping shows."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    with torch.inference_mode():  # as random_model builds them: inference tensors
        for k, shape in canonical_shapes(cfg).items():
            leaf = k.rsplit(".", 1)[-1]
            if leaf == "a_neg":
                t = -torch.empty(shape).uniform_(1, 16, generator=gen)
            elif leaf == "dt_bias" or leaf in FP32_WEIGHTS:
                t = torch.ones(shape) + (0.1 * torch.randn(shape, generator=gen) if perturb_norms else 0)
            elif leaf == "conv":
                t = torch.randn(shape, generator=gen) * 0.5
            else:
                t = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            weights[k] = t.to(device=device, dtype=torch.float32 if leaf in FP32_WEIGHTS else dtype)
    return HybridModel(cfg, weights, torch.device(device), dtype, source="tiny")


class Factory:
    """A model factory that remembers what it built (to recompute rooflines from the same model)."""

    def __init__(self):
        self.built: dict[str, HybridModel] = {}

    def __call__(self, name, device, dtype, n_layers, seed):
        self.built[name] = tiny_model(TINY[name](n_layers), device, dtype, seed)
        return self.built[name]


FAST = dict(batches=(1, 2), decode_steps=2, warmup=1, repeats=1, prefill_chunk=64, ttft_tokens=32, prompt_tokens=8,
            device="cpu")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    factory = Factory()
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    cfg = BenchConfig(models=("tiny-llama", "tiny-hybrid"), json_path=str(path), model_factory=factory,
                      peers=("hf", "hf-static"), **FAST)
    return run_bench(cfg, progress=False), factory, path


def test_every_cell_runs_and_ratios_come_from_this_run(full_run):
    report, factory, _ = full_run
    cfg = report.config
    planned = {(m, mode, phase, b) for m in cfg.models for mode, phase, b in planned_cells(cfg, m)}
    got = {(r.model, r.mode, r.phase, r.batch) for r in report.rows}
    assert got == planned and len(report.rows) == len(planned)
    assert {"exact", "fast", "hf", "hf-static"} == {r.mode for r in report.rows}
    assert all(r.status == "ok" for r in report.rows), [r.note for r in report.rows if r.status != "ok"]
    bw, peak = report.probes.read_bytes_per_s, report.probes.matmul_flops_per_s
    assert bw > 0 and peak > 0
    for r in report.rows:
        model = factory.built[r.model]
        assert r.tokens_per_s == pytest.approx(r.tokens / r.seconds)
        if r.phase == "decode":
            roof = roofline_decode_tokens_per_s(model, r.batch, bw, context=r.context)
        else:
            roof = roofline_prefill_tokens_per_s(model, cfg.prefill_chunk if r.phase == "prefill" else cfg.ttft_tokens,
                                                 bw, peak)
        assert r.roofline_tokens_per_s == pytest.approx(roof)
        assert r.vs_roofline == pytest.approx(r.tokens_per_s / roof)
        if r.mode in ("hf", "hf-static"):
            assert r.vs_hf is None and r.vs_hf_static is None and r.vs_fast is None
            continue
        hf, static = (report.row(r.model, peer, r.phase, r.batch) for peer in ("hf", "hf-static"))
        assert r.vs_hf == pytest.approx(r.tokens_per_s / hf.tokens_per_s)
        assert r.vs_hf_static == pytest.approx(r.tokens_per_s / static.tokens_per_s)
        if r.mode == "exact":
            assert r.vs_fast == pytest.approx(r.tokens_per_s / report.row(r.model, "fast", r.phase, r.batch).tokens_per_s)
        else:
            assert r.vs_fast is None
    for m in report.models:
        assert m.hf_peer.startswith("memra's weights"), m.hf_peer  # shared, not HF's random init
        assert m.layers == TINY[m.name]().n_layers


def test_table_and_json_round_trip(full_run):
    report, _, path = full_run
    text = report.table()
    for r in report.rows:
        assert r.model in text
    for word in ("exact", "fast", "hf", "decode", "prefill", "ttft", "roofline", "vs HF", "vs HF static", "exact/fast", "GB/s",
                 "ctx"):
        assert word in text
    lines = text.splitlines()
    for r in report.rows:  # a decode row shows the mean context its roofline assumes
        if r.phase == "decode" and r.status == "ok":
            assert r.context > 0
            assert any(line.split()[:5] == [r.model, r.mode, "decode", str(r.batch), str(r.context)] for line in lines)
    data = json.loads(json.dumps(report.to_json()))
    back = BenchReport.from_json(data)
    assert back == report
    old = dict(data["config"], peer_hf=False)  # a report written when the peer was one flag
    del old["peers"]
    assert BenchConfig.from_json(old).peers == ()
    assert json.loads(json.dumps(back.to_json())) == data
    on_disk = json.loads(path.read_text())
    assert on_disk == data


def test_out_of_budget_cells_are_recorded_as_skipped():
    ticks = iter(range(10**6))
    factory = Factory()
    # Each clock read is one "second" (the run reads it at its start, before each model and before each
    # cell), so a budget of 4 lets the first model's first cells run and skips every later one.
    cfg = BenchConfig(models=("tiny-llama", "tiny-hybrid"), peers=(), budget_s=4, model_factory=factory, **FAST)
    report = run_bench(cfg, clock=lambda: next(ticks), progress=False)
    planned = sum(len(planned_cells(cfg, m)) for m in cfg.models)
    assert len(report.rows) == planned
    status = [r.status for r in report.rows]
    ran = status.index("skipped")
    assert ran >= 1 and set(status[:ran]) == {"ok"} and set(status[ran:]) == {"skipped"}
    assert all("budget" in r.note and r.tokens_per_s is None for r in report.rows[ran:])
    assert list(factory.built) == ["tiny-llama"]  # the second model was never built
    assert "skipped" in report.table()
    assert not report.failed


def test_a_model_that_cannot_be_built_is_recorded_as_failed():
    def broken(name, device, dtype, n_layers, seed):
        raise MemraError("no such luck")

    cfg = BenchConfig(models=("tiny-llama",), model_factory=broken, **FAST)
    report = run_bench(cfg, progress=False)
    assert len(report.rows) == len(planned_cells(cfg, "tiny-llama"))
    assert all(r.status == "failed" and "no such luck" in r.note for r in report.rows)
    assert report.failed and "failed" in report.table()


def test_progress_bar_is_quiet_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "1")
    assert _Progress(10, None).bar is None


def test_refusals_are_clear():
    with pytest.raises(MemraError, match="unknown model shape 'gpt-5'.*qwen3.5-9b"):
        BenchConfig(models=("gpt-5",))
    BenchConfig(weights="q4_k")
    BenchConfig(weights="q8_0")
    with pytest.raises(MemraError, match="unknown weights format 'q2_k'"):
        BenchConfig(weights="q2_k")
    with pytest.raises(MemraError, match="unknown weights format 'int3'"):
        BenchConfig(weights="int3")
    with pytest.raises(MemraError, match="not among the models"):
        BenchConfig(models=("llama-3-8b",), layers=(("qwen3.5-9b", 4),))
    with pytest.raises(MemraError, match="prefill_chunk"):
        BenchConfig(prefill_chunk=5000)
    with pytest.raises(MemraError, match="unknown mode"):
        BenchConfig(exact_modes=("turbo",))


def test_cli(capsys):
    from memra.cli import main

    assert main(["bench", "model", "--weights", "q2_k", "--device", "cpu"]) == 2
    assert "unknown weights format" in capsys.readouterr().err
    assert main(["bench", "model", "--models", "nope", "--device", "cpu"]) == 2
    assert "unknown model shape 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench"])
    assert "{serve,model,throughput}" in capsys.readouterr().err
    from memra.bench.command import config_from_args, parse_layers
    from memra.cli import build_parser

    args = build_parser().parse_args(["bench", "model", "--models", "llama-3-8b,qwen3.5-9b", "--batches", "1,32",
                                      "--layers", "qwen3.5-9b=4", "--no-hf", "--budget", "60", "--device", "cpu"])
    cfg = config_from_args(args)
    assert cfg.models == ("llama-3-8b", "qwen3.5-9b") and cfg.batches == (1, 32) and cfg.peers == ()
    assert cfg.layers_for("qwen3.5-9b") == 4 and cfg.layers_for("llama-3-8b") is None and cfg.budget_s == 60
    assert parse_layers("6", ("a", "b")) == (("a", 6), ("b", 6))


def test_decode_roofline_bytes_by_hand():
    cfg = _llama(1, 64, 4, 2, 128, 256)
    m = tiny_model(cfg, dtype=torch.bfloat16)
    e, v, f, d, kv, h = 64, 256, 128, 16, 2, 4
    weights = (3 * e * 2  # 3 rows of the embedding (bf16)
               + v * e * 2 + e * 4  # LM head, final norm (fp32)
               + 2 * e * 4  # attn_norm, ffn_norm (fp32)
               + (h * d + 2 * kv * d) * e * 2 + e * h * d * 2  # wqkv, wo
               + 2 * f * e * 2 + e * f * 2)  # w_gate_up, w_down
    kv_read = 3 * 40 * 2 * kv * d * 2  # 3 sequences x 40 positions x (K and V) x heads x dim, bf16
    assert decode_step_bytes(m, 3, 40) == weights + kv_read
    assert roofline_decode_tokens_per_s(m, 3, 1e9, context=40) == pytest.approx(3 / ((weights + kv_read) / 1e9))


def test_moe_and_gdn_roofline_bytes_by_hand():
    cfg = TINY["tiny-moe"](4)
    m = tiny_model(cfg)
    trunk = trunk_weights(m)
    assert not any(k.startswith("mtp.") for k in trunk)
    nbytes = lambda t: t.numel() * t.element_size()
    routed = sum(nbytes(t) for k, t in trunk.items() if k.endswith(("moe.w_gate_up", "moe.w_down")))
    rest = sum(nbytes(t) for k, t in trunk.items() if k != "embed" and not k.endswith(("moe.w_gate_up", "moe.w_down")))
    embed_row = 64 * 2
    assert weight_bytes(m, 1) == pytest.approx(embed_row + rest + routed * 2 / 8)  # top 2 of 8 experts
    assert weight_bytes(m, 10_000) == pytest.approx(256 * embed_row + rest + routed)  # all experts, every row
    assert experts_touched(256, 8, 1) == 8
    for tokens in (2, 8, 32, 128):
        assert experts_touched(256, 8, tokens) <= min(8 * tokens, 256)
    # GDN state, per sequence: 3 GDN layers x (fp32 state [Hv, Dk, Dv] + conv window [C, K-1] bf16), read and written
    conv_dim = 2 * 2 * 16 + 4 * 16
    gdn = 2 * 3 * (4 * 16 * 16 * 4 + conv_dim * 3 * 2)
    attn = 1 * 50 * 2 * 2 * 16 * 2  # one attention layer, 50 positions
    assert state_bytes(cfg, torch.bfloat16, 50) == gdn + attn


def test_prefill_roofline_takes_the_slower_bound():
    m = tiny_model(TINY["tiny-llama"]())
    flops, wbytes = prefill_flops(m, 64), weight_bytes(m, 64)
    assert flops > 2 * 64 * sum(t.numel() for k, t in trunk_weights(m).items() if k.startswith("layers.") and t.dim() == 2)
    assert roofline_prefill_tokens_per_s(m, 64, 1e30, 1e9) == pytest.approx(64 / (flops / 1e9))  # compute-bound
    assert roofline_prefill_tokens_per_s(m, 64, 1e6, 1e30) == pytest.approx(64 / (wbytes / 1e6))  # bandwidth-bound


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid", "tiny-moe"])
def test_hf_peer_runs_memras_own_weights(name):
    pytest.importorskip("transformers")
    m = tiny_model(TINY[name](), dtype=torch.float32, perturb_norms=True)
    hf, how = hf_peer(m)
    assert how == "memra's weights (shared tensors)"
    ids = prompt_ids(m.cfg.vocab_size, 20)
    ref = m.prime(ids, m.new_cache(32), all_logits=True)
    with torch.inference_mode():
        out = hf(torch.tensor([ids])).logits[0].float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4
    # the big matrices are memra's own memory, not copies
    layer = next(i for i, mx in enumerate(m.cfg.mixers) if mx == "attention")
    q = hf.model.layers[layer].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == m.blocks[layer].mixer.wqkv.untyped_storage().data_ptr()


def test_fit_layers_reduces_a_model_that_does_not_fit():
    cfg = BenchConfig(models=("qwen3.5-35b-a3b", "llama-3-8b"))
    n, note = fit_layers("qwen3.5-35b-a3b", None, cfg, free_bytes=40 * 10**9)
    assert n % 4 == 0 and 4 <= n < 40 and "of 40 layers" in note
    assert fit_layers("qwen3.5-35b-a3b", None, cfg, free_bytes=10**15) == (40, None)
    assert fit_layers("llama-3-8b", 3, cfg, free_bytes=1) == (3, None)  # an explicit count is the user's call
    with pytest.raises(MemraError, match="not even"):
        fit_layers("llama-3-8b", None, cfg, free_bytes=10**9)
    assert set(SHAPES) == {"qwen3.5-9b", "qwen3.5-35b-a3b", "llama-3-8b"}  # the benchmark adds no shapes


def test_probes_run_on_cpu():
    assert measure_read_bandwidth("cpu", nbytes=2**20, repeats=1) > 0
    assert measure_matmul_peak("cpu", torch.float32, size=32, repeats=1) > 0
    assert math.isfinite(Probes.measure("cpu", torch.bfloat16, 1).read_bytes_per_s)


def test_packed_weights_count_their_packed_bytes(monkeypatch):
    """weights=q8_0: the roofline reads the packed bytes (34 per 32 values), not a dense copy."""
    import memra.random_model as rm
    from memra.kernels.split import Q8Split

    monkeypatch.setitem(rm.SHAPES, "tiny-packed", lambda n: rm._llama(n or 1, 256, 4, 2, 512, 512))
    dense = rm.random_model("tiny-packed", "cpu", torch.float32)
    packed = rm.random_model("tiny-packed", "cpu", torch.float32, quant="q8_0")
    projections = [t for t in (packed.blocks[0].mixer.wqkv, packed.blocks[0].mixer.wo, packed.blocks[0].ffn.w_gate_up,
                               packed.blocks[0].ffn.w_down, packed.lm_head)]
    assert all(isinstance(t, Q8Split) for t in projections)  # split as the loader holds it
    saved = sum(t.shape[0] * t.shape[1] * 4 - t.nbytes for t in projections)  # fp32 dense minus packed
    assert weight_bytes(dense, 1) - weight_bytes(packed, 1) == saved
    # FLOPs are the logical matmul's, packed or not (a packed weight has no .dim(): the bug the H200 run hit)
    assert prefill_flops(packed, 64) == prefill_flops(dense, 64)


def test_bench_gguf_runs_memra_beside_llama_cpp_on_one_file(capsys):
    """`memra bench model --gguf FILE`: memra's row has its load, memory and decode rate; llama.cpp's row
    has its numbers where llama_cpp is importable, and otherwise says how to get it."""
    from memra.bench.gguf_file import run_gguf_bench
    from memra.cli import main

    path = str(FIXTURES / "gguf" / "llama-q8_0.gguf")
    runs = {r.engine: r for r in run_gguf_bench(path, tokens=6, threads=1)}
    mine = runs["memra"]
    assert mine.error is None and mine.tok_s > 0 and mine.load_s > 0
    assert mine.rss_bytes is not None and mine.peak_bytes >= mine.rss_bytes > 0
    peer = runs["llama.cpp"]
    assert (peer.tok_s or 0) > 0 or "pip install llama-cpp-python" in peer.error
    assert main(["bench", "model", "--gguf", path, "--steps", "4", "--threads", "1"]) == 0
    table = capsys.readouterr().out
    assert "llama-q8_0.gguf" in table and "\nmemra " in table and "\nllama.cpp " in table
    with pytest.raises(MemraError, match="no such file"):
        run_gguf_bench(str(FIXTURES / "gguf" / "missing.gguf"), tokens=4)
    with pytest.raises(MemraError, match="at least 2"):
        run_gguf_bench(path, tokens=1)


def test_bench_gguf_batch_rows_are_the_b1_rows_beside_llama_cpps_batched_decode(monkeypatch):
    """`--batch B`: B rows at once on a Qwen3.5 (hybrid) Q8_0 file, the C decode path on; memra's first row
    has its B=1 tokens (the report's 'row 0 = B=1'), and llama.cpp's batched decode gives a rate."""
    from memra.bench.gguf_file import gguf_table, run_gguf_bench

    monkeypatch.setenv("MEMRA_CPU_DECODE", "1")
    path = str(FIXTURES / "gguf" / "qwen3_5-q8_0.gguf")
    runs = {(r.engine, r.batch): r for r in run_gguf_bench(path, tokens=5, threads=(1,), batch=3)}
    solo, rows = runs[("memra", 1)], runs[("memra", 3)]
    assert rows.error is None and rows.tok_s > 0 and len(rows.row0) == 5 and rows.row0 == solo.row0
    peer = runs[("llama.cpp", 3)]
    assert (peer.tok_s or 0) > 0 or "pip install llama-cpp-python" in peer.error
    line = next(ln for ln in gguf_table(path, list(runs.values())).splitlines() if ln.startswith("memra ") and "  3  " in ln)
    assert line.rstrip().endswith("yes")


def test_bench_gguf_repeats_keep_each_engines_fastest_run_and_its_spread():
    from memra.bench.gguf_file import GgufRun, _fastest

    best = _fastest([GgufRun("memra", tok_s=3.0), GgufRun("memra", tok_s=5.0), GgufRun("memra", error="killed")])
    assert (best.tok_s, best.low, best.error) == (5.0, 3.0, None)
    assert _fastest([GgufRun("memra", error="killed")]).error == "killed"
