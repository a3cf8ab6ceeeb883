// Batch- and tree-invariant attention for CPU forwards (decoding/core/attention.py loads it).
//
// The output for one query depends only on that query and the keys/values it sees, in position
// order: every score is one dot product summed over the head dimension in index order, the softmax
// sum and the weighted sum of values run over the visible positions in increasing order (a hidden
// position adds nothing, exactly), and exp is a fixed polynomial. Vector lanes run across positions
// or across the head dimension, never across a reduction, and no reduction is split by the number
// of rows, queries or positions. So a query's output has the same bits
// alone, beside other rows of any length, or inside a draft tree (its ancestors are the chain it
// would have had). Built with -ffp-contract=off: the only fused multiply-adds are the explicit
// std::fma calls, the same in vector and scalar code.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t W = 16;  // vector lanes (floats) the loops below are written for
constexpr int64_t U = 4;   // independent score chains per query, to hide the fused multiply-add latency

// exp(x) for x <= 0 (Cephes expf's range reduction and polynomial): plain float arithmetic, so the
// compiler's vector and scalar code give the same bits.
inline float fixed_exp(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(std::max(n, -126.0f)) + 127) << 23;
  return x < -87.0f ? 0.0f : p * __builtin_bit_cast(float, bits);
}

// Widen n values (n a multiple of W; the caller pads) to float.
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void widen<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  }
}

// One (row, key/value head) task: its G * T queries against the row's L positions. C = padded
// head dimension / W. Each score is one chain of fused multiply-adds over d in order (lanes run
// across positions); each output lane is one chain over the positions in order.
template <int C, typename scalar_t>
void attend_task(const scalar_t* qb, int64_t qs1, int64_t qs2, const scalar_t* kb, int64_t ks2,
                 const scalar_t* vb, int64_t vs2, const bool* mrow0, int64_t ms2, int64_t ms3, bool has_mask,
                 int64_t G, int64_t T, int64_t L, int64_t D, float scale, scalar_t* ob, int64_t os1, int64_t os2,
                 std::vector<float>& qf, std::vector<float>& kt, std::vector<float>& vf, std::vector<float>& p,
                 std::vector<float>& allow, std::vector<float>& row) {
  constexpr int64_t Dp = C * W;
  const int64_t nq = G * T, Lr = (L + U * W - 1) / (U * W) * (U * W);
  const int64_t Lp = Lr + W;  // the row stride of the transposed keys: not a multiple of 4 KiB (cache sets)
  qf.assign(nq * Dp, 0.0f);
  kt.assign(D * Lp, 0.0f);
  vf.resize(L * Dp);
  p.assign(nq * Lp, 0.0f);
  allow.assign(nq * Lr, 0.0f);  // 1 where the query sees the position, else 0
  row.assign(Dp, 0.0f);
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t g = j / T, t = j % T;
    widen(qb + g * qs1 + t * qs2, qf.data() + j * Dp, D);
    float* a = allow.data() + j * Lr;
    if (has_mask) {
      const bool* mrow = mrow0 + t * ms2;
      for (int64_t l = 0; l < L; ++l) a[l] = mrow[l * ms3] ? 1.0f : 0.0f;
    } else {
      for (int64_t l = 0; l <= L - T + t; ++l) a[l] = 1.0f;
    }
  }
  for (int64_t l = 0; l < L; ++l) {  // keys transposed to [D][Lp], values widened to [L][Dp]
    widen(kb + l * ks2, row.data(), D);
    for (int64_t d = 0; d < D; ++d) kt[d * Lp + l] = row[d];
    widen(vb + l * vs2, vf.data() + l * Dp, D);
    for (int64_t d = D; d < Dp; ++d) vf[l * Dp + d] = 0.0f;
  }
  // Scores, U * W positions at a time (independent chains), for one query at a time.
  for (int64_t j = 0; j < nq; ++j) {
    const float* qj = qf.data() + j * Dp;
    float* pj = p.data() + j * Lp;
    for (int64_t l0 = 0; l0 < Lr; l0 += U * W) {
      float acc[U][W];
      for (int64_t u = 0; u < U; ++u)
        for (int64_t i = 0; i < W; ++i) acc[u][i] = qj[0] * kt[l0 + u * W + i];
      for (int64_t d = 1; d < D; ++d) {
        const float qd = qj[d];
        const float* kd = kt.data() + d * Lp + l0;
        for (int64_t u = 0; u < U; ++u)
          for (int64_t i = 0; i < W; ++i) acc[u][i] = std::fma(qd, kd[u * W + i], acc[u][i]);
      }
      for (int64_t u = 0; u < U; ++u)
        for (int64_t i = 0; i < W; ++i) pj[l0 + u * W + i] = acc[u][i] * scale;
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* __restrict pj = p.data() + j * Lp;
    const float* __restrict a = allow.data() + j * Lr;
    const float hidden = -std::numeric_limits<float>::infinity();
    float lane_max[W];
    for (int64_t i = 0; i < W; ++i) lane_max[i] = hidden;
    for (int64_t l = 0; l < Lr; ++l)  // a maximum is exact in any order
      lane_max[l % W] = std::max(lane_max[l % W], a[l] != 0.0f ? pj[l] : hidden);
    float m = hidden;
    for (int64_t i = 0; i < W; ++i) m = std::max(m, lane_max[i]);
    // Softmax weights, exactly 0 where hidden (clamped first: a hidden score may exceed the maximum).
    for (int64_t l = 0; l < Lr; ++l) pj[l] = fixed_exp(std::min(pj[l] - m, 0.0f)) * a[l];
    // Their sum and the weighted values, positions in order.
    float sum = 0.0f;
    float acc[C][W] = {};
    for (int64_t l = 0; l < L; ++l) {
      const float w = pj[l];
      if (w == 0.0f) continue;  // adds nothing
      sum = sum + w;
      const float* vl = vf.data() + l * Dp;
      for (int c = 0; c < C; ++c)
        for (int64_t i = 0; i < W; ++i) acc[c][i] = std::fma(w, vl[c * W + i], acc[c][i]);
    }
    const int64_t g = j / T, t = j % T;
    scalar_t* dst = ob + t * os1 + g * os2;
    const float s = sum > 0.0f ? sum : 1.0f;  // no visible position: zeros
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d / W][d % W] / s);
  }
}

