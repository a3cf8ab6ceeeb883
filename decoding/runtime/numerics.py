"""What `decoding.activation_error` measured for a GGUF file, kept for `model.activations=auto`.

auto runs int8 activations only where they were measured to cost no more accuracy than llama.cpp's
own int8 path on the same file (mean KL from the float32 dequantization no larger than llama.cpp's)
and to keep the perplexity within 1% of the float path's; int8_256 (a scale per 256 inputs on the
K-quant layers, llama.cpp's own rule, but for the few inputs the record names whose scale per 256
alone moved the logits: those keep a scale per 32) where its mean KL and perplexity were measured no
worse than llama.cpp's. A record is one JSON file per GGUF file,
named by the file's content (its SHA-256), holding the arithmetic it measured (`arithmetic()`): a
record of other kernels, hidden-state or cache types is not read. The records of the files the project
installs (the embedded and packaged models) ship with it in decoding/runtime/records/ (`python -m
decoding.activation_error model=NAME ship=true` writes them), so a fresh machine runs int8 on them;
a user's own measurements go to the cache folder and are read first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from decoding.runtime import kernels
from decoding.runtime.quant import INT8_CACHE, INT8_HIDDEN, TWO_LEVEL_INPUTS

PERPLEXITY_WITHIN = 0.01  # int8's perplexity at most this much above the float path's


@dataclass(frozen=True)
class Numerics:
    """Mean KL from float32 (nats a token) and perplexity, per way, on one file's held text."""

    int8_kl: float
    int8_perplexity: float
    float_perplexity: float
    llama_cpp_kl: float | None  # None: llama-cpp-python was not installed
    llama_cpp_perplexity: float | None = None
    int8_256_kl: float | None = None  # None: the file has no K-quant layer whose input int8_256 changes
    int8_256_perplexity: float | None = None
    # the int8 layers int8_256 leaves a scale per 32 (module names), measured with them so; the rest of
    # the K-quant layers take one per 256 (decoding.activation_error's search for heavy inputs)
    int8_256_per_32: tuple[str, ...] = ()

    def ok(self, way: str, kl: float, perplexity: float) -> tuple[bool, str]:
        """Whether auto may run `way` (int8 or int8_256, with its KL and perplexity) here, and why not:
        int8's KL no worse than llama.cpp's and its perplexity within 1% of float's; int8_256's KL and
        perplexity no worse than llama.cpp's (the same rule of activations, a scale per 256 inputs)."""
        if self.llama_cpp_kl is None:
            return False, f"no llama.cpp figure to compare {way}'s KL with (install llama-cpp-python)"
        if kl > self.llama_cpp_kl:
            return False, f"{way}'s mean KL {kl:.5f} is above llama.cpp's {self.llama_cpp_kl:.5f}"
        if way == "int8_256":
            if self.llama_cpp_perplexity is None or perplexity > self.llama_cpp_perplexity:
                return False, f"{way}'s perplexity {perplexity:.4f} is above llama.cpp's {self.llama_cpp_perplexity}"
            return True, f"{way}'s KL and perplexity are no worse than llama.cpp's"
        if perplexity > self.float_perplexity * (1 + PERPLEXITY_WITHIN):
            over = perplexity / self.float_perplexity - 1
            return False, f"{way}'s perplexity is {over:.1%} above float's (at most {PERPLEXITY_WITHIN:.0%})"
        return True, f"{way}'s KL is no worse than llama.cpp's and its perplexity within 1% of float's"

    def choice(self, tiles: bool) -> tuple[str, str]:
        """What auto runs and why: int8_256 where it passes (fewer float operations a product) and the
        kernel has no AMX tiles (which run int8's scale per 32, not the super-blocks), else int8 where
        it passes, else float."""
        ok, why = self.ok("int8", self.int8_kl, self.int8_perplexity)
        if not ok:
            return "float", why
        if self.int8_256_kl is None or self.int8_256_perplexity is None:
            return "int8", why
        ok_256, why_256 = self.ok("int8_256", self.int8_256_kl, self.int8_256_perplexity)
        if ok_256 and not tiles:
            return "int8_256", why_256
        return "int8", f"{why}; int8_256 not: " + (why_256 if not ok_256 else "the AMX tiles run int8's format")


def arithmetic() -> str:
    """What the int8 path's outputs depend on besides the file: the kernels' sources, the types of the
    hidden states between the layers and of the KV cache, and which inputs are quantized in two levels."""
    hidden, cache = (str(t).removeprefix("torch.") for t in (INT8_HIDDEN, INT8_CACHE))
    return f"kernels {kernels.source_digest()}, hidden {hidden}, cache {cache}, two levels {'/'.join(TWO_LEVEL_INPUTS)}"


SHIPPED = Path(__file__).parent / "records"  # the records of the files the project installs
SHA256 = re.compile(r"[0-9a-f]{64}")


def file_digest(gguf: Path, cache: Path, memo_ok: bool = True) -> str:
    """The file's SHA-256, computed once per path, size and modification time (kept in `cache`:
    a gigabyte takes seconds to hash, a model loads in about as long); `memo_ok` False: hashed again
    (the memo is a claim, rewritten where it was wrong)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache / "digests" / key
    with contextlib.suppress(OSError, UnicodeDecodeError):
        known = memo.read_text().strip()
        if memo_ok and SHA256.fullmatch(known):  # anything else (a damaged memo) is hashed again and rewritten
            return known
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
        write_atomic(memo, digest.hexdigest())
    return digest.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def record_path(folder: Path, digest: str) -> Path:
    return folder / f"{digest[:16]}.json"


def write(folder: Path, gguf: Path, numerics: Numerics, digest: str) -> Path:
    """The file's record in `folder` (the cache's numerics/ folder, or SHIPPED)."""
    path = record_path(folder, digest)
    record = {"gguf": gguf.name, "sha256": digest, "arithmetic": arithmetic(), **asdict(numerics)}
    write_atomic(path, json.dumps(record, indent=2) + "\n")
    return path


def read(cache: Path, gguf: Path) -> Numerics | None:
    """The file's record of this arithmetic (the cache's, else the shipped one), or None. A memo'd
    digest no record knows is checked by hashing the file again before the answer is None: a wrong
    memo would otherwise turn auto to float for a file that has a record."""
    digest = file_digest(gguf, cache)
    found = _lookup(cache, digest)
    if found is None:
        fresh = file_digest(gguf, cache, memo_ok=False)
        if fresh != digest:
            found = _lookup(cache, fresh)
    return found


def _lookup(cache: Path, digest: str) -> Numerics | None:
    for folder in (cache / "numerics", SHIPPED):
        record = _read(record_path(folder, digest), digest)
        if record is not None:
            return record
    return None


def _read(path: Path, digest: str) -> Numerics | None:
    try:
        data = json.loads(path.read_text())
        if data.get("arithmetic") != arithmetic() or data.get("sha256") != digest:
            return None
        fields = {k: data[k] for k in Numerics.__dataclass_fields__}
        return Numerics(**{**fields, "int8_256_per_32": tuple(fields["int8_256_per_32"])})
    except (OSError, ValueError, KeyError, TypeError):
        return None
