"""Tensor sources: name -> float tensor on the CPU, read lazily, checked on the way out.

`SafetensorsSource` reads an HF directory (one file, or shards listed by model.safetensors.index.json)
through memory maps; `GgufSource` reads a GGUF file through the `gguf` package's memory-mapped reader
and dequantizes quantized tensors. Both raise CheckpointError naming the file, the tensor, and what
was expected versus found — never an exception from deep inside a parser.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from memra.errors import CheckpointError
from memra.loading import dequant


class TensorSource(ABC):
    """The interface both formats implement."""

    path: str

    @abstractmethod
    def names(self) -> set[str]: ...

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
        if not self.has(name):
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing" + (f" (needed for {why})" if why else ""))
        found = self.shape(name)
        if shape is not None and tuple(found) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
                + (f" for {why}" if why else "")
            )
        return self._read(name)


class SafetensorsSource(TensorSource):
    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.path = str(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e}); expected a 'weight_map' object")
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
                raise CheckpointError(f"{fpath}: corrupt or truncated safetensors file ({e})") from None
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

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def type_name(self, name: str) -> str:
        return str(self._handles[self._where[name]].get_slice(name).get_dtype())

    def _read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.path}/{self._where[name]}: cannot read tensor {name!r} ({e})") from None


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

    def qtype(self, name: str):
        import gguf

        return gguf.GGMLQuantizationType(self.file.tensors[name].type_id)

    def type_name(self, name: str) -> str:
        return self.qtype(name).name

    def _read(self, name: str) -> torch.Tensor:
        qtype = self.qtype(name)
        if qtype not in dequant.SUPPORTED:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has quantization type {qtype.name}, which memra cannot read; "
                f"supported: {', '.join(sorted(q.name for q in dequant.SUPPORTED))}"
            )
        return dequant.dequantize(torch.from_numpy(self.file.raw(name)), qtype, self.shape(name))
