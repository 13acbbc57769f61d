"""Model names from the Hugging Face Hub: `ORG/NAME` (a safetensors repository) or `ORG/NAME:FILE.gguf`
(one GGUF file of a repository), resolved to a local path through huggingface_hub — the local cache
first, with no network; then a download, with huggingface_hub's own progress bars, unless it is told
to stay offline (HF_HUB_OFFLINE, which it reads itself). A name that is neither cached nor reachable is
one line naming it. A path that exists on disk is always a path, never a hub name."""

from __future__ import annotations

import re
from pathlib import Path

from memra.errors import MemraError

# ORG/NAME with the Hub's characters, optionally :FILE.gguf (a file inside the repository, maybe in a folder)
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[\w./-]+\.gguf))?$")
# What a safetensors model directory needs: its config, weights and tokenizer, no other formats
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_hub_name(name: str) -> bool:
    return bool(_HUB_NAME.match(name)) and not Path(name).exists()


def resolve_hub_name(name: str, cache_dir: str | Path | None = None) -> Path:
    """A hub name -> the local directory (or GGUF file) it names, downloading only what is missing."""
    m = _HUB_NAME.match(name)
    if m is None:
        raise MemraError(f"{name!r} is not a Hugging Face model name (ORG/NAME or ORG/NAME:FILE.gguf)")
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    repo, file = m.group("repo"), m.group("file")

    def fetch(local_only: bool) -> Path:
        if file is not None:
            return Path(hf_hub_download(repo, file, cache_dir=cache_dir, local_files_only=local_only))
        return Path(snapshot_download(repo, allow_patterns=_MODEL_FILES, cache_dir=cache_dir,
                                      local_files_only=local_only))

    try:
        path = fetch(local_only=True)
        if file is not None or (path / "config.json").exists():
            return path
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub's exception types vary by version)
        pass
    if constants.HF_HUB_OFFLINE:
        raise MemraError(f"model {name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                         "download it first, or unset HF_HUB_OFFLINE")
    try:
        path = fetch(local_only=False)
    except Exception as e:  # noqa: BLE001 - a missing repo, a gated one, no network: one line, whichever
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MemraError(f"model {name!r} is neither a local path nor in the Hugging Face cache, and could not be "
                         f"downloaded ({type(e).__name__}: {why[:200]}); check the name, or set HF_TOKEN for a "
                         "gated model") from None
    if file is None and not (path / "config.json").exists():
        raise MemraError(f"Hugging Face repository {repo!r} has no config.json; for a GGUF repository name the "
                         f"file: {repo}:FILE.gguf")
    return path
