// torch.ops.tot_sampling.gumbel_pick_rows: each row's Gumbel-max draw (gumbel.h), rows on the machine's
// threads. Registered apart from module.cpp: the forward's kernels and their digest (what a shipped
// numerics record or cost profile is valid for) do not change with it.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "gumbel.h"
#include "rows.h"

#include <cstdint>
#include <vector>

namespace {

// Each row's draw, rows on the machine's threads (a step's rows without drafts: one draw each). A row
// is drawn over its logits divided by its temperature in float32, as `processed_logits` divides them
// (float32 by float32: torch's division of a float32 tensor by a Python number), so raw logits need not
// be processed (cast, divided, joined) first; a row already processed comes with temperature 1.
std::vector<int64_t> gumbel_pick_rows(const std::vector<at::Tensor>& rows, const std::vector<int64_t>& keys,
                                      const std::vector<double>& temperatures) {
  TORCH_CHECK(rows.size() == keys.size() && rows.size() == temperatures.size(),
              "gumbel_pick_rows: one key and one temperature a row");
  for (const auto& r : rows) check_logits_row(r, "gumbel_pick_rows");
  std::vector<int64_t> out(rows.size());
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled;
    for (int64_t r = begin; r < end; ++r) {
      const at::Tensor& row = rows[r];
      const int64_t n = row.size(0);
      const float t = static_cast<float>(temperatures[r]);
      const float* s = divided_row(row.data_ptr(), row.scalar_type() == at::kBFloat16, n, t, scaled);
      out[r] = gumbel::pick_row(s, n, static_cast<uint64_t>(keys[r]), [](int64_t, int64_t) {});
    }
  });
  return out;
}

}  // namespace

#ifndef TOT_SAMPLING_UNREGISTERED  // tests/test_sampling.py binds the functions of other builds itself
TORCH_LIBRARY(tot_sampling, m) {
  m.def("gumbel_pick_rows(Tensor[] rows, int[] keys, float[] temperatures) -> int[]", &gumbel_pick_rows);
}
#endif
