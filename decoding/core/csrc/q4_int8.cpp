// y = x W^T with W in a GGUF file's own 4-bit blocks and x quantized to int8 per row and block of
// 32 (decoding/core/quant.py, model.activations=int8): the multiply-adds run on the integer units.
//
// W: per output n and block b of 32 inputs, 32 codes q in 0..15 (the file's own) and a float scale
// and minimum (w = scale * q + minimum; Q4_0's minimum is -8 scale, Q4_K's sub-blocks are decoded to
// this form at load), repacked at load in groups of 8 columns (below). x: each row's block quantized
// alone, d = max |x| / 127, qx = round-to-even(x / d), s = d * sum(qx). Then
//     y[m, n] = sum_b scale[n, b] * d[m, b] * (q . qx)[b]  +  minimum[n, b] * s[m, b],
// accumulated per block in order with two fused multiply-adds. The block's integer dot product is
// exact (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD with VNNI: the same integers). The tied Q8_0 LM
// head runs a column-at-a-time form of the same sums. Nothing depends on the number of rows, on
// which rows share a tile or on threads: a row gets the same bits alone or in any batch, on every
// path (the portable loop does the same operations in the same order; built with -ffp-contract=off).
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
constexpr int64_t L = 8;    // float lanes of a Q8_0 block's partial sums
constexpr int64_t R = 4;    // rows of x per tile: one weight block unpacked feeds R rows
constexpr int64_t NB = 8;   // Q8_0 output columns per parallel task
constexpr int64_t NC = 2;   // Q8_0 output columns per tile: one row's codes loaded feed NC columns
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

#if defined(Q4_AVX2)
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

// Q4 weights in groups of 8 output columns (quant.py `pack_q4`): per group and block of 32 inputs,
// 4 vectors of 32 bytes, byte 4c + i of vector j holding column c's code for input 4j + i in its
// low nibble and for input 16 + 4j + i in its high nibble; beside them, per group and block, the 8
// columns' scales then their 8 minimums (float32). A block's products for one column then sum in one
// 32-bit lane: no reduction across lanes, and the scales apply to 8 columns in one instruction.
constexpr int64_t G = 8;                // output columns per group
constexpr int64_t GROUP_BYTES = G * QK / 2;  // code bytes per group and block
constexpr int64_t GROUP_FACTORS = 2 * G;     // floats per group and block: scales, minimums

#if defined(Q4_AVX2)
// Lane c: the exact integer dot product of column c's 32 codes (v: the block's 8 unpacked vectors)
// with the row's 32 int8 codes x. AVX2: VPMADDUBSW pairs (at most 2 * 15 * 127 each, so eight of
// them add in 16 bits exactly), then VPMADDWD; VNNI: VPDPBUSD. The same integers either way.
inline __m256i group_dot(const __m256i* v, const int8_t* x) {
  auto group = [&](int j) {
    int32_t t;
    std::memcpy(&t, x + 4 * j, 4);
    return _mm256_set1_epi32(t);
  };
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), v[0], group(0));
  for (int j = 1; j < 8; ++j) dot = _mm256_dpbusd_epi32(dot, v[j], group(j));
  return dot;
#elif defined(__AVXVNNI__)
  __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), v[0], group(0));
  for (int j = 1; j < 8; ++j) dot = _mm256_dpbusd_avx_epi32(dot, v[j], group(j));
  return dot;
#else
  __m256i pairs = _mm256_maddubs_epi16(v[0], group(0));
  for (int j = 1; j < 8; ++j) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[j], group(j)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
#endif

// out[r * G + c] = row r of the tile against column c of group `w` / `f`: per block in order,
//     acc = fma(dot, scale * d, acc), then acc = fma(minimum, s, acc),
// the same operations for every column, row and tile size.
template <int64_t ROWS>
inline void q4_group(const uint8_t* w, const float* f, const int8_t* q, const float* d, const float* s, int64_t K,
                     float* out) {
  const int64_t nb = K / QK;
#if defined(Q4_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[8];
    for (int j = 0; j < 4; ++j) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * GROUP_BYTES + 32 * j));
      v[j] = _mm256_and_si256(p, low);
      v[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
    }
    const __m256 scale = _mm256_loadu_ps(f + b * GROUP_FACTORS), minimum = _mm256_loadu_ps(f + b * GROUP_FACTORS + G);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m256i dot = group_dot(v, q + r * K + b * QK);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d[r * nb + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(s[r * nb + b]), acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * G, acc[r]);
