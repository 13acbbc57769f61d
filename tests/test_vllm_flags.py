"""Issue 46, the command line a vLLM user brings: `vllm serve`'s flags on `memra serve` (each works — memra's
own names are aliases — or is refused in one line naming it, before anything loads), an unknown flag answered
with the subcommand's usage, `memra generate` never taking a model's name for the prompt, a clipped
--max-tokens said aloud, and `memra --version` / `--help` without torch. Nothing here loads a model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from memra.cli import build_parser, main
from memra.cli_common import fit
from memra.server.vllm_flags import apply_vllm_flags, chat_template, generation_defaults


def _serve_args(*flags: str):
    return build_parser("serve").parse_args(["serve", *flags])


def test_vllm_names_and_memra_aliases_set_the_same_settings():
    vllm = _serve_args("Qwen/Qwen3-0.6B", "--max-model-len", "64", "--max-num-seqs", "3",
                       "--max-num-batched-tokens", "128", "--no-enable-prefix-caching", "-pp", "2",
                       "--served-model-name", "a", "b", "--dtype", "half")
    memra = _serve_args("Qwen/Qwen3-0.6B", "--max-ctx", "64", "--max-batch", "3", "--token-budget", "128",
                        "--no-prefix-caching", "--pp-size", "2", "--served-model-name", "a", "b", "--dtype", "half")
    assert vars(vllm) == vars(memra)
    assert (vllm.max_ctx, vllm.max_batch, vllm.token_budget, vllm.prefix_caching, vllm.pp_size) == (64, 3, 128, False, 2)
    assert vllm.served_model_name == ["a", "b"]
    plain = _serve_args("--model", "tests/fixtures/hf/qwen3", "--trust-remote-code", "--tensor-parallel-size", "1",
                        "--enforce-eager", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                        "--disable-uvicorn-access-log", "--tokenizer", "tests/fixtures/hf/qwen3")
    apply_vllm_flags(plain)
    assert plain.model == "tests/fixtures/hf/qwen3" and plain.settings.cuda_graphs is False
    assert (plain.speculative, plain.draft_k, plain.disable_log_requests) == ("ngram", 3, True)
    state = _serve_args("demo", "--mamba-ssm-cache-dtype", "bfloat16", "--enforce-eager")
    apply_vllm_flags(state)
    assert (state.settings.gdn_state_dtype, state.settings.cuda_graphs) == ("bfloat16", False)
    auto = _serve_args("demo", "--mamba-ssm-cache-dtype", "auto")
    apply_vllm_flags(auto)
    assert getattr(auto, "settings", None) is None  # nothing to change: the doors are read at load as ever


@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 is not supported: memra has no tensor parallelism"),
    (["-dp", "2"], "--data-parallel-size 2 is not supported"),
    (["--quantization", "fp8"], "--quantization is not supported"),
    (["--tokenizer", "other/tok"], "--tokenizer is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported"),
    (["--mamba-ssm-cache-dtype", "float16"], "--mamba-ssm-cache-dtype 'float16' is not supported"),
    (["--mamba-ssm-cache-dtype", "bfloat16", "--pp-size", "2"],
     "--mamba-ssm-cache-dtype is not supported with a process pipeline"),
    (["--enforce-eager", "--pp-size", "2"], "--enforce-eager is not supported with a process pipeline"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported"),
    (["--enable-lora"], "--enable-lora is not supported"),
    (["--speculative-config", '{"method": "eagle", "model": "x"}'], "method 'eagle' is not supported"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--chat-template", "/no/such/file.jinja"], "--chat-template /no/such/file.jinja: no such file"),
    (["--generation-config", "/no/such/dir"], "--generation-config /no/such/dir: not 'auto', 'vllm' or a directory"),
])
def test_each_unsupported_flag_is_one_line_naming_it(capsys, flags, needle):
    assert main(["serve", "demo", "--port", "1", *flags]) == 2  # refused before the port or the model
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_an_unknown_flag_prints_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "demo", "--max-num-partial-prefills", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: memra serve") and "unrecognized arguments" in err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--bogus"])
    assert capsys.readouterr().err.startswith("usage: memra bench serve")


def test_generation_config_and_chat_template(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "bos_token_id": 1,
                                                                 "max_new_tokens": 99}))
    args = _serve_args("demo", "--generation-config", str(tmp_path), "--override-generation-config", '{"top_p": 0.9}')
    assert generation_defaults(args) == {"temperature": 0.6, "top_k": 20, "max_tokens": 99, "top_p": 0.9}
    assert generation_defaults(_serve_args("demo")) == {}  # memra's default: vllm, no checkpoint defaults
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert chat_template(str(tmp_path / "t.jinja")) == "{{ messages }}" == chat_template("{{ messages }}")


def test_a_model_name_is_never_taken_for_the_prompt(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # no prompt waiting on standard input
    for word in ("Qwen/Qwen3-0.6B", str(tmp_path / "missing.gguf"), str(tmp_path)):
        assert main(["generate", word, "--max-tokens", "5"]) == 2
        err = capsys.readouterr()
        assert err.out == "" and err.err.startswith("error: ") and "names a model, and no prompt came with it" in err.err
    note = tmp_path / "notes.txt"
    note.write_text("hello")
    assert main(["generate", str(note)]) == 2
    assert f"use -f {note}" in capsys.readouterr().err


def test_a_clipped_max_tokens_says_so(capsys):
    from memra.sampling import SamplingParams

    params = SamplingParams(max_tokens=5000, temperature=0.0, seed=0)
    assert fit(params, 10, 100).max_tokens == 90
    assert "--max-tokens 5000 clipped to 90: the model's context is 100 tokens and the prompt takes 10" in \
        capsys.readouterr().err
    assert fit(SamplingParams(max_tokens=5, temperature=0.0, seed=0), 10, 100).max_tokens == 5
    assert capsys.readouterr().err == ""


def test_version_and_help_import_no_torch():
    """Their speed: `memra --version` / `--help` import neither torch nor the benchmarks (measured with
    `time memra --version`: 0.4 s on the 2-core dev machine, where importing torch alone takes 2 s)."""
    code = ("import sys\nfrom memra.cli import main\nfor argv in (['--version'], ['--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "throughput" in out.stdout and "ORG/NAME" in out.stdout  # memra --help names bench throughput; serve, hub names


def test_the_help_texts_the_issue_found_cut_are_whole_sentences():
    parser = build_parser("bench")
    subs = {a.dest: a for a in parser._actions if isinstance(a, argparse._SubParsersAction)}
    bench_serve = subs["command"].choices["bench"]._subparsers._group_actions[0].choices["serve"]
    helps = {a.option_strings[0]: a.help for a in bench_serve._actions if a.option_strings}
    for flag in ("--launch", "--dynamic-k", "--draft-k", "--speculative"):
        assert helps[flag].endswith(".") and "the server's adapt" not in helps[flag], (flag, helps[flag])
    assert "how many drafted tokens the model has been accepting" in helps["--dynamic-k"]


def test_no_cuda_message_speaks_the_command_lines_language():
    import torch

    from memra.errors import MemraError
    from memra.loading.checkpoint import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MemraError) as err:
        resolve_device("cuda")
    assert "--device cpu" in str(err.value) and "device='cpu'" not in str(err.value)


def test_gpu_memory_utilization_is_a_share_of_the_whole_gpu(monkeypatch):
    """vLLM's meaning: F of the GPU's whole memory for everything the server holds, so the KV cache gets
    F * total minus what is already in use (the weights). CUDA's memory query is replaced by fixed figures."""
    import torch

    from memra.errors import MemraError
    from memra.pools import KvBudget

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))  # 20 GiB in use
    cuda = torch.device("cuda")
    assert KvBudget(None, 0.9, of_total=True).bytes_on(cuda) == 52 * gib  # 72 GiB allowed - 20 in use
    assert KvBudget(None, 0.9).bytes_on(cuda) == int(0.9 * 60 * gib)  # memra's --kv-fraction: of the free memory
    with pytest.raises(MemraError, match="--gpu-memory-utilization 0.2 leaves the KV cache no room"):
        KvBudget(None, 0.2, of_total=True).bytes_on(cuda)
