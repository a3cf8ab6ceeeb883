// The k largest values of each row of several float32 blocks (decoding/speculation/sampling.py `top_k_rows`):
// what a drafter that learns from the target's distributions reads at every committed position.
//
// One pass over each row: a value is compared with the smallest of the k kept so far, 16 at a time,
// and only a vector holding a larger one goes to the scalar insertion (about k ln(V / k) of them in a
// row of V values in no particular order). The rows are read where they are, with no copy into one
// batch: torch's top-k over a concatenation cost 0.6 ms a step of ten rows in a ToT run, much of it
// the fresh 2 MB the concatenation wrote.
#include <ATen/Parallel.h>

#include "kernels.h"

#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

void row_top_k(const float* x, int64_t n, int64_t k, float* vals, int64_t* ids) {
  // The first k values, in order (k distinct tokens even where a row is mostly minus infinity).
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = -std::numeric_limits<float>::infinity();
    ids[j] = -1;
  }
  for (int64_t j = 0; j < k; ++j) {
    int64_t at = j;
    while (at > 0 && vals[at - 1] < x[j]) {
      vals[at] = vals[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = x[j];
    ids[at] = j;
  }
  int64_t i = k;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ);
    while (above) {
      int lane = __builtin_ctz(above);
      above &= above - 1;
      if (x[i + lane] > vals[k - 1]) insert(vals, ids, k, x[i + lane], i + lane);
    }
  }
#endif
  for (; i < n; ++i)
    if (x[i] > vals[k - 1]) insert(vals, ids, k, x[i], i);
}

}  // namespace

std::vector<at::Tensor> top_k_rows(const std::vector<at::Tensor>& blocks, int64_t k) {
  int64_t rows = 0, n = -1;
  std::vector<const float*> starts;
  for (const auto& b : blocks) {
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == at::kFloat && b.device().is_cpu(),
                "top_k_rows: float32 CPU blocks [rows, V]");
    TORCH_CHECK(b.stride(1) == 1, "top_k_rows: each row must be contiguous");
    TORCH_CHECK(n < 0 || b.size(1) == n, "top_k_rows: blocks of one width");
    n = b.size(1);
    for (int64_t r = 0; r < b.size(0); ++r) starts.push_back(b.data_ptr<float>() + r * b.stride(0));
    rows += b.size(0);
  }
  TORCH_CHECK(k >= 1 && k <= n, "top_k_rows: k must be in [1, V]");
  auto values = at::empty({rows, k}, at::kFloat);
  auto ids = at::empty({rows, k}, at::kLong);
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_top_k(starts[r], n, k, vp + r * k, ip + r * k);
  });
  return {values, ids};
}
