// Reading a step's logits rows as they lie, float32 or bfloat16, for the sampling kernels (argmax.cpp,
// topk.cpp): a value, and 8 of them in an AVX2 register. Not part of the forward's digest.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

inline float value_at(const float* row, int64_t i) { return row[i]; }

inline float value_at(const at::BFloat16* row, int64_t i) { return static_cast<float>(row[i]); }

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

#if defined(__AVX512F__)
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16f(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

#include <vector>

// A row [n] of float32 or bfloat16 logits as float32 divided by t (IEEE division, torch's `logits / t`):
// the row itself where it is float32 and t is 1, else `buffer` filled with it.
inline const float* divided_row(const void* data, bool bf16, int64_t n, float t, std::vector<float>& buffer) {
  if (!bf16 && t == 1.0f) return static_cast<const float*>(data);
  buffer.resize(n);
  if (bf16) {
    const at::BFloat16* x = static_cast<const at::BFloat16*>(data);
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(x[i]) / t;
  } else {
    const float* x = static_cast<const float*>(data);
    for (int64_t i = 0; i < n; ++i) buffer[i] = x[i] / t;
  }
  return buffer.data();
}

// One op's check of a row it reads: 1-D, float32 or bfloat16, on the CPU, non-empty and contiguous.
inline void check_logits_row(const at::Tensor& row, const char* op) {
  TORCH_CHECK(row.dim() == 1 && (row.scalar_type() == at::kFloat || row.scalar_type() == at::kBFloat16) &&
                  row.device().is_cpu(),
              op, ": one float32 or bfloat16 CPU row of logits");
  TORCH_CHECK(row.size(0) > 0 && row.stride(0) == 1, op, ": a non-empty contiguous row");
}
