#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "batch-invariant attention (CPU)");
  m.def("rows_linear", &rows_linear, "row-invariant y = x W^T for a bfloat16 weight (CPU)");
  m.def("top_k_rows", &top_k_rows, "the k largest values of each row of float32 blocks (CPU)");
  m.def("decoder_layers", &decoder_layers, "a Llama model's decoder layers over a row KV cache");
}
