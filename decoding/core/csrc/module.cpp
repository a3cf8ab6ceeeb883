#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "batch-invariant attention (CPU)");
  m.def("rows_linear", &rows_linear, "row-invariant y = x W^T for a bfloat16 weight (CPU)");
  m.def("top_k_rows", &top_k_rows, "the k largest values of each row of float32 blocks (CPU)");
  m.def("q4_int8_linear", &q4_int8_linear, "y = x W^T, W in 4-bit blocks, x quantized to int8 per block (CPU)");
  m.def("q8_int8_linear", &q8_int8_linear, "y = x W^T, W in Q8_0 blocks, x quantized to int8 per block (CPU)");
  m.def("q4_int8_quantize", &q4_int8_quantize, "x's rows quantized to int8 per block of 32: codes, scales, sums");
  m.def("q4_int8_path", &q4_int8_path, "the instructions q4_int8_linear was built for");
  m.def("q4_int8_peak", &q4_int8_peak, "multiply-adds a second of a tight loop of q4_int8_linear's block dot product");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm per row in one pass (CPU)");
  m.def("decoder_layers", &decoder_layers, "a Llama model's decoder layers over a row KV cache");
}
