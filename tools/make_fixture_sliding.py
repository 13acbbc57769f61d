"""Build the tiny random-weight HF fixtures of the sliding-window architectures + their HF reference outputs.

  tests/fixtures/hf/mistral/   MistralForCausalLM, sliding window 16 on every layer, 2 layers
  (more architectures are added to ARCHS below)

Same layout and method as tools/make_fixture_qwen2.py (see tests/fixtures/README.md): config.json,
model.safetensors, the tokenizer files copied from hf/qwen3, and reference.safetensors with prompt{i},
logits{i} ([T, 1024] fp32 full forward, eager attention) and greedy{i} (16 tokens from
generate(do_sample=False) with its KV cache), for the three prompts of hf/qwen3/reference.safetensors
(25, 7 and 62 tokens: prompts 0 and 2 cross a 16-position window). Deterministic: fixed seeds, CPU, fp32.

Run from the repo root:  python tools/make_fixture_sliding.py [name ...]
"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MistralConfig

HF = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, eos_token_id=2, dtype="float32")
WINDOW = 16


def load_prompts():
    with safe_open(HF / "qwen3" / "reference.safetensors", "pt") as f:
        return [f.get_tensor(f"prompt{i}") for i in range(3)]


def randomize(model) -> None:
    """What random init leaves at constants gets random values, so `w` vs `1+w` or a dropped weight shows."""
    for pname, p in model.named_parameters():
        if pname.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif pname.endswith("_proj.bias"):
            p.copy_(0.1 * torch.randn_like(p))


@torch.no_grad()
def build(name, config, seed, model_cls=AutoModelForCausalLM, prepare=randomize):
    out = HF / name
    torch.manual_seed(seed)
    config._attn_implementation = "eager"  # reference path: plain eager attention, not SDPA
    model = model_cls.from_config(config, dtype=torch.float32).eval()
    prepare(model)
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
        (out / fn).chmod(0o644)
    print(f"wrote {out}")


ARCHS = {
    "mistral": lambda: build("mistral", MistralConfig(
        **TINY, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=2),
}


def main():
    for name in sys.argv[1:] or list(ARCHS):
        ARCHS[name]()


if __name__ == "__main__":
    main()
