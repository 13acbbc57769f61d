"""What the load-time NaN / Inf checks cost on a multi-GB model (memra.loading.tensor_checks).

    python tools/gpu_profile_load.py [--layers 8] [--device cuda] [--reps 2]

Writes a Llama-3-8B-shaped GGUF with random weights and `--layers` layers, every matrix Q8_0 as
llama.cpp's converter writes them (the default checks read each block's fp16 scale there), then loads
it once to warm up, then three ways, interleaved, `--reps` times each: with every check off (the checks replaced by no-ops:
the baseline), with the default checks (fp32 weights and Q8_0 scales), and with check_tensors=True
(every placed weight scanned). Prints the fastest load of each and the differences, then a table.
A profiler, not a check: that the checks find what they must is tests/test_corrupt_files.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memra  # noqa: E402
from memra.convert import GGUF_NAME, _encode, _metadata, gguf_tensors  # noqa: E402
from memra.loading import dequant, tensor_checks  # noqa: E402
from memra.random_model import SHAPES, random_weights  # noqa: E402


def write_gguf(path: Path, layers: int) -> int:
    import gguf

    cfg = SHAPES["llama-3-8b"](layers)
    weights = random_weights(cfg, device="cpu", dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), GGUF_NAME[cfg.arch])
    _metadata(writer, cfg, GGUF_NAME[cfg.arch], "random-llama-3-8b", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    for name, t in gguf_tensors(cfg, weights).items():
        data, raw = _encode(t, "q8_0", name)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def timed_load(path: Path, device: str, mode: str) -> float:
    """Seconds for memra.load with the checks `off` (replaced by no-ops), at their `default`, or `full`."""
    real_scale, real_nonfinite = dequant.first_bad_scale, tensor_checks.nonfinite
    if mode == "off":
        dequant.first_bad_scale = lambda raw, qtype: None
        tensor_checks.nonfinite = lambda tensors: []
    cuda = device.startswith("cuda")
    try:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model = memra.load(path, device=device, tokenizer=False, check_tensors=mode == "full")
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        dequant.first_bad_scale, tensor_checks.nonfinite = real_scale, real_nonfinite
    del model
    if cuda:
        torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-3-8b-q8_0.gguf"
        t0 = time.perf_counter()
        size = write_gguf(path, args.layers)
        print(f"wrote {size / 1e9:.2f} GB ({args.layers} layers, Q8_0) in {time.perf_counter() - t0:.0f} s", flush=True)
        timed_load(path, args.device, "default")  # warm-up: the page cache, the allocator, first-use costs
        best = {"off": [], "default": [], "full": []}
        for rep in range(args.reps):
            for mode in best:
                best[mode].append(timed_load(path, args.device, mode))
                print(f"rep {rep} {mode}: {best[mode][-1]:.2f} s", flush=True)
    off, default, full = (min(best[m]) for m in ("off", "default", "full"))
    print(f"\n| load of a {size / 1e9:.2f} GB Q8_0 GGUF on {args.device} | seconds (fastest of {args.reps}) | checks' cost |")
    print("|---|---|---|")
    print(f"| no checks (baseline) | {off:.2f} | - |")
    print(f"| default (fp32 weights + Q8_0 scales) | {default:.2f} | {default - off:+.2f} s ({(default - off) / off:+.1%}) |")
    print(f"| check_tensors=True (every weight) | {full:.2f} | {full - off:+.2f} s ({(full - off) / off:+.1%}) |")


if __name__ == "__main__":
    main()
