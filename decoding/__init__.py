"""The lossless decoding backend: `Engine(load_model(ModelSpec()), "seed_stand").generate([GenRequest(...)])`.

Layers, each importing only those before it: base (errors, options, plug-ins, values), runtime (what
a forward needs: model files, kernels, the row KV cache, the prefix store, the runner), speculation
(draft trees, verification, acceptance, sampling, sequences, slots, the cost model), trees (static
shapes, tree policies, Sequoia), edd (the EDD model), drafters (the `Drafter` protocol and each
drafter, each declaring itself a plug-in), schedules (the speculative loop, SEED's rounds, hf); then
api (the decoder tables, kinds.py and decoders.py; the config; the engine; `ServerEngine`, the same
engine protocol over a server's OpenAI-compatible API). The modules beside this file are commands
(`python -m decoding.install`, `decoding.generate`, ...), on top of all of it. See docs/decoding.md.

What the searches, runs and benchmarks use is exported here (tests/test_layout.py holds `tot/` to
it); the tuning tools that work on the internals (tuning.calibrate_tree, tuning.train_edd) import further.
"""

from decoding.api.config import DecoderConfig, choices
from decoding.api.engine import Engine, run_sync
from decoding.api.kinds import DECODERS
from decoding.api.server import FOLLOW_UPS_REFUSED, ServerEngine, ServerOptions
from decoding.base.errors import BackendError, ConfigError, OutputError
from decoding.base.options import as_float, as_int, as_list, from_dict
from decoding.base.plugins import ENV, Lazy, Plugin, table, unknown
from decoding.base.values import Completion, DecodeStats, GenRequest, GenResult, Group, host_line
from decoding.drafters.load import load_draft
from decoding.runtime.memory import peak_rss_mb
from decoding.runtime.models import (
    EMBEDDED,
    LoadedModel,
    ModelSpec,
    activations_and_why,
    int8_lacks,
    is_gguf,
    load_model,
    load_tokenizer,
    resolve_activations,
    resolve_attention,
    resolve_device,
    resolve_weights,
)
from decoding.runtime.rows_linear import resolve_linear
from decoding.speculation.heap import frozen

__all__ = [
    "DECODERS",
    "EMBEDDED",
    "ENV",
    "FOLLOW_UPS_REFUSED",
    "BackendError",
    "Completion",
    "ConfigError",
    "DecodeStats",
    "DecoderConfig",
    "Engine",
    "GenRequest",
    "GenResult",
    "Group",
    "Lazy",
    "LoadedModel",
    "ModelSpec",
    "OutputError",
    "Plugin",
    "ServerEngine",
    "ServerOptions",
    "activations_and_why",
    "as_float",
    "as_int",
    "as_list",
    "choices",
    "from_dict",
    "frozen",
    "host_line",
    "int8_lacks",
    "is_gguf",
    "load_draft",
    "load_model",
    "load_tokenizer",
    "peak_rss_mb",
    "resolve_activations",
    "resolve_attention",
    "resolve_device",
    "resolve_linear",
    "resolve_weights",
    "run_sync",
    "table",
    "unknown",
]
