"""The model architectures the project's own forward computes: one entry each, not branches through the layers.

An architecture is the `transformers` classes its checkpoints load as. Llama and Qwen2 share one
decoder layer (RMSNorm, rotary attention with grouped KV heads, a SiLU-gated MLP, residual adds);
Qwen2 adds biases on q, k and v, which the C++ layers (csrc/layers.cpp) take as any projection's
bias. What differs is the class of each module, which the native paths check before they replace
or skip the model's own modules (llama.py, norm.py, activation.py, static_forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2


@dataclass(frozen=True)
class Architecture:
    """A causal LM family by its `transformers` module classes."""

    name: str  # config.model_type, and the GGUF file's general.architecture
    causal_lm: type[torch.nn.Module]
    decoder_layer: type[torch.nn.Module]
    rms_norm: type[torch.nn.Module]
    mlp: type[torch.nn.Module]


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture(
            "llama",
            modeling_llama.LlamaForCausalLM,
            modeling_llama.LlamaDecoderLayer,
            modeling_llama.LlamaRMSNorm,
            modeling_llama.LlamaMLP,
        ),
        Architecture(
            "qwen2",
            modeling_qwen2.Qwen2ForCausalLM,
            modeling_qwen2.Qwen2DecoderLayer,
            modeling_qwen2.Qwen2RMSNorm,
            modeling_qwen2.Qwen2MLP,
        ),
    )
}
RMS_NORMS = tuple(a.rms_norm for a in ARCHITECTURES.values())
MLPS = tuple(a.mlp for a in ARCHITECTURES.values())


def of(model: torch.nn.Module) -> Architecture | None:
    """The model's entry, or None for a model the native paths do not compute: another class, or
    layers with a sliding attention window (Qwen2's use_sliding_window), which they do not mask."""
    arch = next((a for a in ARCHITECTURES.values() if type(model) is a.causal_lm), None)
    if arch is None or any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
        return None
    return arch


def names() -> str:
    return ", ".join(ARCHITECTURES)
