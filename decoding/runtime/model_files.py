"""Model files checked before any loader reads them, so a broken file is one line naming the file
and what is wrong with it (for a file cut short: its size against the size its header promises),
not a traceback from deep inside `gguf` or `safetensors`.

GGUF: the magic, then the header (key-values, tensor infos) walked without reading any tensor data;
the data must reach the end of the last tensor. A safetensors checkpoint: each weight file's JSON
header and the end of its last tensor, and every file a sharded checkpoint's index lists.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

from decoding.base.errors import BackendError

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar (8 string and 9 array are walked apart).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _Cursor:
    """Little-endian reads from a buffer; running past its end raises _Truncated."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.at = buf, 0

    def read(self, fmt: str) -> int | float:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buf):
            raise _Truncated
        value: int | float  # every format `_Cursor` is given is one integer or float
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += size
        return value

    def skip(self, n: int) -> None:
        if self.at + n > len(self.buf):
            raise _Truncated
        self.at += n

    def string(self) -> bytes:
        n = int(self.read("Q"))
        start = self.at
        self.skip(n)
        return bytes(self.buf[start : self.at])

    def value(self, kind: int) -> object:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = int(self.read("I")), int(self.read("Q"))
            if inner in SCALARS:  # a block of scalars: skipped whole (a vocabulary's scores, ...)
                self.skip(count * struct.calcsize("<" + SCALARS[inner]))
            else:
                for _ in range(count):
                    self.value(inner)
            return None
        if kind not in SCALARS:
            raise ValueError(f"value type {kind}")
        return self.read(SCALARS[kind])


def gguf_size(path: Path, key: str = "model") -> int:
    """The size the file's header promises (the end of its last tensor's data), in bytes; raises
    BackendError for a file that is not GGUF or is cut short inside its header."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise BackendError(
                f"{key}.path={path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); "
                "give a .gguf model file"
            )
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)
        cur.skip(4)
        version = int(cur.read("I"))
        if version not in (2, 3):
            raise BackendError(f"{key}.path={path} is GGUF version {version}; this loader reads versions 2 and 3")
        n_tensors, n_kv = int(cur.read("Q")), int(cur.read("Q"))
        alignment = 32
        for _ in range(n_kv):
            name = cur.string()
            value = cur.value(int(cur.read("I")))
            if name == b"general.alignment" and isinstance(value, int):
                alignment = value
        ends = []
        for _ in range(n_tensors):
            cur.string()
            dims = [int(cur.read("Q")) for _ in range(int(cur.read("I")))]
            kind, offset = int(cur.read("I")), int(cur.read("Q"))
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            count = 1
            for d in dims:
                count *= d
            ends.append(offset + count // block * size)
        start = -(-cur.at // alignment) * alignment
        return start + max(ends, default=0)
    except _Truncated:
        raise BackendError(
            f"{key}.path={path} is cut short inside its header ({len(buf)} bytes); download or copy the file again"
        ) from None
    except (ValueError, KeyError) as e:  # an unknown value or tensor type: not a file this loader reads
        raise BackendError(
            f"{key}.path={path} has a corrupt GGUF header ({e}); download or copy the file again"
        ) from None
    finally:
        buf.close()


def check_gguf(path: Path, key: str = "model") -> None:
    """One line for a GGUF file that is foreign, corrupt or cut short."""
    promised, size = gguf_size(path, key), path.stat().st_size
    if size < promised:
        raise BackendError(
            f"{key}.path={path} is cut short: {size} bytes where its header promises {promised}; "
            "download or copy it again"
        )


def safetensors_size(path: Path) -> int:
    """The size a safetensors file's header promises (8 + header + the end of its last tensor)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise BackendError(f"{path} is cut short ({len(raw)} bytes, no header); download or copy it again")
        n: int
        (n,) = struct.unpack("<Q", raw)
        text = f.read(min(n, 100_000_000))
    if len(text) < n:
        raise BackendError(f"{path} is cut short inside its header ({8 + len(text)} bytes); download or copy it again")
    try:
        header = json.loads(text)
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError):
        raise BackendError(
            f"{path} is not a safetensors file (its header does not parse); download or copy it again"
        ) from None
    return 8 + n + max(ends, default=0)


def check_checkpoint(folder: Path, key: str) -> None:
    """One line for a checkpoint folder with a weight file missing (one its index lists) or cut short."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            raise BackendError(f"{index} does not parse as a safetensors index; download or copy it again") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise BackendError(
                f"{key}.path={folder} is missing {', '.join(missing)} (listed in {index.name}); "
                "copy the whole checkpoint again"
            )
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    for f in files:
        promised, size = safetensors_size(f), f.stat().st_size
        if size < promised:
            raise BackendError(
                f"{f} is cut short: {size} bytes where its header promises {promised}; download or copy it again"
            )
