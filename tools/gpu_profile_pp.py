"""What the pipeline split costs and buys, in decode tokens/s and ms per token (run through the device tool;
`--sections dual` and the NCCL form of `dist` need nvidia-h200-x2 or larger):

    python tools/gpu_profile_pp.py [--sections split,dual,dist] [--model qwen3.5-9b] [--layers N] [--steps 16]

split  one GPU, a CUDA stream per stage: decode tok/s at B = 1 and 16, unsplit vs PP-2 split (serial,
       as Auto runs it on one device), and the dual-wave body forced on (MEMRA_DUAL_PP=1 +
       MEMRA_PP_OVERLAP=1) for the record.
dual   >= 2 GPUs, PP-2 on cuda:0,1 with sharded weights: decode tok/s at B = 1, 8, 16, 32, the serial
       walker (MEMRA_DUAL_PP=0) vs dual-active waves, with the waves' overlap count; and the cost the
       unsplit-walk refusal prevents: B=1 split vs the unsplit walk over sharded weights (MEMRA_BATCH_PP=0
       + MEMRA_PP_ALLOW_UNSPLIT_BATCH=1: every remote weight read over the peer path).
dist   B=1 greedy per-token latency: one process (CUDA graphs on, and eager) vs the 2-rank pipeline
       across processes (memra.pp.dist): NCCL with rank r on cuda:r when there are >= 2 GPUs, else both
       ranks on cuda:0 over gloo (NCCL refuses a shared GPU). The difference is the process boundary.
The model is a random-weight model of a named shape (memra.random_model.SHAPES), bf16; `--layers` cuts
it (default: every layer; 8 for dist). NVLink multicast stays off here and in every rank started.

A profiler, not a check: the pipeline's exactness, refusals, probes and placement are tests/test_pp.py,
tests/test_pp_dist.py and, on GPUs, tests/test_cuda_pp.py, tests/test_cuda_pp_dist.py and
tests/test_cuda_multi.py (MEMRA_TEST_DEVICE=cuda pytest -m cuda).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memra import counters  # noqa: E402
from memra.pp.walk import active_runtime  # noqa: E402
from memra.random_model import random_model  # noqa: E402

SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PLEN = 16


@contextlib.contextmanager
def process_doors(**values: str | None):
    """Environment for what this process launches (dist workers read their doors when they start)."""
    saved = {k: os.environ.get(k) for k in values}
    def put(items) -> None:
        for k, v in items:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        put(values.items())
        yield
    finally:
        put(saved.items())


def sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def release() -> None:
    """Give back the memory of the models a section has dropped."""
    gc.collect()
    torch.cuda.empty_cache()


@torch.inference_mode()
def decode_rate(model, batch: int, steps: int) -> tuple[float, dict[str, int]]:
    """Decode tok/s of `batch` rows (prime, one warm-up step, then `steps` timed steps, each read back as a
    serving loop does) -> (tok/s, counter deltas of the timed steps)."""
    rt = active_runtime(model)
    new = rt.new_cache if rt is not None else model.new_cache
    caches = [new(PLEN + steps + 8) for _ in range(batch)]
    try:
        for i, c in enumerate(caches):
            model.prime([(7 + 31 * i + j) % model.cfg.vocab_size for j in range(PLEN)], c)
        toks = model.decode_step_batch([1] * batch, caches).argmax(-1).tolist()
        sync_all()
        before, t0 = counters.snapshot(), time.perf_counter()
        for _ in range(steps):
            toks = model.decode_step_batch(toks, caches).argmax(-1).tolist()
        sync_all()
        return batch * steps / (time.perf_counter() - t0), counters.delta(before)
    finally:
        for c in caches:
            c.free()


@torch.inference_mode()
def per_token_ms(m, steps: int, warm: int = 8) -> float:
    """B=1 greedy decode through m (a model or a DistPipeline): ms per token over `steps` timed steps."""
    prompt = [(7 + 31 * j) % m.cfg.vocab_size for j in range(PLEN)]
    c = m.new_cache(PLEN + warm + steps + 2)
    try:
        tok = int(m.prime(prompt, c).argmax())
        for _ in range(warm):
            tok = int(m.decode_step(tok, c).argmax())
        sync_all()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = int(m.decode_step(tok, c).argmax())
        sync_all()
        return 1000 * (time.perf_counter() - t0) / steps
    finally:
        c.free()


def section_split(args, table) -> None:
    model = random_model(args.model, "cuda:0", torch.bfloat16, n_layers=args.layers)
    split = model.with_doors(MEMRA_PP_STAGES="2")
    dual = model.with_doors(MEMRA_PP_STAGES="2", MEMRA_DUAL_PP="1", MEMRA_PP_OVERLAP="1")
    for b in (1, 16):
        unsplit_rate, _ = decode_rate(model, b, args.steps)
        split_rate, _ = decode_rate(split, b, args.steps)
        waves = f"  dual forced {decode_rate(dual, b, args.steps)[0]:.1f}" if b > 1 else ""
        table.append((f"split: B={b} tok/s", f"unsplit {unsplit_rate:.1f}  PP-2 split {split_rate:.1f} "
                                            f"({100 * (split_rate / unsplit_rate - 1):+.1f}%){waves}"))
    del model, split, dual
    release()


def section_dual(args, table) -> None:
    if torch.cuda.device_count() < 2:
        table.append(("dual", f"skipped: needs 2 GPUs, {torch.cuda.device_count()} here"))
        return
    base = {"MEMRA_PP_STAGES": "2", "MEMRA_PP_DEVICES": "0,1", "MEMRA_PP_SHARD": "1", "MEMRA_PEER_PROBE": "1"}
    torch.cuda.set_device(0)
    model = random_model(args.model, "cuda:0", torch.bfloat16, n_layers=args.layers)
    serial = model.with_doors(**base, MEMRA_DUAL_PP="0")
    dual = model.with_doors(**base, MEMRA_DUAL_PP="1", MEMRA_PP_OVERLAP="1")
    serial_b1 = None
    for b in (1, 8, 16, 32):
        s, _ = decode_rate(serial, b, args.steps)
        d, delta = decode_rate(dual, b, args.steps)
        serial_b1 = s if b == 1 else serial_b1
        table.append((f"dual: B={b} tok/s", f"serial {s:,.1f}  dual {d:,.1f} ({100 * (d / s - 1):+.1f}%); "
                                           f"waves overlapped {delta['dual_pp_overlaps']}x"))
    del dual
    release()
    # what refuse_unsplit prevents: the whole trunk walked from cuda:0, stage 1's weights read over peer
    try:
        unsplit = model.with_doors(**base, MEMRA_BATCH_PP="0", MEMRA_PRIME_PP="0", MEMRA_PP_ALLOW_UNSPLIT_BATCH="1",
                                   MEMRA_CUDA_GRAPHS="0")
        rate, _ = decode_rate(unsplit, 1, max(args.steps // 4, 3))
        table.append(("dual: peer-read cost B=1", f"split {serial_b1:,.2f} tok/s vs unsplit peer-read {rate:,.2f} tok/s "
                                                  f"= {serial_b1 / rate:,.1f}x"))
    except Exception as err:  # noqa: BLE001 - a profiler reports what could not be measured
        table.append(("dual: peer-read cost B=1", f"not measured: {type(err).__name__}: {str(err).splitlines()[0][:160]}"))
    del model, serial
    release()


def section_dist(args, table) -> None:
    from memra.pp.dist import launch_local

    layers = args.layers or 8
    model = random_model(args.model, "cuda:0", torch.bfloat16, n_layers=layers)
    graphs_ms = per_token_ms(model, args.steps * 4)
    eager_ms = per_token_ms(model.with_doors(MEMRA_CUDA_GRAPHS="0"), args.steps * 4)
    table.append((f"dist: one process ({args.model}, {layers} layers)",
                  f"graphs {graphs_ms:.3f} ms/token, eager {eager_ms:.3f} ms/token"))
    if torch.cuda.device_count() >= 2:
        backend, doors = "nccl, rank r on cuda:r", {"MEMRA_PP_DIST_BACKEND": "nccl", "MEMRA_PP_DIST_SHARE_GPUS": "0"}
    else:
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        backend, doors = "gloo, both ranks on cuda:0", {"MEMRA_PP_DIST_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": first}
    with process_doors(**doors):
        pipe = launch_local(model, 2)  # rank 0 drops stage 1's layers here (the arms above are done)
    try:
        print(pipe.description, flush=True)
        dist_ms = per_token_ms(pipe, args.steps * 4)
    finally:
        codes = pipe.shutdown()
    table.append((f"dist: 2 ranks ({backend})", f"{dist_ms:.3f} ms/token ({dist_ms - eager_ms:+.3f} vs eager, "
                                                f"{dist_ms - graphs_ms:+.3f} vs graphs); workers exited {codes}"))
    del model, pipe
    release()


SECTIONS = {"split": section_split, "dual": section_dual, "dist": section_dist}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="split,dual,dist", help="comma list of split, dual, dist")
    ap.add_argument("--model", default="qwen3.5-9b", help="random-weight shape (memra.random_model.SHAPES)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape (default: all; dist: 8)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per arm (dist: 4x)")
    args = ap.parse_args()
    os.environ.update(SAFETY_ENV)
    start, table = time.time(), []
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        t0 = time.time()
        SECTIONS[name](args, table)
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)
    print(f"\n{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{time.time() - start:.0f}s")
    for k, v in table:
        print(f"{k:<44} {v}")


if __name__ == "__main__":
    main()
