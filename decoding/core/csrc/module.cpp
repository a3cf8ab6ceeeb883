#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "batch-invariant attention (CPU)");
  m.def("decoder_layers", &decoder_layers, "a Llama model's decoder layers over a row KV cache");
}
