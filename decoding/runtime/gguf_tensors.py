"""A GGUF file's tensor table and each tensor's bytes, from its header alone.

transformers' header walk reads the table in a third of a second; gguf-py's reader parses every
metadata element into numpy views first (16 s for a 150k-token vocabulary on 2 cores, on every load).
Both are kept per file (its path and modification time) for the load that asks several times.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decoding.base.errors import BackendError


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a GGUF file: where its bytes are and how they are stored."""

    name: str
    shape: tuple[int, ...]  # torch order (ggml's reversed)
    type_name: str  # GGMLQuantizationType name: F32, Q4_K, ...
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of the tensor seen as 2-D [rows, last dimension] (1 for a vector)."""
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1


def file_tensors(gguf: Path) -> list[FileTensor]:
    """The file's tensor table, read with transformers' GGUF reader's header walk (no tensor data is
    read; its own tensor list refuses types it has no kernel for, such as Q5_0)."""
    return list(_table(str(gguf), gguf.stat().st_mtime_ns))


def tensor_bytes(gguf: Path, t: FileTensor) -> np.ndarray:
    """A tensor's bytes as stored (uint8, flat), mapped from the file, not read into memory."""
    data = _mapped(str(gguf), gguf.stat().st_mtime_ns)[t.start : t.start + t.nbytes]
    if data.size != t.nbytes:
        raise BackendError(f"{gguf}: tensor {t.name} runs past the end of the file; download or copy it again")
    return data


@functools.lru_cache(maxsize=2)
def _table(path: str, mtime_ns: int) -> tuple[FileTensor, ...]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    try:
        blob = _mapped(path)
        metadata, count, at = _read_metadata(blob, path)
        entries, end = _read_tensor_table(blob, count, at)
        kinds = [GGMLQuantizationType(kind) for _, _, kind, _ in entries]
    except (ValueError, OSError, struct.error) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise BackendError(f"{path}: its GGUF header does not parse ({first})") from None
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-end // alignment) * alignment
    tensors = []
    for (name, shape, _, offset), kind in zip(entries, kinds):
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
        tensors.append(FileTensor(name, tuple(shape), kind.name, data_start + offset, nbytes))
    return tuple(tensors)


@functools.lru_cache(maxsize=1)
def _mapped(path: str, mtime_ns: int) -> np.ndarray:
    # A plain array over the mapping: a memmap's own slicing costs microseconds a slice.
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
