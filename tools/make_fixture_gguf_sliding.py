"""Make tests/fixtures/gguf/{gemma4,step3p5}-f32.gguf with llama.cpp's own converter.

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    python tools/make_fixture_gguf_sliding.py llama_cpp_python-0.3.36/vendor/llama.cpp SHAKESPEARE_DIR

What the converter needs that the hf/ fixtures do not have, and what this script gives it (in a copy):
- Gemma 4: it reads only a SentencePiece-style BPE tokenizer.json (byte fallback, spaces as "▁"), so the
  copy gets one trained here on the corpus: 4 specials, 256 byte tokens, 764 merges = 1024 ids, the
  fixture's vocabulary size. The weights and so the logits are the fixture's.
- Step-3.5: it reads the checkpoints' own config names (`num_attention_groups`, `moe_num_experts`,
  `partial_rotary_factors`, a `rope_theta` list ...), not transformers' ones, and transformers' config
  class drops them, so the copy gets a flat config under an unknown model_type; the vision tower is left out.
- Both: llama.cpp identifies a BPE pre-tokenizer by hashing its output; it does not know the fixture
  tokenizer's, which is Qwen2's regex, so the run names it 'qwen2'.
"""

from __future__ import annotations

import glob
import json
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def gemma_tokenizer(out: Path, corpus: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    files = sorted(glob.glob(str(corpus / "**" / "*.txt"), recursive=True))[:20]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok.train(files, trainers.BpeTrainer(vocab_size=768, special_tokens=specials, limit_alphabet=120,
                                         show_progress=False))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    spec = json.loads(tok.to_str())
    vocab = {t: i for i, t in enumerate(specials)} | {f"<0x{b:02X}>": 4 + b for b in range(256)}
    for text, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    assert len(vocab) == 1024, len(vocab)
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True}))


def step_checkpoint(out: Path) -> None:
    src = FIXTURES / "hf" / "step3p5"
    t = json.loads((src / "config.json").read_text())["text_config"]
    rope = t["rope_parameters"]
    flat = {**t, "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5_checkpoint",
            "num_attention_groups": t["num_key_value_heads"],
            "attention_other_setting": {"num_attention_heads": t["num_sliding_attention_heads"],
                                        "num_attention_groups": t["num_key_value_heads"]},
            "partial_rotary_factors": [1.0 if x == "sliding_attention" else 0.5 for x in t["layer_types"]],
            "rope_theta": [rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]],
            "moe_num_experts": t["n_routed_experts"], "moe_top_k": t["num_experts_per_tok"], "norm_expert_weight": True,
            "moe_layers_enum": ",".join(str(i) for i, x in enumerate(t["mlp_layer_types"]) if x == "sparse")}
    (out / "config.json").write_text(json.dumps(flat, indent=1))
    weights = load_file(src / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k.startswith(("model.", "lm_head."))}, out / "model.safetensors",
              metadata={"format": "pt"})
    for name in COPIED:
        shutil.copy(src / name, out / name)


def convert(llama_cpp: Path, model_dir: Path, outfile: Path) -> None:
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    import conversion.base as base  # llama.cpp's converter package

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", "f32", "--outfile", str(outfile)]
    runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


def main() -> None:
    llama_cpp, corpus = Path(sys.argv[1]), Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        gemma, step = Path(tmp) / "gemma4", Path(tmp) / "step3p5"
        gemma.mkdir(), step.mkdir()
        for name in ("config.json", "model.safetensors", "generation_config.json", "chat_template.jinja"):
            shutil.copy(FIXTURES / "hf" / "gemma4" / name, gemma / name)
        gemma_tokenizer(gemma, corpus)
        step_checkpoint(step)
        for d in (gemma, step):
            convert(llama_cpp, d, FIXTURES / "gguf" / f"{d.name}-f32.gguf")


if __name__ == "__main__":
    main()
