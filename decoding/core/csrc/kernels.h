// The CPU kernels of decoding/core/kernels.py: one extension module, bound in module.cpp.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

// Widen n bfloat16 values to float through their bits (a shift the compiler vectorizes).
inline void widen_bfloat16(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
}

torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, torch::Tensor rows,
                     double scale, torch::Tensor live);

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

std::vector<at::Tensor> decoder_layers(at::Tensor h, const std::vector<at::Tensor>& weights, double eps,
                                       int64_t head_dim, double scaling, const at::Tensor& cos,
                                       const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                       const std::vector<at::Tensor>& values, const at::Tensor& rows,
                                       const at::Tensor& slots, int64_t kv_len, const at::Tensor& mask,
                                       const at::Tensor& kv_rows, int64_t capture, const at::Tensor& real, bool rows_kernel,
                                       bool rows_norm);

at::Tensor q4_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                          const at::Tensor& bias);
at::Tensor q8_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& bias);
std::vector<at::Tensor> q4_int8_quantize(const at::Tensor& x);
const char* q4_int8_path();
double q4_int8_peak(int64_t iterations);

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);

std::vector<at::Tensor> top_k_rows(const std::vector<at::Tensor>& blocks, int64_t k);
