#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "batch-invariant attention (CPU)");
  m.def("rows_linear", &rows_linear, "row-invariant y = x W^T for a bfloat16 weight (CPU)");
  m.def("q4_int8_linear", &q4_int8_linear, "y = x W^T, W in 4-bit blocks, x quantized to int8 per block (CPU)");
  m.def("q8_int8_linear", &q8_int8_linear, "y = x W^T, W in Q8_0 blocks, x quantized to int8 per block (CPU)");
  m.def(
      "q4_int8_fused",
      [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min, const at::Tensor& bias,
         int64_t levels, int64_t k_block, const c10::optional<at::Tensor>& norm, double eps,
         const c10::optional<at::Tensor>& residual) {
        return q4_int8_fused(x, codes, scale_min, bias, levels, k_block, norm.value_or(at::Tensor()), eps,
                             residual.value_or(at::Tensor()));
      },
      "q4_int8_linear after an RMSNorm of the rows (norm: its weight, or None), plus a residual (or None)");
  m.def("q4_int8_quantize", &q4_int8_quantize, "x's rows quantized to int8 per block of 32 or 256, in 1 or 2 levels");
  m.def("q4_int8_path", &q4_int8_path, "the instructions q4_int8_linear was built for");
  m.def("q4_int8_peak", &q4_int8_peak, "multiply-adds a second of a tight loop of q4_int8_linear's block dot product");
  m.def("q4_int8_tile_peak", &q4_int8_tile_peak, "the same for its AMX tiles; 0 without them");
  m.def("silu_fixed", &silu_fixed, "SiLU with a fixed exp: one set of bits in every lane (CPU)");
  m.def("silu_mul", &silu_mul, "silu_fixed(gate) * up, gate and up read in place (CPU)");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm per row in one pass (CPU)");
  m.def("decoder_layers", &decoder_layers, "a Llama model's decoder layers over a row KV cache");
}
