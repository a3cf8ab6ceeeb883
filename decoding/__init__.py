"""The lossless decoding backend: `Engine(load_model(ModelSpec()), "seed_stand").generate([GenRequest(...)])`.

Layers, each importing only those before it: core (values, the model runner over a row KV cache,
verification, acceptance), trees (static shapes, tree policies, Sequoia), edd (the EDD model),
drafters (the `Drafter` protocol and each drafter), schedules (the speculative loop, SEED, hf); then
the tables (decoders.py), the config (config.py) and the engine. `ServerEngine` is the same engine
protocol over a server's OpenAI-compatible API (server.py). See docs/decoding.md.
"""

from decoding.config import DecoderConfig
from decoding.core.models import ModelSpec, load_model, load_tokenizer
from decoding.core.values import DecodeStats, GenRequest, GenResult
from decoding.drafters.load import load_draft
from decoding.engine import Engine
from decoding.server import ServerEngine, ServerOptions

__all__ = [
    "DecodeStats",
    "DecoderConfig",
    "Engine",
    "GenRequest",
    "GenResult",
    "ModelSpec",
    "ServerEngine",
    "ServerOptions",
    "load_draft",
    "load_model",
    "load_tokenizer",
]
