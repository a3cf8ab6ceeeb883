"""The lossless decoding backend: `Engine(load_model(ModelSpec()), "seed_stand").generate([GenRequest(...)])`.

Layers, each importing only those before it: base (errors, options, plug-ins, values), runtime (what
a forward needs: model files, kernels, the row KV cache, the prefix store, the runner), speculation
(draft trees, verification, acceptance, sampling, sequences, slots, the cost model), trees (static
shapes, tree policies, Sequoia), edd (the EDD model), drafters (the `Drafter` protocol and each
drafter, each declaring itself a plug-in), schedules (the speculative loop, SEED's rounds, hf); then
api (the decoder tables, kinds.py and decoders.py; the config; the engine; `ServerEngine`, the same
engine protocol over a server's OpenAI-compatible API). The modules beside this file are commands
(`python -m decoding.install`, `decoding.generate`, ...), on top of all of it. See docs/decoding.md.

What the searches, runs and benchmarks use is exported here (tests/test_layout.py holds `tot/` to it),
each name imported on first use: a command that only reads a run folder loads neither torch nor
transformers. The tuning tools that work on the internals (tuning.calibrate_tree, tuning.train_edd)
import further.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# module -> the names exported from it
EXPORTS: dict[str, tuple[str, ...]] = {
    "decoding.api.config": ("choices", "DecoderConfig"),
    "decoding.api.engine": ("Engine",),
    "decoding.api.kinds": ("DECODERS",),
    "decoding.api.server": ("FOLLOW_UPS_REFUSED", "ServerEngine", "ServerOptions"),
    "decoding.base.errors": ("BackendError", "ConfigError", "OutputError"),
    "decoding.base.options": ("as_float", "as_int", "as_list", "from_dict"),
    "decoding.base.plugins": ("ENV", "Lazy", "Plugin", "table", "unknown"),
    "decoding.base.run": ("run_sync",),
    "decoding.base.values": (
        "Completion",
        "DecodeStats",
        "GenRequest",
        "GenResult",
        "Group",
        "ScheduleStats",
        "TokenLogprob",
        "check_sampling",
        "host_line",
    ),
    "decoding.drafters.load": ("load_draft",),
    "decoding.install": ("install_on_first_use",),
    "decoding.runtime.memory": ("peak_rss_mb",),
    "decoding.runtime.models": (
        "activations_and_why",
        "int8_lacks",
        "load_model",
        "load_tokenizer",
        "LoadedModel",
        "resolve_activations",
        "resolve_attention",
        "resolve_device",
        "resolve_weights",
    ),
    "decoding.runtime.rows_linear": ("resolve_linear",),
    "decoding.runtime.spec": ("EMBEDDED", "is_gguf", "ModelSpec"),
    "decoding.runtime.collector": ("collector_off",),
}
_HOME = {name: module for module, names in EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'decoding' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # the same names, for type checkers (tests/test_layout.py holds the two equal)
    from decoding.api.config import DecoderConfig, choices
    from decoding.api.engine import Engine
    from decoding.api.kinds import DECODERS
    from decoding.api.server import FOLLOW_UPS_REFUSED, ServerEngine, ServerOptions
    from decoding.base.errors import BackendError, ConfigError, OutputError
    from decoding.base.options import as_float, as_int, as_list, from_dict
    from decoding.base.plugins import ENV, Lazy, Plugin, table, unknown
    from decoding.base.run import run_sync
    from decoding.base.values import (
        Completion,
        DecodeStats,
        GenRequest,
        GenResult,
        Group,
        ScheduleStats,
        TokenLogprob,
        check_sampling,
        host_line,
    )
    from decoding.drafters.load import load_draft
    from decoding.install import install_on_first_use
    from decoding.runtime.collector import collector_off
    from decoding.runtime.memory import peak_rss_mb
    from decoding.runtime.models import (
        LoadedModel,
        activations_and_why,
        int8_lacks,
        load_model,
        load_tokenizer,
        resolve_activations,
        resolve_attention,
        resolve_device,
        resolve_weights,
    )
    from decoding.runtime.rows_linear import resolve_linear
    from decoding.runtime.spec import EMBEDDED, ModelSpec, is_gguf
