"""Train memra's bundled demo model: a small Qwen3.5-architecture hybrid on Shakespeare.

    python tools/train_demo.py --out memra/assets/demo            # on a GPU (the device tool), ~4 minutes
    python tools/train_demo.py --steps 20 --device cpu --out /tmp/d  # smoke run

The network is written here from scratch in plain torch (nn.Module names = Hugging Face's, so the
saved state dict *is* an HF Qwen3.5 checkpoint): gated full attention with q/k norm and partial RoPE,
Gated DeltaNet layers (the chunked delta rule from memra.kernels.reference, differentiable), SwiGLU
MLPs, zero-centred RMSNorms, and one MTP block trained to predict token t+2 from the trunk's final
hidden at t and the token at t+1. Every 10th play (sorted by file name) is held out for evaluation.
Seeded: data order and init depend only on --seed (GPU kernels may still differ in the last bits).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memra.kernels.reference import apply_rope, gdn_chunk, l2_normalize, rope_cos_sin  # noqa: E402

TOKENIZER_DIR = ROOT / "tests" / "fixtures" / "tokenizer"

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 640,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": None,
    "eos_token_id": 2,
    "pad_token_id": None,
    "dtype": "bfloat16",
    "use_cache": True,
    "initializer_range": 0.02,
}

# --- the network (names follow HF's Qwen3.5 so the state dict is a checkpoint) -----------------------


class ZcNorm(nn.Module):
    """Zero-centred RMSNorm: x_hat * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).to(x.dtype)


class GatedNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, o, z):
        of = o.float()
        y = self.weight * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps))
        return (y * F.silu(z.float())).to(z.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        e, h, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(e, 2 * h * d, bias=False)  # per head: d query rows, then d gate rows
        self.k_proj = nn.Linear(e, kv * d, bias=False)
        self.v_proj = nn.Linear(e, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, e, bias=False)
        self.q_norm, self.k_norm = ZcNorm(d, c["rms_norm_eps"]), ZcNorm(d, c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.h, 2 * self.d).chunk(2, dim=-1)
        k = self.k_proj(x).view(b, t, self.kv, self.d)
        v = self.v_proj(x).view(b, t, self.kv, self.d)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b, t, self.h * self.d) * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    def __init__(self, c):
        super().__init__()
        e = c["hidden_size"]
        self.nk, self.nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.kc = c["linear_conv_kernel_dim"]
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = nn.Linear(e, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(e, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(e, self.nv, bias=False)
        self.in_proj_a = nn.Linear(e, self.nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kc, groups=conv_dim, bias=False, padding=self.kc - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nv).uniform_(1, 16)))
        self.norm = GatedNorm(self.dv, c["rms_norm_eps"])
        self.out_proj = nn.Linear(self.nv * self.dv, e, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        mixed = F.silu(self.conv1d(self.in_proj_qkv(x).transpose(1, 2))[..., :t]).transpose(1, 2)
        kd = self.nk * self.dk
        q, k, v = mixed.split([kd, kd, self.nv * self.dv], dim=-1)
        r = self.nv // self.nk
        with torch.autocast(device_type=x.device.type, enabled=False):  # the delta rule runs in fp32
            q = (l2_normalize(q.float().view(b, t, self.nk, self.dk)) * self.dk ** -0.5).repeat_interleave(r, 2)
            k = l2_normalize(k.float().view(b, t, self.nk, self.dk)).repeat_interleave(r, 2)
            v = v.float().view(b, t, self.nv, self.dv)
            beta = torch.sigmoid(self.in_proj_b(x).float())
            g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
            # fold the batch into the head axis: [T, B*Hv, D] is what the reference op takes
            fold = lambda u: u.transpose(0, 1).reshape(t, b * self.nv, *u.shape[3:])
            q, k, v, beta, g = fold(q), fold(k), fold(v), fold(beta), fold(g)
            state = q.new_zeros(b * self.nv, self.dk, self.dv)
            outs = []
            for s in range(0, t, 64):
                o, state = gdn_chunk(q[s:s + 64], k[s:s + 64], v[s:s + 64], beta[s:s + 64], g[s:s + 64], state)
                outs.append(o)
            o = torch.cat(outs).view(t, b, self.nv, self.dv).transpose(0, 1)
        z = self.in_proj_z(x).view(b, t, self.nv, self.dv)
        return self.out_proj(self.norm(o.to(z.dtype), z).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        e, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(e, f, bias=False), nn.Linear(e, f, bias=False)
        self.down_proj = nn.Linear(f, e, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm = ZcNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = ZcNorm(c["hidden_size"], c["rms_norm_eps"])
        if kind == "full_attention":
            self.self_attn = Attention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.mlp = Mlp(c)

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cos, sin) if self.kind == "full_attention" else self.linear_attn(h))
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c, kind) for kind in c["layer_types"])
        self.norm = ZcNorm(c["hidden_size"], c["rms_norm_eps"])


