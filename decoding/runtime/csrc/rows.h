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
