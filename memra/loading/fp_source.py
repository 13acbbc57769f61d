"""An HF checkpoint of FP8 block-scaled or NVFP4 weights, read as float weights, or packed.

`QuantizedSource` wraps the directory's SafetensorsSource. Each quantized linear shows under its plain
name (`X.weight`, the logical [rows, columns] shape) and reads as float32: the format's bytes and scales,
dequantized by memra.loading.fp_formats, whose values equal the format's definition
(memra.loading.fp_reference) bit for bit. The loader then rounds them to the model dtype like any other
weight, so a quantized checkpoint and its dequantized float32 twin load to the same bits. The scale
tensors are hidden; everything not quantized (embeddings, norms, the LM head where the checkpoint keeps
them in bf16) reads as before. `packed(name)` instead keeps a quantized weight as the file's bytes beside
fp32 scales (memra.kernels.split.Fp8BlockSplit / Nvfp4Split: what a CPU load holds by default), whose
tiles decode to exactly the values `get(name)` returns.

Checked on every read, each failure one line naming the stored tensor: the parts' dtypes and shapes, the
scales finite (a NaN scale poisons its whole block), and the dequantized values finite (FP8's NaN codes,
or a product that overflows fp32).
"""

from __future__ import annotations

import torch

from memra import counters
from memra.errors import CheckpointError
from memra.loading.fp_formats import NVFP4_GROUP, fp8_block_dequant, nvfp4_block_scales, nvfp4_dequant
from memra.loading.hf_quant import FP8_BLOCK, NVFP4_CT, NVFP4_MODELOPT, WeightFormat
from memra.loading.sources import SafetensorsSource, TensorSource

_FIX = "the file is corrupt; re-download or re-quantize it"
_SCALE_DTYPES = ("F32", "BF16", "F16")


