"""Qwen2: Llama's decoder layer with biases on q, k and v (the C++ layers take any projection's bias)."""

from transformers.models.qwen2 import modeling_qwen2

from decoding.runtime.architectures.plugin import ArchitecturePlugin

PLUGIN = ArchitecturePlugin(
    name="qwen2",
    build=modeling_qwen2.Qwen2ForCausalLM,
    decoder_layer=modeling_qwen2.Qwen2DecoderLayer,
    rms_norm=modeling_qwen2.Qwen2RMSNorm,
    mlp=modeling_qwen2.Qwen2MLP,
)