template <typename scalar_t>
void attend_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& mask, bool has_mask, const torch::Tensor& rows, bool has_rows,
                   double scale_d, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), L = k.size(2), G = H / Hk;
  const int64_t chunks = (D + W - 1) / W;
  TORCH_CHECK(chunks == 1 || chunks == 2 || chunks == 4 || chunks == 8 || chunks == 16,
              "attend: head dimension ", D, " is not supported (up to 256, in steps of 16, 32, 64 or 128)");
  const float scale = static_cast<float>(scale_d);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const bool* mp = has_mask ? mask.data_ptr<bool>() : nullptr;
  const int64_t ms0 = has_mask ? mask.stride(0) : 0, ms2 = has_mask ? mask.stride(2) : 0,
                ms3 = has_mask ? mask.stride(3) : 0;
  const int64_t* rp = has_rows ? rows.data_ptr<int64_t>() : nullptr;

  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kt, vf, p, allow, row;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hk, hk = task % Hk;
      const int64_t r = has_rows ? rp[b] : b;
      const scalar_t* qb = qp + b * q.stride(0) + hk * G * q.stride(1);
      const scalar_t* kb = kp + r * k.stride(0) + hk * k.stride(1);
      const scalar_t* vb = vp + r * v.stride(0) + hk * v.stride(1);
      scalar_t* ob = op + b * out.stride(0) + hk * G * out.stride(2);
      const bool* mrow = has_mask ? mp + b * ms0 : nullptr;
#define TOT_TASK(CC)                                                                                        \
  attend_task<CC, scalar_t>(qb, q.stride(1), q.stride(2), kb, k.stride(2), vb, v.stride(2), mrow, ms2, ms3, \
                            has_mask, G, T, L, D, scale, ob, out.stride(1), out.stride(2), qf, kt, vf, p,    \
                            allow, row)
      switch (chunks) {
        case 1: TOT_TASK(1); break;
        case 2: TOT_TASK(2); break;
        case 4: TOT_TASK(4); break;
        case 8: TOT_TASK(8); break;
        default: TOT_TASK(16); break;
      }
#undef TOT_TASK
    }
  });
}

}  // namespace

// q [B, H, T, D]; k, v [Bk, Hk, L, D] (any strides); mask bool [B or 1, 1, T, L] or empty for
// causal (query t sees positions up to L - T + t); rows [B] int64: the k/v row of each query row
// (empty: the same row). Returns [B, T, H, D] in q's dtype.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, torch::Tensor rows,
                     double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: q, k, v must be 4D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "attend: one dtype");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "attend: query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3) && v.size(2) == k.size(2), "attend: shapes");
  const bool has_mask = mask.numel() > 0, has_rows = rows.numel() > 0;
  // Rows of the head dimension are read as vectors.
  if (q.stride(3) != 1) q = q.contiguous();
  if (k.stride(3) != 1) k = k.contiguous();
  if (v.stride(3) != 1) v = v.contiguous();
  if (has_mask) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 4 && mask.size(1) == 1, "attend: mask");
    mask = mask.expand({q.size(0), 1, q.size(2), k.size(2)});
  }
  if (has_rows) {
    TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.numel() == q.size(0), "attend: rows");
    rows = rows.contiguous();
  } else {
    TORCH_CHECK(k.size(0) == q.size(0), "attend: key/value rows must match query rows");
  }
  auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend", [&] {
    attend_kernel<scalar_t>(q, k, v, mask, has_mask, rows, has_rows, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attend", &attend, "batch-invariant attention (CPU)"); }
