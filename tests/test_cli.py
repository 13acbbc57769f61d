"""The command line, run as a user runs it (a real subprocess), and the generation loop under it."""

import subprocess
import sys

import pytest

from conftest import gguf_file, hf_dir, reference
from memra.generate import GenerationStats, generate_tokens
from memra.sampling import SamplingParams


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "memra", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_text_and_reports_speed():
    r = run("generate", str(hf_dir("qwen3_5")), "ROMEO:", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) > len("ROMEO:\n")
    assert "tok/s" in r.stderr and "12 generated" in r.stderr


def test_generate_chat_with_sampling_is_reproducible():
    args = ("generate", str(gguf_file("qwen3_5-q8_0")), "Hello", "--chat", "--max-tokens", "8",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "7")
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


def test_inspect_describes_the_checkpoint():
    r = run("inspect", str(gguf_file("qwen3_next-f32")))
    assert r.returncode == 0, r.stderr
    for needle in ("qwen3_next", "GGAGGA", "MTP", "experts", "tensors        127", "tokenizer"):
        assert needle in r.stdout


@pytest.mark.parametrize("args, message", [
    (("generate", "no/such/model", "hi"), "no such model"),
    (("generate", str(hf_dir("llama")), "hi", "--temperature", "-1"), "temperature"),
    (("generate", str(hf_dir("llama")), "hi", "--max-tokens", "0"), "max_tokens"),
    (("generate", str(hf_dir("llama")), "hi", "--dtype", "int4"), "unknown dtype"),
    (("generate", str(hf_dir("llama")), "hi " * 600, "--max-tokens", "4"), "context"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_greedy_generation_equals_reference(arch, load_model):
    ref = reference(arch)
    stats = GenerationStats()
    out = list(generate_tokens(load_model(hf_dir(arch)), ref["prompt0"].tolist(), SamplingParams(temperature=0.0, max_tokens=16), stats))
    assert out == ref["greedy0"].tolist()
    assert stats.finish_reason == "length" and stats.generated_tokens == 16


def test_generation_stops_at_eos(load_model):
    ref = reference("qwen3")
    first = ref["greedy0"][3].item()  # pretend the 4th greedy token ends the sequence
    out = list(generate_tokens(load_model(hf_dir("qwen3")), ref["prompt0"].tolist(), SamplingParams(temperature=0.0, max_tokens=16), eos_ids=[first]))
    assert out == ref["greedy0"][:4].tolist()


def test_stop_strings_end_generation_without_printing_the_stop():
    from memra.tokenizer import StopStringFilter

    f = StopStringFilter(("SCENE I.",))
    pieces = ["ACT I.\n\nSC", "ENE", " I", ". A Room"]
    out = "".join(f.push(p) for p in pieces)
    assert out == "ACT I.\n\n" and f.stopped
    g = StopStringFilter(("xyz",))
    assert g.push("abx") == "ab" and g.push("q") == "xq" and g.flush() == ""
    r = run("generate", "ROMEO:", "--max-tokens", "60", "--stop", "ACT")
    assert r.returncode == 0 and "ACT" not in r.stdout and "finish: stop" in r.stderr


def test_chat_repl_reads_turns_until_exit():
    r = subprocess.run([sys.executable, "-m", "memra", "chat", "--max-tokens", "8"], input="Good morrow.\n/reset\nWhat news?\n/exit\nignored\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[conversation cleared]" in r.stderr
    assert len(r.stdout.strip().splitlines()) >= 2  # two replies


def test_version_and_the_usage_line():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("memra ")
    r = run("generate", "--help")
    assert "usage: memra generate [options] [MODEL] PROMPT" in r.stdout


def test_a_model_without_a_prompt_is_an_error_and_a_prompt_can_come_from_a_file_or_stdin(tmp_path):
    r = subprocess.run([sys.executable, "-m", "memra", "generate", str(hf_dir("llama")), "--max-tokens", "3"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "names a model, and no prompt came with it" in r.stderr
    prompt = tmp_path / "p.txt"
    prompt.write_text("ROMEO:", encoding="utf-8")
    from_file = run("generate", str(hf_dir("llama")), "-f", str(prompt), "--max-tokens", "4")
    from_stdin = subprocess.run([sys.executable, "-m", "memra", "generate", str(hf_dir("llama")), "--max-tokens", "4"],
                                input="ROMEO:\n", capture_output=True, text=True, timeout=120)
    said = run("generate", str(hf_dir("llama")), "ROMEO:", "--max-tokens", "4")
    assert from_file.returncode == from_stdin.returncode == said.returncode == 0, from_file.stderr + from_stdin.stderr
    assert from_file.stdout == from_stdin.stdout == said.stdout and said.stdout.startswith("ROMEO:")


def test_sampling_without_a_seed_prints_the_seed_it_drew_and_that_seed_repeats_the_run():
    args = ("generate", str(hf_dir("llama")), "Hello", "--max-tokens", "8", "--temperature", "1.0")
    first = run(*args)
    assert first.returncode == 0, first.stderr
    seed = int(first.stderr.rsplit("seed ", 1)[1].split("]")[0])
    again = run(*args, "--seed", str(seed))
    assert again.stdout == first.stdout and f"seed {seed}]" in again.stderr


def test_chat_messages_may_span_lines():
    import io

    from memra.chat_repl import read_message

    stream = io.StringIO('one\ntwo \\\nthree\n"""\nfour\n\nfive\n"""\nsix \\\n')
    got = [read_message(stream, None) for _ in range(5)]
    assert got == ["one", "two \nthree", "four\n\nfive", "six ", None]


def test_chat_takes_generates_sampling_flags_and_replays_from_its_seed():
    args = [sys.executable, "-m", "memra", "chat", "--max-tokens", "6", "--temperature", "0.9", "--top-k", "20",
            "--min-p", "0.01", "--repetition-penalty", "1.1", "--stop", "zzz"]
    talk = 'Good morrow,\\\nsweet lady.\n"""\nWhat news\nfrom Verona?\n"""\n'
    first = subprocess.run(args, input=talk, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    seed = int(first.stderr.split("; seed ", 1)[1].split(" ")[0])  # the banner's
    again = subprocess.run(args + ["--seed", str(seed)], input=talk, capture_output=True, text=True, timeout=120)
    assert again.stdout == first.stdout and len(first.stdout.strip().splitlines()) >= 1
    assert first.stderr.count("prompt tokens") == 2  # two messages, each over two lines
    bad = subprocess.run(args + ["--top-p", "0"], input="hi\n", capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "top_p" in bad.stderr


def test_every_flag_of_every_command_says_what_it_does():
    import argparse

    from memra.cli import build_parser

    silent = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "memra")
    assert not silent, silent


def test_chat_prints_a_banner_and_answers_help_itself():
    out = subprocess.run([sys.executable, "-m", "memra", "chat", "--max-tokens", "2"], input="/help\n/nope\n/exit\n",
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "memra chat: demo (" in out.stderr and "Type /help for the commands." in out.stderr
    assert "commands: /help shows this, /reset" in out.stderr and "[unknown command /nope; /help lists them]" in out.stderr
    assert "prompt tokens" not in out.stderr  # nothing reached the model
