"""NaN / Inf checks on weights as they load, and naming the stored tensor at fault.

A corrupt weight file can hold NaN or Inf where numbers should be; loaded silently, it generates garbage
with exit 0. What is checked (memra.loading.checkpoint.load_weights decides which weights):
  * always, cheaply: the weights kept in fp32 (norm multipliers, GDN gates, RoPE factors), which are small
    and poison every token when bad; GGUF quantized blocks' fp16 scales, as the source reads them
    (memra.loading.sources); the config's epsilon (memra.config.fields);
  * with check_tensors=True: every weight, fully, on its device, after it is dequantized, converted to the
    model dtype and placed — so a bf16 value that overflows a float16 model is caught too.

A bad weight is named by the stored tensor it came from, as the file spells it: the loader records which
tensors each layer read (TensorSource.recording), and on failure only (a slow path) those are re-read on
the CPU, in order, and the first bad one is named with its count of bad values.
"""

from __future__ import annotations

import torch

from memra.errors import CheckpointError
from memra.loading.sources import TensorSource


def _extremes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of t, on its device, without a host sync.

    NaN propagates through min and max, and an Inf is an extreme, so both are finite exactly when every
    value is. One reduction reads the tensor once and allocates nothing, where `isfinite(t).all()` first
    writes a mask as large as the tensor (~30x slower on a CPU).
    """
    return torch.aminmax(t.reshape(-1))


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys of `tensors` that hold NaN / Inf: one reduction per tensor and, when all are finite (the
    common case), one host sync for them all."""
    tensors = {k: t for k, t in tensors.items() if t.numel()}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors.values():
        by_dtype.setdefault(t.dtype, []).extend(_extremes(t))
    if all(torch.isfinite(torch.stack(ext)).all().item() for ext in by_dtype.values()):
        return []
    return [k for k, t in tensors.items() if not torch.isfinite(torch.stack(_extremes(t))).all().item()]


def blame(src: TensorSource, read: list[str], key: str, dtype: torch.dtype, full_scan: bool) -> CheckpointError:
    """The error for canonical weight `key` (of `dtype` as placed), found non-finite after loading from the
    stored tensors `read`: the first of those holding NaN / Inf, else the first that overflows `dtype`."""
    how = ("found by the full scan, --check-tensors / check_tensors=True" if full_scan else
           "--check-tensors / check_tensors=True scans every tensor")
    for name in read:
        t = src.get(name)
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            return CheckpointError(
                f"{src.file_of(name)}: tensor {name!r} holds {bad} non-finite value{'s' * (bad > 1)} (NaN/Inf) of "
                f"{t.numel()}: the file is corrupt; re-download or re-convert it ({how})"
            )
    for name in read:  # every stored value finite: one overflowed the model dtype on conversion
        t = src.get(name)
        over = int((torch.isinf(t.to(dtype)) & torch.isfinite(t)).sum())
        if over:
            return CheckpointError(
                f"{src.file_of(name)}: tensor {name!r} holds {over} value{'s' * (over > 1)} beyond the range of "
                f"{str(dtype).removeprefix('torch.')}, which become Inf in this model; load it with a wider dtype "
                f"(bfloat16 or float32) ({how})"
            )
    return CheckpointError(
        f"{src.path}: weight {key!r} is non-finite after loading, though the tensors it was made from "
        f"({', '.join(read[:6])}{', ...' if len(read) > 6 else ''}) are finite: the file is corrupt; re-download or "
        f"re-convert it ({how})"
    )
