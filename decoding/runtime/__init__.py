"""The model runtime: what a forward needs, on a CPU and on CUDA. Model files and loading (GGUF blocks,
checkpoints, the packaged models), the architecture plug-ins, quantized weights and the C++ kernels
(csrc/), the invariant attention, the row-pooled KV cache and the prefix store, `ModelRunner` (a
model's forward over that pool, taking rows laid out by `packing`), the bucketed forward and CUDA
graphs, and where a forward's time goes.

It imports `decoding.base` alone: nothing of speculation (draft trees, sampling, sequences).
"""
