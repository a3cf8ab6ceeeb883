// Row-invariant y = x W^T for bfloat16 weights on CPUs where oneDNN's bfloat16 linear is slow at
// several rows (decoding/runtime/rows_linear.py selects it: without AVX-512, oneDNN's time per extra row
// is about that of the first row; the embedded model's LM head took 3 ms per row of a forward).
//
// The weights are widened to float once per forward, one output column at a time into a buffer
// that stays in L1, and every row of x is multiplied by that buffer: the weights are read once for
// all rows. Each output y[m, n] is one dot product over k in index order in W float lanes (lane l
// sums k = l, l + W, ...) with fused multiply-adds, then the lanes are added in a fixed tree: nothing
// depends on the number of rows, on which rows share a tile or on the thread count, so a row gets
// the same bits alone or in any batch. The AVX2 code and the portable code do the same operations
// in the same order (built with -ffp-contract=off: the only fused multiply-adds are explicit).
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t W = 16;    // float lanes of one dot product
constexpr int64_t R = 4;     // rows of x per tile: one weight load feeds R fused multiply-adds
constexpr int64_t NB = 4;    // output columns per parallel task

inline float lanes_sum(const float* acc) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = acc[l] + acc[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// out[r] = x[r] . w over K (a multiple of W) for ROWS rows of x, `stride` floats apart.
template <int64_t ROWS>
inline void dots(const float* x, int64_t stride, const float* w, int64_t K, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(W == 16, "two 8-float registers per dot product");
  __m256 lo[ROWS], hi[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += W) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int64_t r = 0; r < ROWS; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * stride + k), w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * stride + k + 8), w1, hi[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    alignas(32) float acc[W];
    _mm256_store_ps(acc, lo[r]);
    _mm256_store_ps(acc + 8, hi[r]);
    out[r] = lanes_sum(acc);
  }
#else
  float acc[ROWS][W] = {};
  for (int64_t k = 0; k < K; k += W)
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t l = 0; l < W; ++l) acc[r][l] = std::fma(x[r * stride + k + l], w[k + l], acc[r][l]);
  for (int64_t r = 0; r < ROWS; ++r) out[r] = lanes_sum(acc[r]);
#endif
}

}  // namespace

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  RECORD_FUNCTION("tot::rows_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "rows_linear: a contiguous bfloat16 weight");
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(xf.size(1) == K && K % W == 0, "rows_linear: x has ", xf.size(1), " features, the weight ", K,
              " (a multiple of ", W, ")");
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const at::Tensor b = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bp = bias.numel() ? b.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(K);
    float out[R];
    for (int64_t n = begin * NB; n < std::min(end * NB, N); ++n) {
      widen_bfloat16(wp + n * K, w.data(), K);
      const float add = bp ? bp[n] : 0.0f;
      int64_t m = 0;
      for (; m + R <= M; m += R) {
        dots<R>(xp + m * K, K, w.data(), K, out);
        for (int64_t r = 0; r < R; ++r) yp[(m + r) * N + n] = out[r] + add;
      }
      for (; m < M; ++m) {
        dots<1>(xp + m * K, K, w.data(), K, out);
        yp[m * N + n] = out[0] + add;
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.to(x.scalar_type()).reshape(shape);
}
