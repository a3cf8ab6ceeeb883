// y = x W^T with W in a GGUF file's own 4-bit blocks and x quantized to int8 per row and block of
// 32 (decoding/core/quant.py, model.activations=int8): the multiply-adds run on the integer units.
//
// W: per output n and block b of 32 inputs, 16 bytes of codes q in 0..15 (element j in the low
// nibble of byte j, element j + 16 in its high nibble: GGUF's Q4_0 / Q4_1 order), and a float scale
// and minimum (w = scale * q + minimum; Q4_0's minimum is -8 scale, Q4_K's sub-blocks are decoded to
// this form at load). x: each row's block quantized alone, d = max |x| / 127, qx = round-to-even(x / d),
// s = d * sum(qx). Then
//     y[m, n] = sum_b scale[n, b] * d[m, b] * (q . qx)[b]  +  sum_b minimum[n, b] * s[m, b].
// The block's integer dot product is exact; it is formed in 8 lanes of 4 products each (what
// VPMADDUBSW + VPMADDWD give on AVX2 and VPDPBUSD on AVX-512 VNNI: the same integers), each lane
// converted to float and accumulated with a fused multiply-add in block order, the lanes then added
// in a fixed tree. Nothing depends on the number of rows, on which rows share a tile or on threads:
// a row gets the same bits alone or in any batch, on every path (the portable loop does the same
// operations in the same order; built with -ffp-contract=off).
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;  // inputs per block
constexpr int64_t L = 8;    // float lanes of a block's partial sums
constexpr int64_t R = 4;    // rows of x per tile: one weight block unpacked feeds R rows
constexpr int64_t NB = 8;   // output columns per parallel task
constexpr int64_t MP = 64;  // rows per panel (a multiple of R: a row's tile does not depend on M)

inline float lanes_sum8(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

struct QuantRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32]
  std::vector<float> s;    // [M, K / 32]
};

// One row's blocks quantized: the same arithmetic on every path (max and scaling are exact or one
// rounding each; nearbyint is round-half-even like _mm256_round_ps's nearest mode).
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f;
    for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      q[b * QK + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

QuantRows quantize(const float* x, int64_t M, int64_t K) {
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / QK)), std::vector<float>(M * (K / QK))};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * K, K, r.q.data() + m * K, r.d.data() + m * (K / QK), r.s.data() + m * (K / QK));
  });
  return r;
}

// sum_b minimum[b] * s[b]: 8 lanes of fused multiply-adds over whole groups of 8 blocks, then the
// rest in order into one float.
inline float minimum_term(const float* mn, const float* s, int64_t nb) {
  float acc[L] = {};
  int64_t b = 0;
  for (; b + L <= nb; b += L)
    for (int64_t l = 0; l < L; ++l) acc[l] = std::fma(mn[b + l], s[b + l], acc[l]);
  float tail = 0.0f;
  for (; b < nb; ++b) tail = std::fma(mn[b], s[b], tail);
  return lanes_sum8(acc) + tail;
}

#if defined(Q4_AVX2)
// The 32 codes of a block as bytes 0..31, in element order.
inline __m256i unpack(const uint8_t* bytes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
  return _mm256_set_m128i(hi, lo);
}

// Lane j: the sum of the 4 products w[4j..4j+3] * x[4j..4j+3] (w unsigned, x signed).
inline __m256i block_dot(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
#endif

// out[r] = the scale terms of rows r of the tile against output column n (before the minimum term).
template <int64_t ROWS>
inline void scale_terms(const uint8_t* codes, const float* sc, const int8_t* q, const float* d, int64_t K,
                        float* out) {
  const int64_t nb = K / QK;
#if defined(Q4_AVX2)
  __m256 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = unpack(codes + b * (QK / 2));
    const __m256 ws = _mm256_set1_ps(sc[b]);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + b * QK));
      const __m256 f = _mm256_cvtepi32_ps(block_dot(w, x));
      acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(ws, _mm256_set1_ps(d[r * nb + b])), acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    alignas(32) float lanes[L];
    _mm256_store_ps(lanes, acc[r]);
    out[r] = lanes_sum8(lanes);
  }
#else
  float acc[ROWS][L] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t w[QK];
    for (int64_t j = 0; j < QK / 2; ++j) {
      w[j] = codes[b * (QK / 2) + j] & 0x0F;
      w[j + QK / 2] = codes[b * (QK / 2) + j] >> 4;
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* x = q + r * K + b * QK;
      const float scale = sc[b] * d[r * nb + b];
      for (int64_t l = 0; l < L; ++l) {
        const int32_t lane = w[4 * l] * x[4 * l] + w[4 * l + 1] * x[4 * l + 1] + w[4 * l + 2] * x[4 * l + 2] +
                             w[4 * l + 3] * x[4 * l + 3];
        acc[r][l] = std::fma(static_cast<float>(lane), scale, acc[r][l]);
      }
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = lanes_sum8(acc[r]);
#endif
}

}  // namespace

const char* q4_int8_path() {
#if defined(Q4_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(Q4_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(Q4_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

at::Tensor q4_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                          const at::Tensor& bias) {
  RECORD_FUNCTION("tot::q4_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "q4_int8_linear: codes [N, K / 2] uint8");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, nb = K / QK;
  TORCH_CHECK(K % QK == 0, "q4_int8_linear: ", K, " inputs is not a multiple of ", QK);
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.sizes() == at::IntArrayRef({N, 2, nb}),
              "q4_int8_linear: scale_min [N, 2, K / 32] float32");
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  TORCH_CHECK(xf.size(1) == K, "q4_int8_linear: x has ", xf.size(1), " features, the weight ", K);
  const int64_t M = xf.size(0);
  const QuantRows qx = quantize(xf.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale_min.data_ptr<float>();
  const at::Tensor b = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bp = bias.numel() ? b.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    float out[R];
    // Rows in panels whose int8 codes stay in L2 while the task's columns pass over them.
    for (int64_t m0 = 0; m0 < M; m0 += MP) {
      const int64_t m1 = std::min(M, m0 + MP);
      for (int64_t n = begin * NB; n < std::min(end * NB, N); ++n) {
        const uint8_t* wc = cp + n * (K / 2);
        const float* sc = sp + n * 2 * nb;
        const float* mn = sc + nb;
        const float add = bp ? bp[n] : 0.0f;
        int64_t m = m0;
        for (; m + R <= m1; m += R) {
          scale_terms<R>(wc, sc, qx.q.data() + m * K, qx.d.data() + m * nb, K, out);
          for (int64_t r = 0; r < R; ++r)
            yp[(m + r) * N + n] = (out[r] + minimum_term(mn, qx.s.data() + (m + r) * nb, nb)) + add;
        }
        for (; m < m1; ++m) {
          scale_terms<1>(wc, sc, qx.q.data() + m * K, qx.d.data() + m * nb, K, out);
          yp[m * N + n] = (out[0] + minimum_term(mn, qx.s.data() + m * nb, nb)) + add;
        }
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.to(at::kBFloat16).reshape(shape);
}

std::vector<at::Tensor> q4_int8_quantize(const at::Tensor& x) {
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(K % QK == 0, "q4_int8_quantize: ", K, " features is not a multiple of ", QK);
  QuantRows r = quantize(xf.data_ptr<float>(), M, K);
  at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kChar));
  std::memcpy(q.data_ptr<int8_t>(), r.q.data(), M * K);
  at::Tensor d = at::from_blob(r.d.data(), {M, K / QK}, xf.options()).clone();
  at::Tensor s = at::from_blob(r.s.data(), {M, K / QK}, xf.options()).clone();
  return {q, d, s};
}
