"""Tensor sources: name -> float tensor on the CPU, read lazily, checked on the way out.

`SafetensorsSource` reads an HF directory (one file, or shards listed by model.safetensors.index.json)
through memory maps; `GgufSource` reads a GGUF file through memra.loading.gguf_file and dequantizes
quantized tensors, after checking their blocks' scales (a NaN scale would turn a block into NaN). Both
raise CheckpointError naming the file, the tensor, and what was expected versus found — never an
exception from deep inside a parser. Each source can record the names it is asked for (`recording`), so
the loader can tell which stored tensor a bad weight came from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import gguf
import torch

from memra.errors import CheckpointError
from memra.loading import dequant
from memra.loading.json_file import read_json_object

# Float dtypes a safetensors weight may have; anything else (ints, fp8, bool) is not a weight memra reads.
_FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


class TensorSource(ABC):
    """The interface both formats implement."""

    path: str
    _journal: list[str] | None = None

    @abstractmethod
    def names(self) -> set[str]: ...

    def file_of(self, name: str) -> str:
        """The file that holds `name` (for messages)."""
        return self.path

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The logical torch shape (row-major)."""

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor as floats on the CPU (dequantized if stored quantized)."""

    @abstractmethod
    def type_name(self, name: str) -> str:
        """How the tensor is stored (e.g. F32, BF16, Q8_0)."""

    def has(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str, shape: tuple[int, ...] | None = None, why: str = "") -> torch.Tensor:
        self._check(name, shape, why)
        return self._read(name)

    def _check(self, name: str, shape: tuple[int, ...] | None, why: str) -> None:
        """The tensor exists with this shape (refused otherwise), and the journal notes its reading."""
        if not self.has(name):
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing" + (f" (needed for {why})" if why else ""))
        found = self.shape(name)
        if shape is not None and tuple(found) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
                + (f" for {why}" if why else "")
            )
        if self._journal is not None:
            self._journal.append(name)

    @contextmanager
    def recording(self) -> Iterator[list[str]]:
        """Inside the block, every name read through `get` is appended, in order, to the list yielded."""
        outer, self._journal = self._journal, []
        try:
            yield self._journal
        finally:
            self._journal = outer


class SafetensorsSource(TensorSource):
    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.path = str(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors") if p.name != "reference.safetensors")
            weight_map = {}
        if not files:
            raise CheckpointError(f"{directory}: no model.safetensors (or shards with an index) found")
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fpath = directory / fname
            if not fpath.exists():
                raise CheckpointError(f"{index}: shard {fname!r} is listed but missing from {directory}")
            try:
                handle = safe_open(str(fpath), framework="pt")
                keys = list(handle.keys())
            except Exception as e:  # safetensors raises its own error types for bad headers/truncation
                raise CheckpointError(f"{fpath}: corrupt or truncated safetensors file ({_one_line(e)}); "
                                      "re-download it") from None
            self._handles[fname] = handle
            for k in keys:
                self._where[k] = fname
        for k, fname in weight_map.items():
            if self._where.get(k) != fname:
                raise CheckpointError(f"{index}: tensor {k!r} is mapped to {fname!r} but that shard does not hold it")

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        return f"{self.path}/{self._where[name]}"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def type_name(self, name: str) -> str:
        return str(self._handles[self._where[name]].get_slice(name).get_dtype())

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as stored, any dtype (quantized formats read their parts this way)."""
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.file_of(name)}: cannot read tensor {name!r} ({_one_line(e)})") from None

    def _read(self, name: str) -> torch.Tensor:
        t = self.stored(name)
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r} is stored as {self.type_name(name)}; memra "
                                  "reads float weights (F32, F16, BF16, F64): the file is corrupt or quantized in a "
                                  "format memra does not read")
        return t


class GgufSource(TensorSource):
    def __init__(self, path: Path):
        from memra.loading.gguf_file import GgufFile

        self.path = str(path)
        self.file = GgufFile(path)

    def metadata(self) -> dict[str, Any]:
        """Every key/value pair, as plain Python values."""
        return self.file.metadata

    def names(self) -> set[str]:
        return set(self.file.tensors)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[name].shape

    def qtype(self, name: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType(self.file.tensors[name].type_id)

    def type_name(self, name: str) -> str:
        return self.qtype(name).name

    def packed(self, name: str, shape: tuple[int, int], why: str = ""):
        """The tensor as its GGUF bytes (memra.kernels.quant.QuantWeight, activation dtype fp32 until the
        loader places it), with get()'s checks and the scale check; for a 2-D tensor in a format the
        packed linear reads (quant.PACKABLE)."""
        from memra.kernels.quant import QuantWeight

        self._check(name, shape, why)
        return QuantWeight.from_gguf(self._raw(name), self.qtype(name), shape, torch.float32)

    def _read(self, name: str) -> torch.Tensor:
        return dequant.dequantize(self._raw(name), self.qtype(name), self.shape(name))

    def _raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as stored, after the checks every read makes: a type memra reads, no NaN / Inf
        block scale."""
        qtype = self.qtype(name)
        if qtype not in dequant.SUPPORTED:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has quantization type {qtype.name}, which memra cannot read; "
                f"supported: {', '.join(sorted(q.name for q in dequant.SUPPORTED))}"
            )
        raw = torch.from_numpy(self.file.raw(name))
        bad = dequant.first_bad_scale(raw, qtype)
        if bad is not None:
            n_blocks = raw.numel() // gguf.GGML_QUANT_SIZES[qtype][1]
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ({qtype.name}) has a NaN/Inf scale in block {bad} of {n_blocks}: the "
                "file is corrupt; re-download or re-convert it (--check-tensors / check_tensors=True also scans "
                "every dequantized value)"
            )
        return raw


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: tensor name -> shard file, a plain name in the directory."""
    fix = "re-download the model's index file"
    weight_map = read_json_object(index, CheckpointError, fix).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: expected a 'weight_map' object (tensor name -> shard file); {fix}")
    for k, fname in weight_map.items():
        if not isinstance(fname, str) or Path(fname).name != fname or fname in ("", ".", ".."):
            raise CheckpointError(f"{index}: tensor {k!r} is mapped to {fname!r}, which is not a file name in the "
                                  f"model directory; {fix}")
    return weight_map
