"""Print memra's agreement with the fixture references on one device, as a table.

usage: python tools/parity_report.py [cpu|cuda] [float32|bfloat16]
Rows: every fixture checkpoint (HF dirs and GGUF files); columns: max relative logit error against
HF transformers' fp32 reference over the three prompts, greedy-token agreement, and decode speed.
"""

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402

FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    rows = [(p.name, p) for p in sorted((FIX / "hf").iterdir())]
    rows += [(p.stem, p) for p in sorted((FIX / "gguf").glob("*.gguf"))]
    print(f"device {device} ({torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}), dtype {dtype}, torch {torch.__version__}")
    print(f"{'checkpoint':<22}{'max rel err':>12}{'greedy':>8}{'decode tok/s':>14}")
    for name, path in rows:
        arch = name.rsplit("-", 1)[0] if path.suffix == ".gguf" else name
        ref = load_file(str(FIX / "hf" / arch / "reference.safetensors"))
        m = memra.load(path, device=device, dtype=dtype, tokenizer=False)
        worst, agree = 0.0, 0
        for i in range(3):
            c = m.new_cache(128)
            worst = max(worst, rel(m.prime(ref[f"prompt{i}"], c, all_logits=True), ref[f"logits{i}"]))
            c = m.new_cache(128)
            nxt, toks = int(m.prime(ref[f"prompt{i}"], c).argmax()), []
            t0 = time.perf_counter()
            for _ in range(16):
                toks.append(nxt)
                nxt = int(m.decode_step(nxt, c).argmax())
            dt = time.perf_counter() - t0
            agree += toks == ref[f"greedy{i}"].tolist()
        print(f"{name:<22}{worst:>12.2e}{agree:>6}/3{16 / dt:>14.1f}")


if __name__ == "__main__":
    main()
