// Each row's argmax of a step's logits [N, V], float32 or bfloat16, read as they are: numpy's argmax
// needs float32, and casting a step's bfloat16 rows (32 x 49k) cost 6x the argmax itself (float32
// rows stay with numpy's, which runs at memory speed).
//
// torch's semantics exactly: the first index of the row's maximum, a NaN counting as the maximum (its
// first index), -0 equal to +0. Eight lanes each keep their largest value and where they first saw it
// (a strict greater-than moves it); the lanes then give the largest value and, among lanes holding it,
// the smallest index. A row holding a NaN is scanned again for its first one.
//
// Registered as torch.ops.tot_sampling.argmax_rows beside gumbel.cpp, outside the forward's digest.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"

namespace {

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(value_at(row, i))) return i;
  return -1;
}

template <typename T>
int64_t argmax_scalar(const T* row, int64_t n) {
  int64_t best = 0;
  float most = value_at(row, 0);
  for (int64_t i = 1; i < n; ++i) {
    const float v = value_at(row, i);
    if (std::isnan(v)) return i;
    if (v > most) most = v, best = i;
  }
  return std::isnan(most) ? 0 : best;
}

#if defined(__AVX2__)
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  if (n < 16) return argmax_scalar(row, n);
  __m256 most = load8(row);
  __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i at = where;
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_cmp_ps(most, most, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    at = _mm256_add_epi32(at, step);
    const __m256 v = load8(row + i);
    const __m256 more = _mm256_cmp_ps(v, most, _CMP_GT_OQ);
    most = _mm256_blendv_ps(most, v, more);
    where = _mm256_blendv_epi8(where, at, _mm256_castps_si256(more));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return first_nan(row, n);
  alignas(32) float lanes[8];
  alignas(32) int32_t index[8];
  _mm256_store_ps(lanes, most);
  _mm256_store_si256(reinterpret_cast<__m256i*>(index), where);
  float top = lanes[0];
  int64_t best = index[0];
  for (int l = 1; l < 8; ++l)
    if (lanes[l] > top || (lanes[l] == top && index[l] < best)) top = lanes[l], best = index[l];
  for (; i < n; ++i) {  // the tail: later than every lane's index, so only a larger value moves it
    const float v = value_at(row, i);
    if (std::isnan(v)) return i;
    if (v > top) top = v, best = i;
  }
  return best;
}
#else
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  return argmax_scalar(row, n);
}
#endif

std::vector<int64_t> argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: contiguous CPU logits [N, V]");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "argmax_rows: a row's length fits 31 bits");
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || logits.scalar_type() == at::kFloat, "argmax_rows: float32 or bfloat16 logits");
  const int64_t n = logits.size(0), v = logits.size(1);
  std::vector<int64_t> out(n);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out[r] = bf16 ? argmax_row(logits.data_ptr<at::BFloat16>() + r * v, v)
                    : argmax_row(logits.data_ptr<float>() + r * v, v);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tot_sampling, m) { m.def("argmax_rows(Tensor logits) -> int[]", &argmax_rows); }
