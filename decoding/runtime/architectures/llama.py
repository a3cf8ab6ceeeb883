"""Llama: the architecture the native layers (llama.py, csrc/layers.cpp) were written for."""

from transformers.models.llama import modeling_llama

from decoding.runtime.architectures.plugin import ArchitecturePlugin

PLUGIN = ArchitecturePlugin(
    name="llama",
    build=modeling_llama.LlamaForCausalLM,
    decoder_layer=modeling_llama.LlamaDecoderLayer,
    rms_norm=modeling_llama.LlamaRMSNorm,
    mlp=modeling_llama.LlamaMLP,
)
