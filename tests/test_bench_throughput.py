"""`memra bench throughput`: its synthetic workload is a pure function of its arguments and fits the
context, its JSONL reader refuses bad lines in one line, and a run on the demo counts every token it
reports, through the engine's step mix, with its re-run-alone exactness check passing."""

from __future__ import annotations

import json

import pytest

from conftest import DEVICE
from memra.bench.throughput import (MAX_LEN, MIN_LEN, ThroughputConfig, jsonl_workload, run_throughput,
                                    synthetic_workload)
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
