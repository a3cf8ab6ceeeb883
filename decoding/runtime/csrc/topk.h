// A row's k largest values and its sum of exp(x - most), read where the row lies (topk.cpp's top_k_rows and
// log_rows, draw_top.cpp's draw_top_rows). Not part of the forward's digest.
#pragma once

#include "kernels.h"
#include "rows.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace topk {

// Insert (v, i) into the descending run vals[0..k) (v larger than vals[k - 1]).
inline void insert(float* vals, int64_t* ids, int64_t k, float v, int64_t i) {
  int64_t j = k - 1;
  while (j > 0 && vals[j - 1] < v) {
    vals[j] = vals[j - 1];
    ids[j] = ids[j - 1];
    --j;
  }
  vals[j] = v;
  ids[j] = i;
}

// A row of logits read divided by its temperature; DIV false for a temperature of 1 (x / 1 is x, so the
// same bits without a division an element: most rows, greedy ones and distributions).
template <typename T, bool DIV>
struct Scaled {
  const T* x;
  float t;
  float at(int64_t i) const { return DIV ? value_at(x, i) / t : value_at(x, i); }
#if defined(__AVX2__)
  __m256 load(int64_t i) const { return DIV ? _mm256_div_ps(load8(x + i), _mm256_set1_ps(t)) : load8(x + i); }
#endif
#if defined(__AVX512F__)
  __m512 load16(int64_t i) const { return DIV ? _mm512_div_ps(load16f(x + i), _mm512_set1_ps(t)) : load16f(x + i); }
#endif
};

template <typename R>
void row_top_k(const R& x, int64_t n, int64_t k, float* vals, int64_t* ids) {
  // The first k values, in order (k distinct tokens even where a row is mostly minus infinity).
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = -std::numeric_limits<float>::infinity();
    ids[j] = -1;
  }
  for (int64_t j = 0; j < k; ++j) {
    int64_t at = j;
    const float v = x.at(j);
    while (at > 0 && vals[at - 1] < v) {
      vals[at] = vals[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = v;
    ids[at] = j;
  }
  int64_t i = k;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    int above = _mm256_movemask_ps(_mm256_cmp_ps(x.load(i), _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      const float v = x.at(i + lane);
      if (v > vals[k - 1]) insert(vals, ids, k, v, i + lane);
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = x.at(i);
    if (v > vals[k - 1]) insert(vals, ids, k, v, i);
  }
}

#if defined(__AVX2__)
// kernels.h's fixed_exp in 8 lanes, operation for operation (no fused multiply-add): the same bits.
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  // std::max(n, -126) keeps n where n is not below -126 (a NaN n stays NaN: max_ps(-126, n) returns n).
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_max_ps(_mm256_set1_ps(-126.0f), n)), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), value);
}
#endif

#if defined(__AVX512F__)
// exp8 in 16 lanes, operation for operation: the same bits a lane (1.4x exp8's rate on Zen 4).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_max_ps(_mm512_set1_ps(-126.0f), n)), _mm512_set1_epi32(127)), 23);
  const __m512 value = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), value);
}
#endif

// sum_i exp(x_i - most), in 8 lanes (element i into lane i mod 8) added in a fixed tree: `add16` / `add8`
// for each 16 / 8 values in order while as many are left, `add` for each one after, then `total`. add16
// is two add8 (its 16 exponentials at once, then their halves added in turn): the same bits.
struct ExpSum {
  float most;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
#endif
  float lanes[8] = {};
  float tail = 0.0f;

  template <typename R>
  void add8(const R& x, int64_t i) {
#if defined(__AVX2__)
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(x.load(i), _mm256_set1_ps(most))));
#else
    for (int64_t l = 0; l < 8; ++l) lanes[l] += fixed_exp(x.at(i + l) - most);
#endif
  }
  template <typename R>
  void add16(const R& x, int64_t i) {
#if defined(__AVX512F__)
    const __m512 e = exp16(_mm512_sub_ps(x.load16(i), _mm512_set1_ps(most)));
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
#else
    add8(x, i);
    add8(x, i + 8);
#endif
  }
  void add(float v) { tail += fixed_exp(v - most); }
  float total() {
#if defined(__AVX2__)
    _mm256_storeu_ps(lanes, acc);
#endif
    return (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))) + tail;
  }
};

template <typename R>
float row_exp_sum(const R& x, int64_t n, float most) {
  ExpSum sum{most};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) sum.add16(x, i);
  for (; i + 8 <= n; i += 8) sum.add8(x, i);
  for (; i < n; ++i) sum.add(x.at(i));
  return sum.total();
}

// The top k's softmax from the row's largest value and sum of exp(x - most), in place, and what was read
// in `read`: most, the sum's log, the top k values as read.
inline void normalise_top(float* vals, int64_t k, float most, float sum, float* read) {
  read[0] = most;
  read[1] = std::log(sum);
  for (int64_t j = 0; j < k; ++j) read[2 + j] = vals[j];
  for (int64_t j = 0; j < k; ++j) vals[j] = fixed_exp(vals[j] - most) / sum;
}

// With `normalise`, the row's softmax at its top k, and in `read` the row's largest value, the log of
// its sum of exp(x - most) and its top k values as read (x / t): what log_row computes from the same
// operations, so a step's log-probabilities of these rows need no second pass (logprobs.py `RowReading`).
template <typename R>
void top_row(const R& x, int64_t n, int64_t k, bool normalise, float* vals, int64_t* ids, float* read) {
  row_top_k(x, n, k, vals, ids);
  if (normalise) normalise_top(vals, k, vals[0], row_exp_sum(x, n, vals[0]), read);
}

}  // namespace topk
