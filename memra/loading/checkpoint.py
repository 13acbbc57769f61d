"""memra.load(): sniff the checkpoint, build its ModelConfig, map its tensors, place them on the device.

Weights are read lazily (memory-mapped) and converted one layer at a time, so peak host memory is one
layer beyond what the device holds. Each layer's weights are checked for NaN / Inf as they are placed
(memra.loading.tensor_checks: the small fp32 ones always, all of them with check_tensors=True). A progress
bar shows on a terminal and stays quiet when piped or under CI.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from memra.pools import KvBudget
from memra.settings import Settings, show_progress
from memra.config import FP32_WEIGHTS, from_gguf_metadata, from_hf_config
from memra.config.from_gguf_sliding import SLIDING_GGUF_ARCHITECTURES, sliding_hf_config
from memra.errors import CheckpointError, ConfigError, MemraError
from memra.heap import return_freed_memory

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise MemraError(f"unsupported model dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise MemraError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as e:
        raise MemraError(f"invalid device {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MemraError(f"device {device!r} requested but CUDA is not available on this machine; run on the CPU "
                         "(--device cpu on the command line, device=\"cpu\" in Python)")
    return dev


def progress(iterable, total: int, desc: str, unit: str = "layer"):
    """A tqdm bar on an interactive terminal; the bare iterable when piped or under CI."""
    if not show_progress():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)


DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"


def resolve_model_path(path: str | Path) -> Path:
    """'demo' names the bundled demo model, and ORG/NAME[:FILE.gguf] a Hugging Face model
    (memra.loading.hub), unless a file or folder of that name exists here."""
    p = Path(path)
    if str(path) == "demo" and not p.exists():
        if not (DEMO_DIR / "config.json").exists():
            raise MemraError(f"the bundled demo model is missing from {DEMO_DIR}; reinstall memra")
        return DEMO_DIR
    if isinstance(path, str):
        from memra.loading.hub import looks_like_hub_name, resolve_hub_name

        if looks_like_hub_name(path):
            return resolve_hub_name(path)
    return p


def open_checkpoint(path: str | Path):
    """-> (ModelConfig, names mapper, tokenizer factory, kind). Understands an HF dir or a .gguf file."""
    p = resolve_model_path(path)
    if not p.exists():
        raise MemraError(f"no such model: {str(path)!r} (expected a Hugging Face model directory, a .gguf file, "
                         "or a Hugging Face name ORG/NAME[:FILE.gguf])")
    if p.is_dir():
        return _open_hf(p)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if magic == b"GGUF":
        return _open_gguf(p)
    raise CheckpointError(f"{p}: not a GGUF file (bad magic {magic!r}) and not a model directory")


def _open_hf(d: Path):
    from memra.loading.fp_source import QuantizedSource
    from memra.loading.hf import HfNames
    from memra.loading.hf_quant import weight_format
    from memra.loading.json_file import read_json_object
    from memra.loading.sources import SafetensorsSource

    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json; a Hugging Face model directory needs one")
    raw = read_json_object(cfg_path, ConfigError, "fix config.json or re-download the model")
    cfg = from_hf_config(raw, str(cfg_path))
    src = SafetensorsSource(d)
    if (fmt := weight_format(raw, d, str(cfg_path))) is not None:  # FP8 block / NVFP4: dequantized as read
        src = QuantizedSource(src, fmt)
    if cfg.n_mtp and not src.has("mtp.fc.weight"):
        cfg = dataclasses.replace(cfg, n_mtp=0)  # config names MTP blocks the export dropped
    if not cfg.tie_embeddings and not src.has("lm_head.weight"):
        cfg = dataclasses.replace(cfg, tie_embeddings=True)

    def tokenizer():
        from memra.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(d)

    return cfg, HfNames(cfg, src), tokenizer, "hf"


def _open_gguf(path: Path):
    from memra.loading.gguf import GgufNames
    from memra.loading.sources import GgufSource

    src = GgufSource(path)
    meta = src.metadata()
    vocab = src.shape("token_embd.weight")[0] if src.has("token_embd.weight") else None
    gguf_arch = meta.get("general.architecture")
    if gguf_arch in SLIDING_GGUF_ARCHITECTURES:  # Gemma 4, Step-3.5: through their config.json builders
        from memra.loading.gguf_sliding import SlidingGgufNames

        def read(name: str) -> list[float]:
            return src.get(name, src.shape(name), "the config").float().tolist()

        raw = sliding_hf_config(meta, str(path), vocab or 0, src.has, read)
        cfg = from_hf_config(raw, f"{path} (GGUF metadata)")
        names = SlidingGgufNames(cfg, src, gguf_arch)
    else:
        cfg = from_gguf_metadata(meta, str(path), vocab_size=vocab)
        names = GgufNames(cfg, src, gguf_arch)
    if cfg.moe is not None:
        cfg = dataclasses.replace(cfg, ffns=tuple(names.ffn_kind(i) for i in range(cfg.n_layers)))
    if not src.has("output.weight"):
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    names.cfg = cfg

    def tokenizer():
        from memra.tokenizer import Tokenizer

        return Tokenizer.from_gguf(path, str(path))

    return cfg, names, tokenizer, "gguf"


def load_weights(path: str | Path, device: torch.device, dtype: torch.dtype, opened=None, check_tensors: bool = False,
                 packed: bool | None = False):
    """-> (ModelConfig, canonical weights on `device`, tokenizer factory). Norms and GDN gates stay fp32.
    `opened` is open_checkpoint(path)'s result when the caller already has it. The fp32 weights (and GGUF
    block scales) are always checked for NaN / Inf; `check_tensors` scans every weight, on `device`, after
    it is placed. A bad one raises CheckpointError naming the stored tensor (memra.loading.tensor_checks).
    `packed` (an HF FP8 / NVFP4 checkpoint: its projections, the same defaults): keep a GGUF's quantized projections packed (memra.loading.gguf) -- Q8_0, Q4_K, Q5_K and
    Q6_K, split into quants and scales by memra.kernels.split -- decoded a tile at a time inside each
    linear, with the same bits: True for all of them, False for none, None for what pays off here: all
    of them on CPU (about the file's size instead of fp32's four bytes a value), nothing on a GPU (whose
    dense kernels beat the packed ones there, as last measured)."""
    from memra.kernels.split import SPLITS
    from memra.loading.fp_source import QuantizedSource
    from memra.loading.gguf import GgufNames
    from memra.loading.tensor_checks import blame, nonfinite

    cfg, names, make_tokenizer, _ = opened or open_checkpoint(path)
    src = names.src
    if isinstance(names, GgufNames):
        names.packed = frozenset(SPLITS) if packed or (packed is None and device.type == "cpu") else frozenset()
    elif isinstance(src, QuantizedSource):  # FP8 / NVFP4: packed on CPU by default; on a GPU only when asked
        names.pack = bool(packed) or (packed is None and device.type == "cpu")

    def place(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return place_weights(prefix, tensors, device, dtype)

    def load_part(prefix: str, make) -> dict[str, torch.Tensor]:
        with src.recording() as read:
            placed = place(prefix, make())
        if check_tensors:  # the full scan reads every value, packed ones decoded (the scales were checked on read)
            scanned = {k: t if isinstance(t, torch.Tensor) else t.dequantize() for k, t in placed.items()}
        else:
            scanned = {k: t for k, t in placed.items() if k.rsplit(".", 1)[-1] in FP32_WEIGHTS}
        if bad := nonfinite(scanned):
            raise blame(src, read, bad[0], placed[bad[0]].dtype, check_tensors)
        return placed

    weights = load_part("", names.globals)
    parts = [(f"layers.{i}.", names.layer, i) for i in range(cfg.n_layers)]
    parts += [(f"mtp.{j}.", names.mtp, j) for j in range(cfg.n_mtp)]
    for prefix, fn, idx in progress(parts, len(parts), f"loading {Path(path).name}"):
        weights.update(load_part(prefix, lambda: fn(idx)))
    if device.type == "cpu":
        return_freed_memory()  # what loading freed (memra.heap)
    return cfg, weights, make_tokenizer


def place_weights(prefix: str, tensors: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """A part's mapped tensors as the model holds them: `dtype` (fp32 for FP32_WEIGHTS), on `device`, each a
    fresh allocation; packed GGUF / FP8 / NVFP4 weights in their split layouts. Loading and
    memra.weights.update (an update in place) both convert through here, so an updated weight has the bits a
    fresh load of the same tensors gives it."""
    from memra.kernels.quant import MixedRows, QuantWeight
    from memra.kernels.split import FP_SPLITS, split_layout

    out = {}
    for k, t in tensors.items():
        want = torch.float32 if k.rsplit(".", 1)[-1] in FP32_WEIGHTS else dtype
        # Always a fresh allocation: a tensor still backed by the file's memory map can sit at any
        # byte offset, and CPU BLAS picks different kernels (different bits) for unaligned data.
        if isinstance(t, (QuantWeight, MixedRows)):
            # the quants split from their scales, on the device (memra.kernels.split). The layouts are
            # fresh tensors, so on CPU the file's bytes are read in place, not copied first.
            out[prefix + k] = split_layout(t.placed(device, want, copy=False))
        elif isinstance(t, FP_SPLITS):  # already split (memra.loading.fp_source): moved, decoding to `want`
            out[prefix + k] = dataclasses.replace(t.to(device), dtype=want)
        else:
            out[prefix + k] = t.to(device=device, dtype=want, copy=True).contiguous()
    return out


def load(path: str | Path, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
         tokenizer: bool = True, check_tensors: bool = False, kv_budget: KvBudget | None = None,
         settings: Settings | None = None, packed_weights: bool | None = None):
    """Load a model for inference. -> HybridModel (see memra.model.hybrid). `path` is an HF directory, a
    .gguf file, "demo", or "random:SHAPE" (memra.random_model.SHAPES: random weights, no file).

    `packed_weights`: a GGUF's quantized projections stay packed in memory (load_weights: None = Q8_0,
    Q4_K, Q5_K and Q6_K on CPU and none on a GPU, True = what the device can read packed, False = none).
    `settings`: the MEMRA_* doors (memra.settings); by default read from the environment now, once —
    nothing reads the environment after load. Every header field is checked before use, and a corrupt file fails with a one-line MemraError. The
    small fp32 weights (norms, GDN gates) and GGUF block scales are always checked for NaN / Inf. On the
    bundled demo (7.5M values) those default checks cost ~0.4 ms (safetensors) and ~2 ms (its Q8_0 GGUF:
    1.5 ms of it the scales) of a ~30 / ~50 ms load on one CPU thread, ~1.3 ms on an H200 (one host sync
    per layer). `check_tensors=True` also scans every weight fully, on its device, after it is converted
    and placed: NaN / Inf anywhere (and values that overflow a float16 model) are found, for one min/max
    pass over the weights (demo: ~3 ms on one CPU thread, ~2.7 ms on an H200)."""
    from memra.model.hybrid import HybridModel

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    budget = kv_budget if kv_budget is not None else KvBudget()
    settings = settings if settings is not None else Settings.from_env()  # the doors, read once: now
    if str(path).startswith(RANDOM_PREFIX):
        return _random(str(path)[len(RANDOM_PREFIX):], dev, dt, tokenizer, budget, settings)
    path = resolve_model_path(path)  # a hub name is looked up (and fetched) once, here
    opened = open_checkpoint(path)
    tok = opened[2]() if tokenizer else None  # a broken tokenizer fails before any weight is read
    cfg, weights, _ = load_weights(path, dev, dt, opened=opened, check_tensors=check_tensors, packed=packed_weights)
    return HybridModel(cfg, weights, dev, dt, tokenizer=tok, source=str(resolve_model_path(path)), kv_budget=budget,
                       settings=settings)


# random:llama-3-8b -- a named real shape with random weights, no file (memra.random_model); random:NAME:LAYERS
# builds it with its first LAYERS layers (a model too large for the card at full depth, such as the 35B-A3B's
# 40 layers on an 80 GB H100)
RANDOM_PREFIX = "random:"


def _random(name: str, device: torch.device, dtype: torch.dtype, tokenizer: bool, kv_budget: KvBudget,
            settings: Settings):
    """A random-weight model of a real shape, built on the device, with a byte-level tokenizer covering its
    whole vocabulary: what `memra serve random:llama-3-8b` measures at real size with no download."""
    from memra.random_model import random_model
    from memra.tokenizer.synthetic import byte_level_tokenizer

    name, _, layers = name.partition(":")
    if layers and not (layers.isdigit() and int(layers) > 0):
        raise MemraError(f"random:{name}:{layers}: the layer count after the shape's name must be a positive integer")
    model = random_model(name, device, dtype, n_layers=int(layers) if layers else None, settings=settings)
    model.kv_budget = kv_budget
    if tokenizer:
        model.tokenizer = byte_level_tokenizer(model.cfg.vocab_size, source=RANDOM_PREFIX + name)
    return model


def inspect_checkpoint(path: str | Path) -> str:
    """A human-readable summary: config, tensor count and types, tokenizer."""
    from collections import Counter

    cfg, names, make_tokenizer, kind = open_checkpoint(path)
    src = names.src
    lines = [f"checkpoint     {path}  ({'GGUF' if kind == 'gguf' else 'Hugging Face safetensors'})", cfg.describe()]
    types = Counter(src.type_name(n) for n in src.names())
    lines.append(f"tensors        {len(src.names())}  (" + ", ".join(f"{k}: {v}" for k, v in sorted(types.items())) + ")")
    try:
        lines.append("tokenizer      " + make_tokenizer().summary())
    except MemraError as e:
        lines.append(f"tokenizer      unavailable: {e}")
    return "\n".join(lines)
