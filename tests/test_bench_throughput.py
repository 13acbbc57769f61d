"""`memra bench throughput`: its synthetic workload is a pure function of its arguments and fits the
context, its JSONL reader refuses bad lines in one line, and a run on the demo counts every token it
reports, through the engine's step mix, with its re-run-alone exactness check passing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEVICE, hf_dir
from memra.bench.roofline import prefill_flops, state_bytes
from memra.bench.throughput import (MAX_LEN, MIN_LEN, ThroughputConfig, jsonl_workload, run_throughput,
                                    synthetic_workload)
from memra.bench.workload_floor import meta_model, workload_floor, workload_work
from memra.cli import main
from memra.errors import MemraError


def test_synthetic_workload_is_seeded_and_fits_the_context():
    cfg = ThroughputConfig(num_prompts=300, seed=5)
    a, b = synthetic_workload(cfg, 1000, 2048), synthetic_workload(cfg, 1000, 2048)
    assert a == b
    assert a != synthetic_workload(ThroughputConfig(num_prompts=300, seed=6), 1000, 2048)
    lens = [len(r.prompt) for r in a] + [r.output_len for r in a]
    assert MIN_LEN <= min(lens) and max(lens) <= MAX_LEN
    assert len(set(lens)) > 100  # a spread, not one length
    assert all(0 <= t < 1000 for r in a for t in r.prompt)
    short = synthetic_workload(ThroughputConfig(num_prompts=50, input_len=300, output_len=300), 1000, 400)
    assert all(len(r.prompt) == 300 and r.output_len == 100 for r in short)  # the output is cut to fit


def test_jsonl_workload(tmp_path):
    class Tok:
        def encode(self, text, add_special=True):
            return [1] + [ord(c) for c in text]

    good = tmp_path / "w.jsonl"
    good.write_text('{"prompt": "ab", "output_len": 3}\n\n{"prompt_token_ids": [4, 5], "output_len": 2}\n'
                    '{"prompt": "c"}\n', encoding="utf-8")
    reqs = jsonl_workload(str(good), Tok(), limit=2)
    assert [(r.prompt, r.output_len) for r in reqs] == [([1, 97, 98], 3), ([4, 5], 2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ab", "output_len": 3}\n{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(MemraError, match="line 2"):
        jsonl_workload(str(bad), Tok(), limit=10)
    with pytest.raises(MemraError, match="cannot read"):
        jsonl_workload(str(tmp_path / "missing.jsonl"), Tok(), limit=10)


def test_throughput_run_on_the_demo(tmp_path):
    out = tmp_path / "t.json"
    cfg = ThroughputConfig(model="demo", num_prompts=12, output_len=12, max_batch=4, device=DEVICE, check=2,
                           json_path=str(out))
    report = run_throughput(cfg, log=lambda line: None)
    assert report.requests == 12 and report.output_tokens == 12 * 12 and report.length_failures == 0
    assert report.checked == 2 and report.check_failures == []
    steps = report.steps
    # every request's first token comes from its last prompt position, every other one from a decode row
    assert sum(k["decode_rows"] for k in steps.values()) == report.output_tokens - report.requests
    assert sum(k["prompt_tokens"] for k in steps.values()) == report.prompt_tokens
    assert report.output_tps > 0 and report.total_tps > report.output_tps
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["output_tokens"] == 144 and saved["output_tokens_per_s"] == pytest.approx(report.output_tps)
    # the workload's floor on this device, measured after the run: in the table and in the JSON
    floor = report.floor
    assert floor.matmul_flops > 0 and floor.cache_bytes > 0 and floor.seconds > 0
    assert "floor on this device" in report.table() and saved["floor"]["seconds"] == floor.seconds
    assert report.longest_first and ", longest outputs first" in report.table()  # memra.LLM's auto order


def test_the_floor_counts_each_token_once_as_a_prefill_or_a_decode_step(load_model):
    """workload_work's closed forms against the roofline's per-step counts summed token by token: a prompt's
    prefill, then each decode step at its position (prefill_flops of one token at pos0, state_bytes of its
    prefix), on a hybrid (GDN state) and a plain attention model."""
    for arch in ("qwen3_5", "llama"):
        model = load_model(hf_dir(arch))
        lengths = [(5, 1), (7, 4), (1, 9)]
        flops, cache = workload_work(model, lengths)
        want_flops = want_cache = 0.0
        for p, o in lengths:
            want_flops += prefill_flops(model, p)
            for k in range(o - 1):  # the decode step feeding position p + k attends to p + k + 1 keys
                want_flops += prefill_flops(model, 1, pos0=p + k)
                want_cache += state_bytes(model.cfg, model.dtype, p + k + 1)
        # the same terms summed in another order: equal up to float rounding
        assert flops == pytest.approx(want_flops, rel=1e-12) and cache == pytest.approx(want_cache, rel=1e-12)
        # a model of the same shape on the meta device (tools/workload_floor.py's) counts the same
        assert workload_work(meta_model(model.cfg, model.dtype), lengths) == (flops, cache)
        floor = workload_floor(model, lengths, matmul_flops_per_s=1e12, read_bytes_per_s=1e11)
        assert floor.seconds == pytest.approx(flops / 1e12 + cache / 1e11, rel=1e-12)
        assert "this run 50% of it" in floor.line(output_tokens=14, seconds=2 * floor.seconds)


def test_a_floor_whose_probes_do_not_fit_is_named_not_fatal(monkeypatch):
    """The probes run after the engine is closed; where their buffers do not fit beside the model, the run's
    report stands and says why it has no floor."""
    from memra.bench.probes import Probes

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(Probes, "measure", no_room)
    cfg = ThroughputConfig(model="demo", num_prompts=3, output_len=4, max_batch=4, device=DEVICE, check=0)
    report = run_throughput(cfg, log=lambda line: None)
    assert report.output_tokens == 12 and report.floor is None
    assert "floor on this device: not measured (the probes' buffers did not fit beside the model)" in report.table()
    assert report.to_json()["floor"] is None


def test_throughput_cli(tmp_path, capsys):
    data = tmp_path / "w.jsonl"
    data.write_text('{"prompt": "ROMEO:", "output_len": 5}\n{"prompt": "JULIET:", "output_len": 7}\n', encoding="utf-8")
    assert main(["bench", "throughput", "demo", "--dataset", str(data), "--device", DEVICE, "--check", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 requests," in out and "+ 12 output tokens" in out and "all equal" in out
    assert main(["bench", "throughput", "demo", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be positive" in capsys.readouterr().err


def test_structured_runs_hold_every_request_to_the_grammar(tmp_path, capsys):
    """--structured regex: each request's text matches the pattern; a bad spelling is refused before the load."""
    import re

    from memra.engine.llm import LLM

    cfg = ThroughputConfig(model="demo", num_prompts=3, output_len=10, max_batch=3, device=DEVICE, check=1,
                           structured="regex:[a-z ]*")
    report = run_throughput(cfg, log=lambda line: None)
    assert report.output_tokens == 30 and report.check_failures == [] and "held to regex:[a-z ]*" in report.workload
    llm = LLM("demo", max_batch=1)
    from memra.sampling import SamplingParams

    text = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=cfg.constraint()),
                        use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch("[a-z ]*", text)
    assert main(["bench", "throughput", "demo", "--structured", "yaml"]) == 2
    assert "--structured takes json_object, regex:PATTERN or json:SCHEMA" in capsys.readouterr().err