class Mtp(nn.Module):
    def __init__(self, c):
        super().__init__()
        e = c["hidden_size"]
        self.fc = nn.Linear(2 * e, e, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = ZcNorm(e, c["rms_norm_eps"]), ZcNorm(e, c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c, "full_attention")])
        self.norm = ZcNorm(e, c["rms_norm_eps"])


class DemoModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model, self.mtp = Trunk(c), Mtp(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        rope = c["rope_parameters"]
        dim = int(c["head_dim"] * rope["partial_rotary_factor"])
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids):
        """ids [B, T] -> (main logits [B, T, V] for t+1, MTP logits [B, T-1, V] for t+2)."""
        t = ids.shape[1]
        cos, sin = rope_cos_sin(torch.arange(t, device=ids.device), self.inv_freq, torch.float32)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        h = self.model.norm(x)
        e = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(ids[:, 1:]))
        u = self.mtp.fc(torch.cat((e, self.mtp.pre_fc_norm_hidden(h[:, :-1])), dim=-1))
        u = self.mtp.layers[0](u, cos[: t - 1], sin[: t - 1])
        return self.lm_head(h), self.lm_head(self.mtp.norm(u))


def init_weights(model: nn.Module, std: float) -> None:
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.Conv1d):
            nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.kernel_size[0]))


# --- data --------------------------------------------------------------------------------------------


def load_corpus(path: Path) -> tuple[list[str], list[str], list[str]]:
    """-> (train texts, held-out texts, held-out file names): every 10th play by sorted name is held out."""
    with tarfile.open(path) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")), key=lambda m: m.name)
        texts = [(m.name, tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n")) for m in members]
    held = [i % 10 == 3 for i in range(len(texts))]
    return ([t for (n, t), h in zip(texts, held) if not h], [t for (n, t), h in zip(texts, held) if h],
            [n for (n, t), h in zip(texts, held) if h])


def encode_all(texts: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [eot]
    return np.asarray(ids, dtype=np.int16)


# --- training ------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, batch: int, device) -> tuple[float, float]:
    """Held-out (next-token ppl, MTP t+2 loss) over non-overlapping windows of `seq` tokens."""
    model.eval()
    n = (len(data) - 1) // seq
    total, count, mtp_total, mtp_count = 0.0, 0, 0.0, 0
    for s in range(0, n, batch):
        rows = torch.stack([data[i * seq:(i + 1) * seq + 1] for i in range(s, min(n, s + batch))]).to(device).long()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, mtp_logits = model(rows[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
        mtp_total += F.cross_entropy(mtp_logits.float().flatten(0, 1), rows[:, 2:].flatten(), reduction="sum").item()
        mtp_count += rows[:, 2:].numel()
    model.train()
    return math.exp(total / count), mtp_total / mtp_count


def save_hf_dir(model: DemoModel, out: Path, extra: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": CONFIG["eos_token_id"], "do_sample": False}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER_DIR / name, out / name)
    (out / "training.json").write_text(json.dumps(extra, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus" / "shakespeare.tar.xz"))
    ap.add_argument("--out", default=str(ROOT / "memra" / "assets" / "demo"))
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heldout-out", default=None, help="also write the held-out text here")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_texts, held_texts, held_names = load_corpus(Path(args.corpus))
    train = torch.from_numpy(encode_all(train_texts).astype(np.int64))
    held = torch.from_numpy(encode_all(held_texts).astype(np.int64))
    if args.heldout_out:
        Path(args.heldout_out).write_text("\n".join(held_texts))
    print(f"train tokens {len(train):,}  held-out tokens {len(held):,} ({len(held) / (len(train) + len(held)):.1%}) "
          f"from {len(held_names)} plays", flush=True)

    model = DemoModel(CONFIG)
    init_weights(model, CONFIG["initializer_range"])
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params:,} ({2 * n_params / 1e6:.1f} MB in bf16)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed)
    curve = []
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq - 2, (args.batch,), generator=gen)
        rows = torch.stack([train[s:s + args.seq + 2] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, mtp_logits = model(rows[:, :-2])
        loss_main = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:-1].flatten())
        loss_mtp = F.cross_entropy(mtp_logits.float().flatten(0, 1), rows[:, 2:-1].flatten())
        loss = loss_main + args.mtp_weight * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            curve.append({"step": step, "loss": round(loss_main.item(), 4), "mtp_loss": round(loss_mtp.item(), 4),
                          "seconds": round(time.time() - t0, 1)})
            print(json.dumps(curve[-1]), flush=True)
    train_seconds = time.time() - t0
    ppl, mtp_loss = evaluate(model, held, args.seq, 32, device)
    print(f"trained {args.steps} steps in {train_seconds:.0f}s; held-out ppl {ppl:.3f} (seq {args.seq}), "
          f"held-out MTP loss {mtp_loss:.3f}", flush=True)
    save_hf_dir(model, Path(args.out), {
        "command": " ".join(sys.argv), "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "train_seconds": round(train_seconds, 1), "parameters": n_params, "heldout_plays": held_names,
        "heldout_ppl_seq256": round(ppl, 4), "heldout_mtp_loss": round(mtp_loss, 4), "loss_curve": curve,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    })


if __name__ == "__main__":
    main()
