"""Build the tiny random-weight HF fixtures of the sliding-window architectures + their HF reference outputs.

  tests/fixtures/hf/mistral/   MistralForCausalLM, sliding window 16 on every layer, 2 layers
  tests/fixtures/hf/gemma4/    Gemma4ForCausalLM (text), 6 layers [S S F S S F] (window 16), global layers
                               with their own head size, one KV head and K as V, proportional RoPE; the last
                               two layers share KV (double-wide MLP), per-layer embeddings, logit soft-cap
  tests/fixtures/hf/step3p5/   Step3p7ForConditionalGeneration (a tiny vision tower beside the text model),
                               4 layers [F S S F] (window 16; sliding layers with 2 heads, full with 4),
                               per-type RoPE (partial on full layers), dense layer 0 then MoE (4 experts
                               top-2, sigmoid routing with a random correction bias, scaling 2.5, shared
                               expert), SwiGLU clamps on layers 2-3, a per-head attention gate

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
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.step3p7 import Step3p7Config, Step3p7ForConditionalGeneration

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
    for pname, b in model.named_buffers():
        if pname.endswith("layer_scalar"):  # Gemma 4: a learned scale per block, 1 at init
            b.copy_(1.0 + 0.2 * torch.randn_like(b))
        elif pname.endswith("e_score_correction_bias"):  # Step: the router's choice bias, 0 at init
            b.copy_(0.3 * torch.randn_like(b))


@torch.no_grad()
def build(name, config, seed, model_cls=AutoModelForCausalLM, prepare=randomize):
    out = HF / name
    torch.manual_seed(seed)
    config._attn_implementation = "eager"  # reference path: plain eager attention, not SDPA
    model = (model_cls.from_config(config, dtype=torch.float32) if model_cls is AutoModelForCausalLM
             else model_cls(config).float()).eval()
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


GEMMA4 = dict(vocab_size=1024, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
              sliding_window=WINDOW, final_logit_softcapping=30.0, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=1024, num_kv_shared_layers=2, use_double_wide_mlp=True,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}},
              eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True, dtype="float32")

STEP_TEXT = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_sliding_attention_heads=2, max_position_embeddings=512,
                 initializer_range=0.1, rms_norm_eps=1e-5, sliding_window=WINDOW, query_pre_attn_scalar=16,
                 layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, share_expert_dim=48, moe_router_scaling_factor=2.5,
                 swiglu_limits=[0, 0, 0.5, 0.5], swiglu_limits_shared=[0, 0, 0, 0.5], tie_word_embeddings=False,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000000.0,
                                                     "partial_rotary_factor": 0.5},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                 pad_token_id=0, eos_token_id=2, bos_token_id=1)
STEP_VISION = dict(width=16, layers=1, heads=2, image_size=28, patch_size=14)

ARCHS = {
    "step3p5": lambda: build("step3p5", Step3p7Config(
        text_config=STEP_TEXT, vision_config=STEP_VISION, tie_word_embeddings=False),
        seed=4, model_cls=Step3p7ForConditionalGeneration),
    "gemma4": lambda: build("gemma4", Gemma4TextConfig(**GEMMA4), seed=3, model_cls=Gemma4ForCausalLM),
    "mistral": lambda: build("mistral", MistralConfig(
        **TINY, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=2),
}


def main():
    for name in sys.argv[1:] or list(ARCHS):
        ARCHS[name]()


if __name__ == "__main__":
    main()
