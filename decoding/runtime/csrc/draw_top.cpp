// torch.ops.tot_sampling.draw_top_rows: a step's sampled rows without a draft (decoding/speculation/verify.py
// `host_targets`), each row's Gumbel-max draw (gumbel.h; gumbel_pick_rows' token) with its top k, their
// softmax and what top_k_rows reads of the row (topk.h), in one call: the row is divided by its
// temperature once, and the sum of exp(x - most) rides along with the draw's pass over it. As two calls
// the row was divided three times and read five (two threads' dispatch apiece), 0.29 ms a row of a
// 151,936 vocabulary on one Zen 4 core; every value is the two ops' own, bit for bit.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gumbel.h"
#include "rows.h"
#include "topk.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace {

// The draw and the top k of one row s [n] (already divided by its temperature).
int64_t draw_top(const float* s, int64_t n, uint64_t start, int64_t k, float* vals, int64_t* ids, float* read) {
  const topk::Scaled<float, false> x{s, 1.0f};
  topk::row_top_k(x, n, k, vals, ids);
  topk::ExpSum sum{vals[0]};
  int64_t i = 0;
  const int64_t pick = gumbel::pick_row(s, n, start, [&](int64_t lo, int64_t m) {
    const int64_t end = lo + m;
    for (; i + 16 <= end; i += 16) sum.add16(x, i);
    for (; i + 8 <= end; i += 8) sum.add8(x, i);
  });
  for (; i < n; ++i) sum.add(s[i]);
  topk::normalise_top(vals, k, vals[0], sum.total(), read);
  return pick;
}

// Rows [V] of raw logits, each drawn with its noise stream keys[r] over its logits divided by
// temperatures[r]: the tokens [m], the top k's probabilities [m, k] and ids [m, k], and what was read
// [m, 2 + k] (the row's largest value, the log of its sum of exp(x - most), its top k values as read).
std::vector<at::Tensor> draw_top_rows(const std::vector<at::Tensor>& rows, const std::vector<int64_t>& keys,
                                      const std::vector<double>& temperatures, int64_t k) {
  TORCH_CHECK(rows.size() == keys.size() && rows.size() == temperatures.size(),
              "draw_top_rows: one key and one temperature a row");
  for (const auto& r : rows) check_logits_row(r, "draw_top_rows");
  const int64_t m = static_cast<int64_t>(rows.size());
  const int64_t n = m ? rows[0].size(0) : 0;
  for (const auto& r : rows) TORCH_CHECK(r.size(0) == n, "draw_top_rows: rows of one width");
  for (double t : temperatures) TORCH_CHECK(t > 0, "draw_top_rows: a temperature must be positive");
  TORCH_CHECK(m == 0 || (k >= 1 && k <= n), "draw_top_rows: k must be in [1, V]");
  auto picks = at::empty({m}, at::kLong);
  auto values = at::empty({m, k}, at::kFloat);
  auto ids = at::empty({m, k}, at::kLong);
  auto read = at::empty({m, 2 + k}, at::kFloat);
  int64_t* pp = picks.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* rp = read.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled;
    for (int64_t r = begin; r < end; ++r) {
      const at::Tensor& row = rows[r];
      const float* s = divided_row(row.data_ptr(), row.scalar_type() == at::kBFloat16, n,
                                   static_cast<float>(temperatures[r]), scaled);
      pp[r] = draw_top(s, n, static_cast<uint64_t>(keys[r]), k, vp + r * k, ip + r * k, rp + r * (2 + k));
    }
  });
  return {picks, values, ids, read};
}

}  // namespace

#ifndef TOT_SAMPLING_UNREGISTERED  // tests/test_sampling.py binds the functions of other builds itself
TORCH_LIBRARY_FRAGMENT(tot_sampling, m) {
  m.def("draw_top_rows(Tensor[] rows, int[] keys, float[] temperatures, int k) -> Tensor[]", &draw_top_rows);
}
#endif
