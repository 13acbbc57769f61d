"""llm.update_weights and POST /v1/update_weights (memra.weights, memra.engine.weight_swap): after an update every
output equals a fresh load of the new weights, bit for bit; a bad update is refused whole with nothing changed;
a server under load loses and fails no request through an update, and no answer mixes two versions."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

import memra
from memra import counters
from memra.engine.engine import Engine, EngineConfig
from memra.errors import MemraError
from memra.sampling import SamplingParams
from memra.server.api import build_app
from memra.server.http import ServerThread
from memra.server.metrics import Metrics
from memra.server.options import ServerOptions

from conftest import hf_dir

KEY = "sk-update-test"
PROMPTS = [[1, 5, 9, 200, 17], list(range(30, 100)), [7] * 3, list(range(300, 340))]


def params(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed, logprobs=0, n=1,
                          ignore_eos=True)


def perturbed(arch: str, scale: float = 0.02, keep=lambda name: True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = load_file(str(hf_dir(arch) / "model.safetensors"))
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items() if keep(k)}


def checkpoint_dir(arch: str, tmp_path, tensors: dict[str, torch.Tensor], name: str = "new"):
    """A copy of the fixture whose model.safetensors holds `tensors` over the original ones."""
    d = tmp_path / f"{arch}-{name}"
    d.mkdir()
    for f in hf_dir(arch).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d)
    save_file({**load_file(str(hf_dir(arch) / "model.safetensors")), **tensors}, str(d / "model.safetensors"))
    return d


def answers(llm, prompts=PROMPTS):
    outs = llm.generate(prompts, [params(11 + i) for i in range(len(prompts))], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_an_updated_model_equals_a_fresh_load_bit_for_bit(arch, tmp_path):
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    before = answers(llm)
    new = perturbed(arch)
    assert llm.update_weights(new) == 1
    fresh = memra.LLM(str(checkpoint_dir(arch, tmp_path, new)), warm_up=False, seed=1)
    for k, t in fresh.model._weights.items():
        assert torch.equal(t, llm.model._weights[k]), k
    got = answers(llm)
    assert got == answers(fresh) and got != before
    assert llm.generate(PROMPTS[:1], params(3), use_tqdm=False)[0].weights_version == 1


def test_partial_updates_of_a_fused_weight_keep_the_earlier_ones(tmp_path):
    """q_proj, then k_proj of one layer (one fused wqkv): the second update rebuilds wqkv from the first's q."""
    arch = "llama"
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    q = perturbed(arch, keep=lambda n: n.endswith("layers.0.self_attn.q_proj.weight"))
    k = perturbed(arch, 0.05, keep=lambda n: n.endswith("layers.0.self_attn.k_proj.weight"))
    llm.update_weights(list(q.items()))  # (name, tensor) pairs
    assert llm.update_weights(k) == 2
    fresh = memra.LLM(str(checkpoint_dir(arch, tmp_path, {**q, **k})), warm_up=False, seed=1)
    for key, t in fresh.model._weights.items():
        assert torch.equal(t, llm.model._weights[key]), key
    assert answers(llm) == answers(fresh)