class QuantizedSource(TensorSource):
    def __init__(self, inner: SafetensorsSource, fmt: WeightFormat):
        self.inner, self.fmt, self.path = inner, fmt, inner.path
        stored = inner.names()
        self._parts: dict[str, tuple[str, ...]] = {}  # logical name -> (data, scale[, global]) stored names
        hidden: set[str] = set()
        for n in sorted(stored):
            parts = self._parts_of(n, stored)
            if parts is not None:
                logical = n.removesuffix("_packed")
                self._parts[logical] = parts
                hidden.update(parts)
                base = n.rsplit(".", 1)[0] + "."
                hidden.update(base + x for x in ("input_scale", "input_global_scale", "weight_shape"))
        if not self._parts:
            raise CheckpointError(f"{self.path}: config declares {fmt.describe()} weights but no tensor is stored "
                                  "in that format; the checkpoint and its config.json disagree")
        self._names = (stored - hidden) | set(self._parts)

    def _parts_of(self, n: str, stored: set[str]) -> tuple[str, ...] | None:
        """The stored names making up quantized weight `n` (its data tensor), or None if `n` is not one."""
        kind = self.fmt.kind
        if kind == FP8_BLOCK and n.endswith(".weight") and self.inner.type_name(n) == "F8_E4M3":
            need = (n + "_scale_inv",)
        elif kind == NVFP4_MODELOPT and n.endswith(".weight") and self.inner.type_name(n) == "U8":
            need = (n + "_scale", n + "_scale_2")
        elif kind == NVFP4_CT and n.endswith(".weight_packed"):
            base = n.removesuffix("_packed")
            need = (base + "_scale", base + "_global_scale")
        else:
            return None
        for m in need:
            if m not in stored:
                raise CheckpointError(f"{self.inner.file_of(n)}: tensor {n!r} is stored as {self.fmt.describe()} "
                                      f"but its scale {m!r} is missing; {_FIX}")
        return (n, *need)

    # --- TensorSource ---
    def names(self) -> set[str]:
        return self._names

    def has(self, name: str) -> bool:
        return name in self._names

    def file_of(self, name: str) -> str:
        return self.inner.file_of(self._parts[name][0] if name in self._parts else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return self.inner.shape(name)
        data = self.inner.shape(self._parts[name][0])
        return tuple(data) if self.fmt.kind == FP8_BLOCK else (*data[:-1], 2 * data[-1])

    def type_name(self, name: str) -> str:
        return self.fmt.describe() if name in self._parts else self.inner.type_name(name)

    def is_quantized(self, name: str) -> bool:
        return name in self._parts

    def packed(self, name: str, shape: tuple[int, int], why: str = ""):
        """Quantized weight `name` kept packed (memra.kernels.split.Fp8BlockSplit / Nvfp4Split, activation
        dtype fp32 until the loader places it), with every check _read makes; its values are _read's."""
        from memra.kernels.split import Fp8BlockSplit, Nvfp4Split

        self._check(name, shape, why)
        data, scale, glob = self._checked_parts(name)
        rows, cols = shape
        if self.fmt.kind == FP8_BLOCK:
            br, bc = self.fmt.block
            s = scale.float().repeat_interleave(br, dim=0)[:rows].contiguous()  # each row its block's scales
            layout = Fp8BlockSplit(data, s, bc, torch.float32)
        else:
            layout = Nvfp4Split(data, nvfp4_block_scales(scale, glob, self.fmt.kind == NVFP4_CT), torch.float32)
        self._check_values(name, layout.dequantize(torch.float32))
        return layout

    def _read(self, name: str) -> torch.Tensor:
        if name not in self._parts:
            return self.inner._read(name)
        data, scale, glob = self._checked_parts(name)
        if self.fmt.kind == FP8_BLOCK:
            out = fp8_block_dequant(data, scale, self.fmt.block)
        else:
            out = nvfp4_dequant(data, scale, glob, inverted_global=self.fmt.kind == NVFP4_CT)
        self._check_values(name, out)
        return out

    def _checked_parts(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(data, block scales, per-tensor scale or None) of quantized weight `name`, each checked."""
        parts = self._parts[name]
        data = self._part(parts[0], ("F8_E4M3",) if self.fmt.kind == FP8_BLOCK else ("U8",), 2)
        rows, cols = self.shape(name)
        if self.fmt.kind == FP8_BLOCK:
            (br, bc) = self.fmt.block
            return data, self._scale(parts[1], _SCALE_DTYPES, (-(-rows // br), -(-cols // bc))), None
        self._check_weight_shape(parts[0], rows, cols)
        scale = self._scale(parts[1], ("F8_E4M3",), (rows, -(-cols // NVFP4_GROUP)))
        glob = self._scale(parts[2], _SCALE_DTYPES, None)
        if self.fmt.kind == NVFP4_CT and float(glob) == 0.0:  # it divides
            raise CheckpointError(f"{self.file_of(name)}: tensor {parts[2]!r} is 0, which divides every "
                                  f"scale; {_FIX}")
        return data, scale, glob

    def _check_values(self, name: str, out: torch.Tensor) -> None:
        """The dequantized values finite (FP8 NaN codes, fp32 overflow refused), and the liveness count."""
        parts = self._parts[name]
        if not torch.isfinite(torch.stack(torch.aminmax(out.reshape(-1)))).all():
            bad = int((~torch.isfinite(out)).sum())
            raise CheckpointError(f"{self.file_of(name)}: tensor {parts[0]!r} ({self.fmt.describe()}) dequantizes "
                                  f"to {bad} non-finite value{'s' * (bad > 1)} (NaN/Inf) of {out.numel()}; {_FIX}")
        counters.bump("fp8_block_weights_loaded" if self.fmt.kind == FP8_BLOCK else "nvfp4_weights_loaded")

    def _part(self, n: str, dtypes: tuple[str, ...], ndim: int | None) -> torch.Tensor:
        found = self.inner.type_name(n)
        if found not in dtypes:
            raise CheckpointError(f"{self.inner.file_of(n)}: tensor {n!r} is stored as {found}; {self.fmt.describe()} "
                                  f"stores it as {' or '.join(dtypes)}; {_FIX}")
        t = self.inner.stored(n)
        if ndim is not None and t.dim() != ndim:
            raise CheckpointError(f"{self.inner.file_of(n)}: tensor {n!r} has shape {list(t.shape)}; memra reads "
                                  f"{self.fmt.describe()} weights as 2-D matrices")
        return t

    def _scale(self, n: str, dtypes: tuple[str, ...], shape: tuple[int, int] | None) -> torch.Tensor:
        """A scale tensor, checked: its dtype, its shape (None: one value), every value finite."""
        t = self._part(n, dtypes, None)
        ok = t.numel() == 1 if shape is None else tuple(t.shape) == shape
        if not ok:
            want = "one value" if shape is None else f"shape {list(shape)}"
            raise CheckpointError(f"{self.inner.file_of(n)}: tensor {n!r} has shape {list(t.shape)}, expected {want} "
                                  f"for {self.fmt.describe()}; {_FIX}")
        bad = int((~torch.isfinite(t.float())).sum())
        if bad:
            raise CheckpointError(f"{self.inner.file_of(n)}: scale tensor {n!r} holds {bad} non-finite value"
                                  f"{'s' * (bad > 1)} (NaN/Inf) of {t.numel()}; {_FIX}")
        return t

    def _check_weight_shape(self, data_name: str, rows: int, cols: int) -> None:
        """compressed-tensors may store the unpacked shape beside the packed bytes: it must agree."""
        n = data_name.rsplit(".", 1)[0] + ".weight_shape"
        if n in self.inner.names():
            ws = [int(v) for v in self.inner.stored(n).reshape(-1).tolist()]
            if ws != [rows, cols]:
                raise CheckpointError(f"{self.inner.file_of(n)}: tensor {n!r} says {ws}, but {data_name!r} packs "
                                      f"{[rows, cols]}; memra reads NVFP4 rows of an even length only; {_FIX}")
