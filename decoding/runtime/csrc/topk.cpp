// The k largest values of chosen rows of a step's blocks, or of their softmax (decoding/speculation/sampling.py
// `top_k_rows`): what a drafter that learns from the target's distributions reads at every committed
// position. Registered as torch.ops.tot_sampling.top_k_rows beside gumbel.cpp, outside the forward's digest.
//
// The rows are read where they lie, float32 or bfloat16, with no copy, cast or softmax written out: for a
// greedy row the top tokens of its softmax are those of its logits, and their probabilities need only the
// row's sum of exp(x - max), one more pass (the cast, the softmax and torch's top-k cost 0.6 ms a step of
// three rows of a 49k vocabulary; 2 cores, AVX2). The top-k pass compares 8 values at a time with the
// smallest of the k kept so far, and only a vector holding a larger one goes to the scalar insertion (about
// k ln(V / k) of them in a row of V values in no particular order). The sum runs in 8 lanes in a fixed
// order with kernels.h's fixed_exp, so a row's probabilities depend on that row alone.
//
// A row is read divided by its block's temperature (x / t, IEEE division as torch's `logits / t`: the
// same bits as processed logits at that temperature, 1 leaving x as it is), so a row sampled at a
// temperature alone needs no processed copy. `log_rows` reads the same way each row's log-softmax at a
// given token and its k largest: a request's log-probabilities for all of a step's rows in one call.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "topk.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace {

using topk::row_exp_sum;
using topk::row_top_k;
using topk::Scaled;
using topk::top_row;

struct Row {
  const void* data;
  bool bf16;
  bool normalise;
  float t;
};

// The picked rows of a step's blocks ([rows_b, V] float32 or bfloat16 on the CPU, each row contiguous;
// counts[b] of the picks from block b in turn), each with its block's flag and temperature; their width.
std::vector<Row> picked_rows(const char* op, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& counts,
                             const std::vector<int64_t>& picks, const c10::List<bool>& normalise,
                             const std::vector<double>& temperatures, int64_t& n) {
  TORCH_CHECK(blocks.size() == counts.size() && blocks.size() == normalise.size() && blocks.size() == temperatures.size(),
              op, ": one count, normalise flag and temperature per block");
  std::vector<Row> rows;
  n = -1;
  size_t next = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const auto& t = blocks[b];
    const bool bf16 = t.scalar_type() == at::kBFloat16;
    TORCH_CHECK(t.dim() == 2 && t.device().is_cpu() && (bf16 || t.scalar_type() == at::kFloat), op,
                ": float32 or bfloat16 CPU blocks [rows, V]");
    TORCH_CHECK(t.stride(1) == 1, op, ": each row must be contiguous");
    TORCH_CHECK(n < 0 || t.size(1) == n, op, ": blocks of one width");
    TORCH_CHECK(temperatures[b] > 0, op, ": a temperature must be positive");
    n = t.size(1);
    TORCH_CHECK(counts[b] >= 0 && next + counts[b] <= picks.size(), op, ": counts beyond the picks");
    const size_t item = bf16 ? 2 : 4;
    for (int64_t j = 0; j < counts[b]; ++j, ++next) {
      const int64_t r = picks[next];
      TORCH_CHECK(r >= 0 && r < t.size(0), op, ": a picked row outside its block");
      rows.push_back({static_cast<const char*>(t.data_ptr()) + r * t.stride(0) * item, bf16, normalise[b],
                      static_cast<float>(temperatures[b])});
    }
  }
  TORCH_CHECK(next == picks.size(), op, ": picks beyond the counts");
  return rows;
}

// g(row read as its type T, divided by its temperature where that is not 1).
template <typename T, typename G>
void dispatch(const Row& row, G g) {
  const T* x = static_cast<const T*>(row.data);
  if (row.t == 1.0f)
    g(Scaled<T, false>{x, row.t});
  else
    g(Scaled<T, true>{x, row.t});
}

// f(r, row r read as its type) for every picked row, rows on the machine's threads.
template <typename F>
void each_row(const std::vector<Row>& rows, F f) {
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Row& row = rows[r];
      if (row.bf16)
        dispatch<at::BFloat16>(row, [&](const auto& x) { f(r, x); });
      else
        dispatch<float>(row, [&](const auto& x) { f(r, x); });
    }
  });
}

