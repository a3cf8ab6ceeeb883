"""The model architectures the project's own forward computes: one entry each, not branches through the layers.

An architecture is the `transformers` classes its checkpoints load as. Llama and Qwen2 share one
decoder layer (RMSNorm, rotary attention with grouped KV heads, a SiLU-gated MLP, residual adds);
Qwen2 adds biases on q, k and v, which the C++ layers (csrc/layers.cpp) take as any projection's
bias. What differs is the class of each module, which the native paths check before they replace
or skip the model's own modules (llama.py, norm.py, activation.py, static_forward.py). An
architecture is a plug-in: one module here (llama.py, qwen2.py) ending with its declaration
(`ArchitecturePlugin`, plugin.py).
"""

from __future__ import annotations

import torch

from decoding.base.plugins import table
from decoding.runtime.architectures.plugin import ArchitecturePlugin

# One module per architecture, `name` its config.model_type and the GGUF file's general.architecture;
# TOT_SPEC_PLUGINS adds modules from outside the project (decoding/base/plugins.py).
MODULES = ("decoding.runtime.architectures.llama", "decoding.runtime.architectures.qwen2")
ARCHITECTURES = table(ArchitecturePlugin, MODULES)


def rms_norms() -> tuple[type[torch.nn.Module], ...]:
    return tuple(a.rms_norm for a in ARCHITECTURES.values())


def mlps() -> tuple[type[torch.nn.Module], ...]:
    return tuple(a.mlp for a in ARCHITECTURES.values())


def of(model: torch.nn.Module) -> ArchitecturePlugin | None:
    """The model's entry, or None for a model the native paths do not compute: another class, or
    layers with a sliding attention window (Qwen2's use_sliding_window), which they do not mask."""
    arch = next((a for a in ARCHITECTURES.values() if type(model) is a.causal_lm), None)
    if arch is None or any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
        return None
    return arch


def names() -> str:
    return ", ".join(ARCHITECTURES)