def test_logprobs_runs_ask_for_every_token_and_a_bad_count_is_refused(capsys):
    """--logprobs N: every request asks for its tokens' logprobs (the sampler's logprob path is timed too);
    a count past MAX_LOGPROBS is refused before the load."""
    cfg = ThroughputConfig(model="demo", num_prompts=3, output_len=6, max_batch=3, device=DEVICE, check=1, logprobs=2)
    report = run_throughput(cfg, log=lambda line: None)
    assert report.output_tokens == 18 and report.check_failures == [] and "logprobs (top 2)" in report.workload
    assert main(["bench", "throughput", "demo", "--logprobs", "21"]) == 2
    assert "--logprobs must be in 0..20" in capsys.readouterr().err


def test_auto_steps_down_a_bucket_where_its_captured_steps_do_not_fit(monkeypatch):
    """--max-batch auto sizes the pools only; where the captured steps of its bucket then run out of device memory
    (the 9B with a bf16 GDN state: 1,024 rows on an H100), the run tries the next bucket down and says so. A
    max_batch the user named is refused in one line instead."""
    from memra.engine import batch_size, warmup

    real = warmup.warm_up

    def tight(model, backend, max_batch, *args, **kwargs):
        if max_batch > 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(model, backend, max_batch, *args, **kwargs)

    monkeypatch.setattr(warmup, "warm_up", tight)
    monkeypatch.setattr(batch_size, "auto_max_batch", lambda model, tokens: (16, "max_batch auto: 16 (the pools)"))
    lines: list[str] = []
    cfg = ThroughputConfig(model="demo", num_prompts=3, output_len=4, device=DEVICE, check=0)
    report = run_throughput(cfg, log=lines.append)
    assert report.max_batch == 8 and report.output_tokens == 12
    assert "max_batch auto: 16's captured steps did not fit beside the pools, so 8" in lines
    with pytest.raises(MemraError, match="max_batch 16: its captured steps ran out of device memory"):
        run_throughput(ThroughputConfig(model="demo", num_prompts=3, output_len=4, max_batch=16, device=DEVICE,
                                        check=0), log=lambda line: None)