#else
  float acc[ROWS][G] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t c = 0; c < G; ++c) {
      int32_t code[QK];
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t i = 0; i < 4; ++i) {
          const uint8_t byte = w[b * GROUP_BYTES + 32 * j + 4 * c + i];
          code[4 * j + i] = byte & 0x0F;
          code[16 + 4 * j + i] = byte >> 4;
        }
      const float scale = f[b * GROUP_FACTORS + c], minimum = f[b * GROUP_FACTORS + G + c];
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* x = q + r * K + b * QK;
        int32_t dot = 0;
        for (int64_t k = 0; k < QK; ++k) dot += code[k] * x[k];
        acc[r][c] = std::fma(static_cast<float>(dot), scale * d[r * nb + b], acc[r][c]);
        acc[r][c] = std::fma(minimum, s[r * nb + b], acc[r][c]);
      }
    }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < G; ++c) out[r * G + c] = acc[r][c];
#endif
}

// Q8_0 (the LM head): per output column, blocks of 32 signed codes and a scale. The products of a
// block form 8 lanes of 4 (|w| as the unsigned operand, w's sign moved onto x), each lane converted
// and accumulated with a fused multiply-add in block order, the lanes added in a fixed tree.
// out[r * COLS + c]: row r of the tile against column c (codes + c * K, scales + c * nb).
template <int64_t ROWS, int64_t COLS>
inline void q8_columns(const int8_t* codes, const float* sc, const int8_t* q, const float* d, int64_t K, float* out) {
  const int64_t nb = K / QK;
#if defined(Q4_AVX2)
  __m256 acc[ROWS][COLS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[COLS];
    __m256 ws[COLS];
    for (int64_t c = 0; c < COLS; ++c) {
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * K + b * QK));
      ws[c] = _mm256_set1_ps(sc[c * nb + b]);
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + b * QK));
      const __m256 dx = _mm256_set1_ps(d[r * nb + b]);
      for (int64_t c = 0; c < COLS; ++c) {
        const __m256i dot = block_dot(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(x, w[c]));
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
      const int8_t* w = codes + c * K + b * QK;
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* x = q + r * K + b * QK;
        const float scale = sc[c * nb + b] * d[r * nb + b];
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

// x [.., K] as float32 rows [M, K] and their int8 blocks.
struct Rows {
  at::Tensor xf;
  QuantRows qx;
  int64_t M;
};

Rows quantized_rows(const at::Tensor& x, int64_t K, const char* name) {
  at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  TORCH_CHECK(xf.size(1) == K, name, ": x has ", xf.size(1), " features, the weight ", K);
  const int64_t M = xf.size(0);
  QuantRows qx = quantize(xf.data_ptr<float>(), M, K);
  return {xf, std::move(qx), M};
}

// y [M, N] float32 -> bfloat16 in x's shape with N features.
at::Tensor shaped(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.to(at::kBFloat16).reshape(shape);
}

const float* bias_ptr(const at::Tensor& bias, at::Tensor& holder) {
  if (!bias.numel()) return nullptr;
  holder = bias.to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
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

at::Tensor q4_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factors,
                          const at::Tensor& bias) {
  RECORD_FUNCTION("tot::q4_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) % GROUP_BYTES == 0 && packed.size(1) > 0,
              "q4_int8_linear: packed codes [N / 8, K / 32 * 128] uint8 (quant.py pack_q4)");
  const int64_t groups = packed.size(0), nb = packed.size(1) / GROUP_BYTES, K = nb * QK, N = groups * G;
  TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.is_contiguous() &&
                  factors.sizes() == at::IntArrayRef({groups, nb, 2, G}),
              "q4_int8_linear: factors [N / 8, K / 32, 2, 8] float32");
  Rows rows = quantized_rows(x, K, "q4_int8_linear");
  const int64_t M = rows.M;
  at::Tensor y = at::empty({M, N}, rows.xf.options());
  at::Tensor bias_f;
  const float* bp = bias_ptr(bias, bias_f);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* fp = factors.data_ptr<float>();
  const QuantRows& qx = rows.qx;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    float out[R * G];
    // Rows in panels whose int8 codes stay in L2 while the task's groups pass over them.
    for (int64_t m0 = 0; m0 < M; m0 += MP) {
      const int64_t m1 = std::min(M, m0 + MP);
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* w = wp + g * nb * GROUP_BYTES;
        const float* f = fp + g * nb * GROUP_FACTORS;
        auto write = [&](int64_t m, int64_t n_rows) {
          for (int64_t r = 0; r < n_rows; ++r)
            for (int64_t c = 0; c < G; ++c) yp[(m + r) * N + g * G + c] = out[r * G + c] + (bp ? bp[g * G + c] : 0.0f);
        };
        int64_t m = m0;
        for (; m + R <= m1; m += R) {
          q4_group<R>(w, f, qx.q.data() + m * K, qx.d.data() + m * nb, qx.s.data() + m * nb, K, out);
          write(m, R);
        }
        for (; m < m1; ++m) {
          q4_group<1>(w, f, qx.q.data() + m * K, qx.d.data() + m * nb, qx.s.data() + m * nb, K, out);
          write(m, 1);
        }
      }
    }
  });
  return shaped(y, x, N);
}