// normalise[b]: whether block b holds logits (its softmax's top k returned) or probabilities. Returns the
// values [picked, k] (float32), their ids [picked, k] and per logits row what top_row read of it
// [picked, 2 + k]: its largest value, the log of its sum of exp(x - most), its top k values (NaN for a
// row of probabilities).
std::vector<at::Tensor> top_k_rows(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& counts,
                                   const std::vector<int64_t>& picks, const c10::List<bool>& normalise,
                                   const std::vector<double>& temperatures, int64_t k) {
  int64_t n;
  const std::vector<Row> rows = picked_rows("top_k_rows", blocks, counts, picks, normalise, temperatures, n);
  TORCH_CHECK(rows.empty() || (k >= 1 && k <= n), "top_k_rows: k must be in [1, V]");
  const int64_t m = static_cast<int64_t>(rows.size());
  auto values = at::empty({m, k}, at::kFloat);
  auto ids = at::empty({m, k}, at::kLong);
  auto read = at::full({m, 2 + k}, std::numeric_limits<float>::quiet_NaN(), at::kFloat);
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* rp = read.data_ptr<float>();
  each_row(rows, [&](int64_t r, const auto& x) {
    top_row(x, n, k, rows[r].normalise, vp + r * k, ip + r * k, rp + r * (2 + k));
  });
  return {values, ids, read};
}

// log p of a row's token and of its k most likely: (x - most) - log(sum exp(x - most)) over the row read
// divided by its temperature, the sum as top_row's.
template <typename R>
void log_row(const R& x, int64_t n, int64_t token, int64_t k, float* chosen, float* vals, int64_t* ids) {
  row_top_k(x, n, k, vals, ids);
  const float most = vals[0];
  const float log_sum = std::log(row_exp_sum(x, n, most));
  for (int64_t j = 0; j < k; ++j) vals[j] = (vals[j] - most) - log_sum;
  *chosen = (x.at(token) - most) - log_sum;
}

// Per picked row (as top_k_rows picks them, every block's rows logits), the log-softmax at tokens[r] and
// the k largest log-probabilities with their ids: [picked], [picked, k], [picked, k].
std::vector<at::Tensor> log_rows(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& counts,
                                 const std::vector<int64_t>& picks, const std::vector<double>& temperatures,
                                 const std::vector<int64_t>& tokens, int64_t k) {
  int64_t n;
  c10::List<bool> logits;
  for (size_t b = 0; b < blocks.size(); ++b) logits.push_back(true);
  const std::vector<Row> rows = picked_rows("log_rows", blocks, counts, picks, logits, temperatures, n);
  TORCH_CHECK(tokens.size() == rows.size(), "log_rows: one token per picked row");
  TORCH_CHECK(rows.empty() || (k >= 1 && k <= n), "log_rows: k must be in [1, V]");
  for (int64_t token : tokens) TORCH_CHECK(token >= 0 && token < n, "log_rows: a token outside the vocabulary");
  const int64_t m = static_cast<int64_t>(rows.size());
  auto chosen = at::empty({m}, at::kFloat);
  auto values = at::empty({m, k}, at::kFloat);
  auto ids = at::empty({m, k}, at::kLong);
  float* cp = chosen.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  each_row(rows, [&](int64_t r, const auto& x) { log_row(x, n, tokens[r], k, cp + r, vp + r * k, ip + r * k); });
  return {chosen, values, ids};
}

}  // namespace

#ifndef TOT_SAMPLING_UNREGISTERED  // tests/test_sampling.py binds the functions of other builds itself
TORCH_LIBRARY_FRAGMENT(tot_sampling, m) {
  m.def("top_k_rows(Tensor[] blocks, int[] counts, int[] picks, bool[] normalise, float[] temperatures, int k) -> Tensor[]",
        &top_k_rows);
  m.def("log_rows(Tensor[] blocks, int[] counts, int[] picks, float[] temperatures, int[] tokens, int k) -> Tensor[]",
        &log_rows);
}
#endif
