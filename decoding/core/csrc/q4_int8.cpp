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
#include <atomic>
#include <chrono>
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
constexpr int64_t NC = 2;   // output columns per tile: one row's codes loaded feed NC columns
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
#if defined(Q4_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xb + 8 * k);
    const __m256 m4 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    alignas(32) float lanes[L];
    _mm256_store_ps(lanes, m4);
    float amax = 0.0f;
    for (int64_t l = 0; l < L; ++l) amax = std::max(amax, lanes[l]);
#else
    float amax = 0.0f;
    for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
#if defined(Q4_AVX2)
    // Rounded to nearest even, as nearbyint; packing saturates nothing (|code| <= 127).
    __m256i c[4];
    for (int k = 0; k < 4; ++k)
      c[k] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    // The packs work within 128-bit halves: put the eight 4-byte groups back in order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    alignas(32) int32_t partial[L];
    _mm256_store_si256(reinterpret_cast<__m256i*>(partial),
                       _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
    for (int64_t l = 0; l < L; ++l) sum += partial[l];
#else
    for (int64_t i = 0; i < QK; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      q[b * QK + i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
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

// A weight format: Q4 (16 bytes of 4-bit codes in 0..15 per block, a scale and a minimum) or Q8
// (Q8_0: 32 signed bytes per block and a scale, no minimum).
template <bool Q8>
struct Format {
  static constexpr int64_t bytes = Q8 ? QK : QK / 2;  // code bytes per block
  static constexpr int64_t factors = Q8 ? 1 : 2;      // scale (and minimum) arrays per output
};

// out[r * COLS + c] = the scale terms of row r of the tile against output column c (before the
// minimum term); column c's codes at codes + c * nb * bytes and its scales at sc + c * factors * nb.
// Each (row, column) runs the same operations whatever the tile's size.
template <bool Q8, int64_t ROWS, int64_t COLS>
inline void scale_terms(const uint8_t* codes, const float* sc, const int8_t* q, const float* d, int64_t K,
                        float* out) {
  using F = Format<Q8>;
  const int64_t nb = K / QK;
#if defined(Q4_AVX2)
  __m256 acc[ROWS][COLS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[COLS];
    __m256 ws[COLS];
    for (int64_t c = 0; c < COLS; ++c) {
      const uint8_t* bytes = codes + (c * nb + b) * F::bytes;
      // Q8: |w| as the unsigned operand, w's sign moved onto x below (the same products).
      w[c] = Q8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)) : unpack(bytes);
      ws[c] = _mm256_set1_ps(sc[c * F::factors * nb + b]);
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + b * QK));
      const __m256 dx = _mm256_set1_ps(d[r * nb + b]);
      for (int64_t c = 0; c < COLS; ++c) {
        const __m256i dot = Q8 ? block_dot(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(x, w[c])) : block_dot(w[c], x);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[c], dx), acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < COLS; ++c) {
      alignas(32) float lanes[L];
      _mm256_store_ps(lanes, acc[r][c]);
      out[r * COLS + c] = lanes_sum8(lanes);
    }
#else
  float acc[ROWS][COLS][L] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t c = 0; c < COLS; ++c) {
      int32_t w[QK];
      const uint8_t* bytes = codes + (c * nb + b) * F::bytes;
      for (int64_t j = 0; j < QK / 2; ++j) {
        w[j] = Q8 ? static_cast<int8_t>(bytes[j]) : bytes[j] & 0x0F;
        w[j + QK / 2] = Q8 ? static_cast<int8_t>(bytes[j + QK / 2]) : bytes[j] >> 4;
      }
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* x = q + r * K + b * QK;
        const float scale = sc[c * F::factors * nb + b] * d[r * nb + b];
        for (int64_t l = 0; l < L; ++l) {
          const int32_t lane = w[4 * l] * x[4 * l] + w[4 * l + 1] * x[4 * l + 1] + w[4 * l + 2] * x[4 * l + 2] +
                               w[4 * l + 3] * x[4 * l + 3];
          acc[r][c][l] = std::fma(static_cast<float>(lane), scale, acc[r][c][l]);
        }
      }
    }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < COLS; ++c) out[r * COLS + c] = lanes_sum8(acc[r][c]);
#endif
}