at::Tensor q8_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& bias) {
  RECORD_FUNCTION("tot::q8_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) % QK == 0 &&
                  codes.size(1) > 0,
              "q8_int8_linear: codes [N, K] (int8 viewed as uint8), K a multiple of 32");
  const int64_t N = codes.size(0), K = codes.size(1), nb = K / QK;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == at::IntArrayRef({N, 1, nb}),
              "q8_int8_linear: scales [N, 1, K / 32] float32");
  Rows rows = quantized_rows(x, K, "q8_int8_linear");
  const int64_t M = rows.M;
  at::Tensor y = at::empty({M, N}, rows.xf.options());
  at::Tensor bias_f;
  const float* bp = bias_ptr(bias, bias_f);
  float* yp = y.data_ptr<float>();
  const int8_t* cp = reinterpret_cast<const int8_t*>(codes.data_ptr<uint8_t>());
  const float* sp = scales.data_ptr<float>();
  const QuantRows& qx = rows.qx;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    const int64_t n_end = std::min(end * NB, N);
    float out[R * NC];
    for (int64_t m0 = 0; m0 < M; m0 += MP) {
      const int64_t m1 = std::min(M, m0 + MP);
      for (int64_t n = begin * NB; n < n_end;) {
        const int64_t cols = n + NC <= n_end ? NC : 1;
        auto tile = [&](int64_t m, int64_t n_rows) {
          const int8_t* q = qx.q.data() + m * K;
          const float* d = qx.d.data() + m * nb;
          if (n_rows == R && cols == NC) q8_columns<R, NC>(cp + n * K, sp + n * nb, q, d, K, out);
          else if (n_rows == R) q8_columns<R, 1>(cp + n * K, sp + n * nb, q, d, K, out);
          else if (cols == NC) q8_columns<1, NC>(cp + n * K, sp + n * nb, q, d, K, out);
          else q8_columns<1, 1>(cp + n * K, sp + n * nb, q, d, K, out);
          for (int64_t r = 0; r < n_rows; ++r)
            for (int64_t c = 0; c < cols; ++c) yp[(m + r) * N + n + c] = out[r * cols + c] + (bp ? bp[n + c] : 0.0f);
        };
        int64_t m = m0;
        for (; m + R <= m1; m += R) tile(m, R);
        for (; m < m1; ++m) tile(m, 1);
        n += cols;
      }
    }
  });
  return shaped(y, x, N);
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
