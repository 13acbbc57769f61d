"""Build two tiny random-weight HF fixtures + their HF reference outputs.

  tests/fixtures/hf/qwen2/       Qwen2ForCausalLM (q/k/v bias, no q/k norm), 3 layers
  tests/fixtures/hf/llama_tied/  LlamaForCausalLM, tied embeddings, llama3 rope scaling, 2 layers

Same layout as the other tests/fixtures/hf/<arch>/ dirs (see tests/fixtures/README.md):
config.json, generation_config.json, model.safetensors, the tokenizer files copied from hf/qwen3, and
reference.safetensors with prompt{i} (int64), logits{i} ([T, 1024] fp32 full forward, eager attention)
and greedy{i} (16 tokens from generate(do_sample=False) with its KV cache), for the three prompts of
hf/qwen3/reference.safetensors. Deterministic: fixed seeds, CPU, fp32.

Run from the repo root:  python tools/make_fixture_qwen2.py
"""

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

HF = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Shared tiny dimensions (as in the other fixtures; initializer_range 0.1 so logits are not ~flat).
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, eos_token_id=2, dtype="float32")


def load_prompts():
    with safe_open(HF / "qwen3" / "reference.safetensors", "pt") as f:
        return [f.get_tensor(f"prompt{i}") for i in range(3)]


@torch.no_grad()
def build(name, config, seed):
    out = HF / name
    torch.manual_seed(seed)
    config._attn_implementation = "eager"  # reference path: plain eager attention, not SDPA
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    # Randomize what random init leaves at constants, so `w` vs `1+w` or dropped-bias bugs show:
    # RMSNorm weights -> 1 + N(0, 0.1); q/k/v biases (Qwen2 only) -> N(0, 0.1).
    for pname, p in model.named_parameters():
        if pname.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif pname.endswith("_proj.bias"):
            p.copy_(0.1 * torch.randn_like(p))

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for fn in TOKENIZER_FILES:
        shutil.copyfile(HF / "qwen3" / fn, out / fn)

    ref = {}
    for i, ids in enumerate(load_prompts()):
        ref[f"prompt{i}"] = ids.clone()
        ref[f"logits{i}"] = model(ids[None]).logits[0].float().contiguous()
        gen = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                             max_new_tokens=16, use_cache=True, pad_token_id=2)
        ref[f"greedy{i}"] = gen[0, ids.numel():].clone()
        assert ref[f"greedy{i}"].numel() == 16, "hit EOS early; pick another seed"
    save_file(ref, out / "reference.safetensors")
    for fn in ("model.safetensors", "reference.safetensors"):
        (out / fn).chmod(0o644)  # the writers create 0600; match the other fixtures
    print(f"wrote {out}")


def main():
    build("qwen2", Qwen2Config(
        **TINY, num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False), seed=0)

    # head_dim 16, theta 5e5, original ctx 64: the 8 rope frequencies fall in all three llama3
    # regimes (wavelen < 16 kept, 16..64 smoothly interpolated, > 64 divided by factor 8).
    build("llama_tied", LlamaConfig(
        **TINY, num_hidden_layers=2, head_dim=16, bos_token_id=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}), seed=1)


if __name__ == "__main__":
    main()
