"""Open a GGUF file: validated header, metadata as plain Python values, tensors as memory-mapped arrays.

A small reader of our own (the format is a header, key/value pairs, tensor
infos, then aligned data): the `gguf` package's reader builds a numpy object
per vocabulary string and takes seconds on a 49k-token vocabulary, which a
warm start cannot afford. Every way a file can be wrong (missing, not a GGUF,
truncated, damaged) becomes a `ModelFileError` naming the file. The `gguf`
package still supplies the tensor type enum and dequantization. This module
knows nothing about what the tensors mean: see `model_loader`.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_runtime.errors import ModelFileError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format (scalars)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(slots=True)
class TensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous (input) dimension
    data_offset: int
    n_bytes: int
    data: np.ndarray  # raw: [rows, bytes_per_row] uint8 for block types, typed [rows, cols] otherwise


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"truncated GGUF file {self.path}: header ends past the end of the file")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _NP:
                arr = np.frombuffer(self.take(count * np.dtype(_NP[itype]).itemsize), dtype=_NP[itype])
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        raise ModelFileError(f"damaged GGUF file {self.path}: unknown value type {vtype}")


class GGUFFile:
    """A validated, memory-mapped GGUF file: `.metadata` (key -> value) and `.tensors` (name -> TensorInfo)."""

    def __init__(self, path: str):
        from edge_runtime.model.path import resolve_model_path

        self.path = resolve_model_path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelFileError(f"not a GGUF file (bad magic {magic!r}): {self.path}")
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelFileError(f"cannot read model file {self.path}: {e.strerror}") from None
        try:
            self._parse(size)
        except ModelFileError:
            raise
        except UnsupportedModelError:
            raise
        except Exception as e:  # anything else in a header we cannot make sense of
            raise ModelFileError(f"damaged GGUF file {self.path}: {type(e).__name__}: {e}") from None

    def _parse(self, size: int) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        cur = _Cursor(memoryview(self._map), self.path)
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelFileError(f"unsupported GGUF version {version} in {self.path}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
            raw_type, offset = cur.scalar("<I"), cur.scalar("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise UnsupportedModelError(f"unsupported tensor type id {raw_type} in tensor {name}") from None
            infos.append((name, qtype, shape, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(shape)) if shape else 1
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            if start + n_bytes > size:
                raise ModelFileError(f"truncated GGUF file {self.path}: tensor {name} ends past the end of the file")
            raw = self._map[start:start + n_bytes]
            rows = n_elems // shape[0] if shape else 1
            if block == 1:  # plain float/int types: typed view
                dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype)
                data = raw.view(dtype).reshape(rows, -1) if dtype is not None else raw.reshape(rows, -1)
            else:
                data = raw.reshape(rows, -1)
            self.tensors[name] = TensorInfo(name, qtype, shape, start, n_bytes, data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return self.metadata[key]


def read_metadata(path: str) -> dict[str, Any]:
    return GGUFFile(path).metadata
