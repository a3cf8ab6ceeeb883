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

#include "kernels.h"
#include "rows.h"

#include <cstdint>
#include <limits>
#include <vector>

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

// sum_i exp(x_i - most), in 8 lanes (element i into lane i mod 8) added in a fixed tree.
template <typename R>
float row_exp_sum(const R& x, int64_t n, float most) {
  float lanes[8] = {};
  int64_t i = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(x.load(i), _mm256_set1_ps(most))));
  _mm256_storeu_ps(lanes, acc);
#endif
  for (; i + 8 <= n; i += 8)
    for (int64_t l = 0; l < 8; ++l) lanes[l] += fixed_exp(x.at(i + l) - most);
  float tail = 0.0f;
  for (; i < n; ++i) tail += fixed_exp(x.at(i) - most);
  return (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))) + tail;
}

// With `normalise`, the row's softmax at its top k, and in `read` the row's largest value, the log of
// its sum of exp(x - most) and its top k values as read (x / t): what log_row computes from the same
// operations, so a step's log-probabilities of these rows need no second pass (logprobs.py `RowReading`).
template <typename R>
void top_row(const R& x, int64_t n, int64_t k, bool normalise, float* vals, int64_t* ids, float* read) {
  row_top_k(x, n, k, vals, ids);
  if (!normalise) return;
  const float most = vals[0];
  const float sum = row_exp_sum(x, n, most);
  read[0] = most;
  read[1] = std::log(sum);
  for (int64_t j = 0; j < k; ++j) read[2 + j] = vals[j];
  for (int64_t j = 0; j < k; ++j) vals[j] = fixed_exp(vals[j] - most) / sum;
}

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

TORCH_LIBRARY_FRAGMENT(tot_sampling, m) {
  m.def("top_k_rows(Tensor[] blocks, int[] counts, int[] picks, bool[] normalise, float[] temperatures, int k) -> Tensor[]",
        &top_k_rows);
  m.def("log_rows(Tensor[] blocks, int[] counts, int[] picks, float[] temperatures, int[] tokens, int k) -> Tensor[]",
        &log_rows);
}
