"""Hugging Face names (memra.loading.hub): ORG/NAME and ORG/NAME:FILE.gguf resolve through a cache laid
out on disk here, as huggingface_hub lays it out, with no network; a local path of the same shape wins;
and a name that is not cached, offline, is one line naming it — through the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gguf_file, hf_dir
from memra.errors import MemraError
from memra.loading.hub import looks_like_hub_name, resolve_hub_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """What huggingface_hub leaves after a download: refs/main names a snapshot holding the files."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snap / name)
    return snap


@pytest.fixture()
def cache(tmp_path):
    c = tmp_path / "hub"
    lay_out_cache(c, "tiny-org/tiny-llama", {p.name: p for p in hf_dir("llama").iterdir() if p.is_file()})
    lay_out_cache(c, "tiny-org/tiny-gguf", {"model-q8_0.gguf": gguf_file("llama-q8_0")})
    return c


def test_names_resolve_from_the_cache(cache):
    d = resolve_hub_name("tiny-org/tiny-llama", cache_dir=cache)
    assert (d / "config.json").exists() and d.name == COMMIT
    f = resolve_hub_name("tiny-org/tiny-gguf:model-q8_0.gguf", cache_dir=cache)
    assert f.name == "model-q8_0.gguf" and f.read_bytes()[:4] == b"GGUF"
    with pytest.raises(MemraError, match="not a Hugging Face model name"):
        resolve_hub_name("not a name", cache_dir=cache)


def test_a_local_path_is_never_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_name("org/model")
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not looks_like_hub_name("org/model")
    assert not looks_like_hub_name("./org/model") and not looks_like_hub_name("/abs/path/x")


def _cli(args, cache: Path):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "memra", *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False, cwd=Path(__file__).resolve().parents[1])


def test_the_cli_runs_a_cached_name_and_refuses_an_uncached_one_offline(cache):
    run = _cli(["generate", "tiny-org/tiny-llama", "hello", "--max-tokens", "3"], cache)
    assert run.returncode == 0, run.stderr[-2000:]
    run = _cli(["inspect", "tiny-org/not-here"], cache)
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "'tiny-org/not-here'" in err[0] and "HF_HUB_OFFLINE" in err[0]