def test_a_bad_update_is_refused_whole_and_nothing_changes(tmp_path):
    arch = "qwen3_5"
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1)
    held = {k: t.clone() for k, t in llm.model._weights.items()}
    good = perturbed(arch)
    name = "model.layers.0.mlp.down_proj.weight"
    norm = "model.layers.1.input_layernorm.weight"
    cases = {
        "unknown weight 'model.layers.0.nope.weight'": {**good, "model.layers.0.nope.weight": torch.zeros(3)},
        "has shape [3, 4]": {**good, name: torch.zeros(3, 4)},
        "is torch.int64": {**good, name: good[name].long()},
        "holds NaN or Inf": {**good, norm: torch.full_like(good[norm], float("nan"))},
        "no tensors": {},
    }
    for msg, update in cases.items():
        with pytest.raises(MemraError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            llm.update_weights(update)
    with pytest.raises(MemraError, match="not a safetensors file"):
        llm.update_weights(tmp_path / "missing")
    for k, t in held.items():
        assert torch.equal(t, llm.model._weights[k]), k
    assert getattr(llm.model, "weights_version", 0) == 0


def test_the_prefix_cache_is_dropped_by_an_update(tmp_path):
    """A prompt of 70 tokens leaves a cached 64-token page; after an update the answer must be the fresh model's,
    which a page primed by the old weights would change."""
    arch = "qwen3_5"
    llm = memra.LLM(str(hf_dir(arch)), warm_up=False, seed=1, enable_prefix_caching=True)
    answers(llm, PROMPTS[1:2])
    new = perturbed(arch)
    before = counters.snapshot()["prefix_evicted_blocks"]
    llm.update_weights(checkpoint_dir(arch, tmp_path, new))  # from a path (directory)
    assert counters.snapshot()["prefix_evicted_blocks"] > before
    fresh = memra.LLM(str(checkpoint_dir(arch, tmp_path, new, "fresh")), warm_up=False, seed=1)
    assert answers(llm, PROMPTS[1:2]) == answers(fresh, PROMPTS[1:2])


# --- the server ---

def _post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def _complete(url: str, i: int, max_tokens: int) -> dict:
    r = _post(url, "/v1/completions", {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                       "temperature": 1.0, "top_p": 1.0, "seed": 11 + i, "logprobs": 0,
                                       "ignore_eos": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"text": c["text"], "lp": c["logprobs"]["token_logprobs"], "finish": c["finish_reason"],
            "fingerprint": r.json()["system_fingerprint"]}


def _reference(model_dir, n: int, max_tokens: int) -> list[dict]:
    llm = memra.LLM(str(model_dir), warm_up=False, seed=1)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    outs = llm.generate(prompts, [params(11 + i, max_tokens) for i in range(n)], use_tqdm=False)
    return [{"text": o.outputs[0].text, "lp": o.outputs[0].token_logprobs} for o in outs]


@pytest.mark.parametrize("abort", [False, True])
def test_a_server_under_load_updates_without_losing_or_mixing(abort, tmp_path):
    arch, n, max_tokens = "qwen3_5", 12, 40
    new_dir = checkpoint_dir(arch, tmp_path, perturbed(arch))
    old_ref, new_ref = _reference(hf_dir(arch), n, max_tokens), _reference(new_dir, n, max_tokens)
    model = memra.load(str(hf_dir(arch)))
    metrics = Metrics("m")
    engine = Engine(model, EngineConfig(max_batch=3, max_ctx=256), metrics)
    srv = ServerThread(build_app(engine, "m", ServerOptions(api_key=KEY), metrics=metrics)).start()
    try:
        assert _post(srv.url, "/v1/update_weights", {"path": str(new_dir)}, key=None).status_code == 401
        assert _post(srv.url, "/v1/update_weights", {"path": str(new_dir), "nope": 1}).status_code == 400
        missing = _post(srv.url, "/v1/update_weights", {"path": str(tmp_path / "missing")})
        assert missing.status_code == 400 and "not a safetensors file" in missing.json()["error"]["message"]
        with cf.ThreadPoolExecutor(n + 1) as pool:
            first = [pool.submit(_complete, srv.url, i, max_tokens) for i in range(n // 2)]
            while engine.scheduler.num_running() == 0:  # requests in flight when the update comes
                time.sleep(0.005)
            upd = pool.submit(_post, srv.url, "/v1/update_weights", {"path": str(new_dir), "abort": abort})
            while not engine.weight_swaps.pending and not upd.done():
                time.sleep(0.002)
            later = [pool.submit(_complete, srv.url, i, max_tokens) for i in range(n // 2, n)]
            got = [f.result() for f in first + later]
            assert upd.result().json() == {"weights_version": 1}
        kinds = []
        for i, g in enumerate(got):
            version = g.pop("fingerprint")
            if g["finish"] == "abort":  # ended at the update: a prefix of its old answer
                assert abort and g["lp"] == old_ref[i]["lp"][: len(g["lp"])] and old_ref[i]["text"].startswith(g["text"])
                kinds.append("aborted")
                assert version == "memra-weights-0"
            else:
                assert g["finish"] == "length"
                kinds.append("old" if g == {**old_ref[i], "finish": "length"} else
                             "new" if g == {**new_ref[i], "finish": "length"} else f"MIXED {i}")
                assert version == {"old": "memra-weights-0", "new": "memra-weights-1"}.get(kinds[-1]), (kinds, version)
        assert not [k for k in kinds if k.startswith("MIXED")], kinds
        assert all(k == "new" for k in kinds[n // 2:]), kinds  # sent after the update was posted: new weights
        assert ("aborted" if abort else "old") in kinds[: n // 2], kinds
        models = httpx.get(srv.url + "/v1/models").json()["data"][0]
        assert models["weights_version"] == 1
        assert "memra:weights_version 1.0" in httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    finally:
        srv.stop()
