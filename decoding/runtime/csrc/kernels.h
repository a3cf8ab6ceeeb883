// The CPU kernels of decoding/runtime/kernels.py: one extension module, bound in module.cpp.
#pragma once
// ATen alone, not torch/extension.h (pybind11 and torch's C++ API: 17 s of parsing a file, 4.6 with ATen);
// module.cpp, the bindings, includes that one.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Widen n bfloat16 values to float through their bits (a shift the compiler vectorizes).
inline void widen_bfloat16(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
}

// exp(x) for x <= 0 (Cephes expf's range reduction and polynomial): plain float arithmetic, so the
// compiler's vector and scalar code give the same bits (attention's softmax, the fixed SiLU).
inline float fixed_exp(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(std::max(n, -126.0f)) + 127) << 23;
  return x < -87.0f ? 0.0f : p * __builtin_bit_cast(float, bits);
}

// SiLU, x / (1 + exp(-x)), with fixed_exp of -|x| only (for x < 0 as x e / (1 + e), e = exp(x)):
// the same bits in a vector lane or alone (csrc/activation.cpp).
inline float fixed_silu(float x) {
  const float e = fixed_exp(-std::fabs(x));
  return x >= 0.0f ? x / (1.0f + e) : (x * e) / (1.0f + e);
}

// One row of RMSNorm (csrc/norm.cpp), in x's type T with sums in float:
//     r = 1 / sqrt(sum(x^2) / H + eps),  y = T(weight * T(x * r))
// the squares summed in 8 lanes (element i into lane i mod 8) in order, the lanes then added in a fixed
// tree, so a row's bits depend on that row alone. q4_int8.cpp normalizes rows with it before quantizing.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= h; i += 8)
    for (int64_t l = 0; l < 8; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lanes[l] += v * v;
    }
  float tail = 0.0f;
  for (; i < h; ++i) tail += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float sum = (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))) + tail;
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
  for (int64_t j = 0; j < h; ++j)
    out[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * r)));
}

at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mask, at::Tensor rows,
                     double scale, at::Tensor live, at::Tensor share, at::Tensor tables, int64_t length);

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

std::vector<at::Tensor> decoder_layers(at::Tensor h, const std::vector<at::Tensor>& weights, double eps,
                                       int64_t head_dim, double scaling, const at::Tensor& cos,
                                       const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                       const std::vector<at::Tensor>& values, const at::Tensor& rows,
                                       const at::Tensor& slots, int64_t kv_len, const at::Tensor& mask,
                                       const at::Tensor& kv_rows, const at::Tensor& share, const at::Tensor& tables,
                                       int64_t capture, const at::Tensor& real, bool rows_kernel,
                                       bool rows_norm, bool fixed_silu, int64_t qkv_levels,
                                       const std::vector<int64_t>& k_blocks);

// x's rows in `levels` int8 levels: 1 (llama.cpp's rule) or 2 (the first's residual quantized again),
// with a scale per 32 inputs, or per `k_block` (32 or 256: a super-block) where the weights are a
// K-quant's (compact factors). q4_int8_linear and q4_int8_fused take either format, told apart by the
// factors' shape.
at::Tensor q4_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                          const at::Tensor& bias, int64_t levels, int64_t k_block);
at::Tensor q8_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& bias, int64_t levels, int64_t k_block);
// q4_int8_linear as csrc/layers.cpp calls it on float32 rows: with `norm` (a weight [K]; undefined:
// none) each row normalized first as rms_norm_rows does, and with `residual` ([.., N] float32;
// undefined: none) the result residual + y, the model's residual add: the bits of the separate ops
// without their buffers and dispatch.
at::Tensor q4_int8_fused(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                         const at::Tensor& bias, int64_t levels, int64_t k_block, const at::Tensor& norm, double eps,
                         const at::Tensor& residual);
// codes, scales a `block` (32 or 256) and per 32: d * sum(q) (block 32) or sum(q) (256); with two
// levels the second's codes and scales (and sums, 256)
std::vector<at::Tensor> q4_int8_quantize(const at::Tensor& x, int64_t levels, int64_t block);
const char* q4_int8_path();
double q4_int8_peak(int64_t iterations);
double q4_int8_tile_peak(int64_t iterations);

// SiLU with fixed_silu (the model's act_fn where it is decoding/runtime/activation.py's FixedSiLU).
at::Tensor silu_fixed(const at::Tensor& x);
// fixed_silu(gate) * up for float32 [.., I] inputs of any row stride (a joined product's halves):
// FixedSiLU's output times up, with its one rounding, into a contiguous buffer.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);