// Rows m0..m1 of y against columns n..n + COLS - 1.
template <bool Q8, int64_t COLS>
inline void columns(const QuantRows& qx, const uint8_t* cp, const float* sp, const float* bp, int64_t n, int64_t m0,
                    int64_t m1, int64_t N, int64_t K, float* yp) {
  using F = Format<Q8>;
  const int64_t nb = K / QK;
  const uint8_t* wc = cp + n * nb * F::bytes;
  const float* sc = sp + n * F::factors * nb;
  float out[R * COLS];
  auto finish = [&](int64_t m, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < COLS; ++c) {
        const float add = bp ? bp[n + c] : 0.0f;
        const float terms = Q8 ? out[r * COLS + c]
                               : out[r * COLS + c] + minimum_term(sc + c * 2 * nb + nb, qx.s.data() + (m + r) * nb, nb);
        yp[(m + r) * N + n + c] = terms + add;
      }
  };
  int64_t m = m0;
  for (; m + R <= m1; m += R) {
    scale_terms<Q8, R, COLS>(wc, sc, qx.q.data() + m * K, qx.d.data() + m * nb, K, out);
    finish(m, R);
  }
  for (; m < m1; ++m) {
    scale_terms<Q8, 1, COLS>(wc, sc, qx.q.data() + m * K, qx.d.data() + m * nb, K, out);
    finish(m, 1);
  }
}

// y = x W^T (+ bias) for W in `codes` / `scales` of format Q8 or Q4, as bfloat16.
template <bool Q8>
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& bias,
                         const char* name) {
  using F = Format<Q8>;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2, name,
              ": codes [N, bytes] uint8");
  const int64_t N = codes.size(0), K = codes.size(1) / F::bytes * QK, nb = K / QK;
  TORCH_CHECK(codes.size(1) % F::bytes == 0 && K > 0, name, ": ", codes.size(1), " code bytes a row is not whole blocks");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({N, F::factors, nb}),
              name, ": scales [N, ", F::factors, ", K / 32] float32");
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  TORCH_CHECK(xf.size(1) == K, name, ": x has ", xf.size(1), " features, the weight ", K);
  const int64_t M = xf.size(0);
  const QuantRows qx = quantize(xf.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const at::Tensor b = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bp = bias.numel() ? b.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    const int64_t n_end = std::min(end * NB, N);
    // Rows in panels whose int8 codes stay in L2 while the task's columns pass over them.
    for (int64_t m0 = 0; m0 < M; m0 += MP) {
      const int64_t m1 = std::min(M, m0 + MP);
      int64_t n = begin * NB;
      for (; n + NC <= n_end; n += NC) columns<Q8, NC>(qx, cp, sp, bp, n, m0, m1, N, K, yp);
      for (; n < n_end; ++n) columns<Q8, 1>(qx, cp, sp, bp, n, m0, m1, N, K, yp);
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.to(at::kBFloat16).reshape(shape);
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
  return blocks_linear<false>(x, codes, scale_min, bias, "q4_int8_linear");
}

at::Tensor q8_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& bias) {
  RECORD_FUNCTION("tot::q8_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  return blocks_linear<true>(x, codes, scales, bias, "q8_int8_linear");
}

// Multiply-adds a second of a tight loop of the block dot product on every thread, with eight
// independent accumulators and no loads or conversions: the integer rate the kernel's inner
// instructions can reach on this machine, what its measured rate is read against.
double q4_int8_peak(int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
#if defined(Q4_AVX2)
      __m256i acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_set1_epi32(j);
      const __m256i w = _mm256_set1_epi8(static_cast<char>(7 + t)), x = _mm256_set1_epi8(-3);
      for (int64_t i = 0; i < iterations; ++i)
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_add_epi32(acc[j], block_dot(w, x));
      int64_t s = 0;
      for (int j = 0; j < 8; ++j) s += _mm256_extract_epi32(acc[j], 0);
      sink += s;
#else
      int32_t acc = 0;
      for (int64_t i = 0; i < iterations * 8 * QK; ++i) acc += static_cast<int32_t>((i + t) & 15) * -3;
      sink += acc;
#endif
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(threads * iterations * 8 * QK) / seconds;  // sink keeps the loop: it is read by no one
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
