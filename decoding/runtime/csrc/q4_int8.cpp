// y = x W^T with W in a GGUF file's own 4-bit blocks and x quantized to int8 per row and block of
// 32 (decoding/runtime/quant.py, model.activations=int8): the multiply-adds run on the integer units.
//
// W: per output n and block b of 32 inputs, 32 codes q in 0..15 (the file's own) and a float scale
// and minimum (w = scale * q + minimum; Q4_0's minimum is -8 scale, Q4_K's sub-blocks are decoded to
// this form at load), repacked at load in groups of 8 columns (below). x: each row's block quantized
// alone, d = max |x| / 127, qx = round-to-even(x / d), s = d * sum(qx). Then
//     y[m, n] = sum_b scale[n, b] * d[m, b] * (q . qx)[b]  +  minimum[n, b] * s[m, b],
// accumulated per block in order with two fused multiply-adds. The block's integer dot product is
// exact (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD with VNNI, TDPBSUD on AMX tiles of 16 rows: the
// same integers; with VNNI a signed code w is read as the byte w + 128 and 128 times the block's sum of
// x taken off, one instruction a product instead of two). Q8_0 and Q5_0 layers (signed codes, one
// scale a block) run the same sums without
// the minimum term, Q6_K's (signed codes, a scale per 16 inputs) as two such sums a block. In two levels
// (quant.py: the attention's projections) the residual x - d qx is quantized again, d2 and qx2, and
// each block adds scale * d2 * (q . qx2) after its first term: the input to about 16 bits for one more
// dot product per unpacked block. With k_block 256 (model.activations=int8_256) a K-quant layer's
// input takes one scale per super-block of 256 inputs instead (llama.cpp's Q8_K rule): the file's
// integer sub-block scales then multiply the blocks' integer dot products, the minimums multiply the
// blocks' integer code sums, both summed exactly in int32 over the super-block, and one float epilogue
// per 256 inputs finishes them (super_tile) where the per-32 format spends one per 32. Nothing depends
// on the number of rows, on which rows share a tile or on threads: a row gets the same bits alone or
// in any batch, on every path (the portable loop does the same operations in the same order; built
// with -ffp-contract=off).
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
#if defined(Q4_AVX2) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512DQ__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define Q4_AMX 1
#endif

namespace {

constexpr int64_t QK = 32;  // inputs per block
constexpr int64_t SB = 8;   // blocks per super-block (a K-quant's 256 inputs)
constexpr int64_t L = 8;    // 32-bit lanes of an AVX2 register
// Rows of x per tile: one weight block unpacked feeds R rows. With AVX-512's 32 vector registers
// eight rows' accumulators stand beside a block's eight code vectors; with AVX2's 16, four.
#if defined(__AVX512VL__)
constexpr int64_t R = 8;
#else
constexpr int64_t R = 4;
#endif
// Blocks ahead whose codes a group's first tile of rows prefetches: with a few rows the tile's integer
// work and the weights' arrival from memory otherwise take turns (8 rows x 1536 x 250k: 18 -> 15 ms).
constexpr int64_t PF = 16;
constexpr int64_t MP = 64;  // rows per panel (a multiple of R: a row's tile does not depend on M)

struct QuantRows {
  int64_t block;           // inputs per scale: QK, or SB * QK (super-blocks: a K-quant layer's k_block 256)
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / block]
  std::vector<float> s;    // [M, K / 32]: d * sum(q) per block of 32 (QK blocks only; else empty)
  std::vector<int8_t> q2;  // two levels: the first level's residual quantized alone [M, K]; else empty
  std::vector<float> d2;   // ... and its scales [M, K / block]
  std::vector<int32_t> c;   // -128 times the sum of each block's codes 0-15 and 16-31 [M, K / 32, 2]
  std::vector<int32_t> c2;  // ... of the second level's codes (two levels; else empty)
  std::vector<int16_t> n;   // super-blocks: the sum of each block's codes [M, K / 32]; else empty
  std::vector<int16_t> n2;  // ... of the second level's (two levels)
};

// -128 times the sums of a block's first and last 16 codes: what turns a signed code w read as the
// unsigned byte w + 128 back into w's dot product (sum (w + 128) x - 128 sum x = sum w x, exactly).
void half_sums(const int8_t* q, int32_t* c) {
  int32_t lo = 0, hi = 0;
  for (int64_t i = 0; i < QK / 2; ++i) lo += q[i], hi += q[QK / 2 + i];
  c[0] = -128 * lo, c[1] = -128 * hi;
}

// max |x| over a block of 32 inputs (exact: the same value on every path).
float block_amax(const float* xb) {
#if defined(Q4_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m4 = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
  for (int k = 1; k < 4; ++k) m4 = _mm256_max_ps(m4, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * k)));
  alignas(32) float lanes[L];
  _mm256_store_ps(lanes, m4);
  float amax = 0.0f;
  for (int64_t l = 0; l < L; ++l) amax = std::max(amax, lanes[l]);
  return amax;
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  return amax;
#endif
}

// A block's codes q = round-to-even(x * inv); returns sum(q). The same arithmetic on every path
// (one rounding of the product; nearbyint is round-half-even like _mm256_round_ps's nearest mode).
int32_t code_block(const float* xb, float inv, int8_t* q) {
  int32_t sum = 0;
#if defined(Q4_AVX2)
  // Rounded to nearest even, as nearbyint; packing saturates nothing (|code| <= 127).
  __m256i c[4];
  for (int k = 0; k < 4; ++k)
    c[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), _mm256_set1_ps(inv)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  // The packs work within 128-bit halves: put the eight 4-byte groups back in order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int32_t partial[L];
  _mm256_store_si256(reinterpret_cast<__m256i*>(partial),
                     _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
  for (int64_t l = 0; l < L; ++l) sum += partial[l];
#else
  for (int64_t i = 0; i < QK; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
#endif
  return sum;
}

// `blocks` blocks of 32 inputs under one scale d = max |x| / 127, q = round-to-even(x * 127 / max |x|),
// each block's code sum into `sums`, its halves' into c (half_sums).
void quantize_span(const float* x, int64_t blocks, int8_t* q, float* d, int32_t* sums, int32_t* c) {
  float amax = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) amax = std::max(amax, block_amax(x + b * QK));
  *d = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = code_block(x + b * QK, inv, q + b * QK);
    half_sums(q + b * QK, c + 2 * b);
  }
}

// One row's spans (a block of 32 each, or a super-block of 8 blocks), s = d * sum(q) per block of 32.
// With two levels, the residual x - d q (one rounding, fma) is quantized again by the same rule,
// x ~ d q + d2 q2 to about 16 bits, and s = d * sum(q) + d2 * sum(q2). Super-blocks keep each block's
// code sums (n, n2) for the kernel's integer minimum term instead of s.
void quantize_row(const float* x, int64_t K, int64_t block, int8_t* q, float* d, float* s, int32_t* c, int16_t* n,
                  int8_t* q2, float* d2, int32_t* c2, int16_t* n2) {
  const int64_t per = block / QK;
  int32_t sums[SB], sums2[SB];
  float residual[SB * QK];
  for (int64_t span = 0; span < K / block; ++span) {
    const int64_t b0 = span * per;
    const float* xs = x + b0 * QK;
    quantize_span(xs, per, q + b0 * QK, d + span, sums, c + 2 * b0);
    if (q2) {
      for (int64_t i = 0; i < block; ++i) residual[i] = std::fma(-d[span], static_cast<float>(q[b0 * QK + i]), xs[i]);
      quantize_span(residual, per, q2 + b0 * QK, d2 + span, sums2, c2 + 2 * b0);
    }
    for (int64_t b = 0; b < per; ++b) {
      if (n) {
        n[b0 + b] = static_cast<int16_t>(sums[b]);
        if (q2) n2[b0 + b] = static_cast<int16_t>(sums2[b]);
      } else {
        s[b0 + b] = d[span] * static_cast<float>(sums[b]);
        if (q2) s[b0 + b] = std::fma(d2[span], static_cast<float>(sums2[b]), s[b0 + b]);
      }
    }
  }
}

// Rows x [M, K] quantized with a scale per `block` inputs (QK, or SB * QK: super-blocks); with `norm` (a
// weight [K], else null) each row is first normalized into `normed` (RMSNorm, norm_row), in the same
// task: one parallel region, rows split in fours.
QuantRows quantize(const float* x, int64_t M, int64_t K, int64_t levels, int64_t block, const float* norm = nullptr,
                   float eps = 0.0f, float* normed = nullptr) {
  TORCH_CHECK(levels == 1 || levels == 2, "q4_int8: activations in 1 or 2 int8 levels, not ", levels);
  TORCH_CHECK((block == QK || block == SB * QK) && K % block == 0, "q4_int8: a scale per ", QK, " or ", SB * QK,
              " inputs dividing the ", K, " features, not ", block);
  const int64_t nb = K / QK, ns = K / block, fine = levels == 2 ? M : 0, super = block == QK ? 0 : M;
  QuantRows r{block,
              std::vector<int8_t>(M * K),
              std::vector<float>(M * ns),
              std::vector<float>(super ? 0 : M * nb),
              std::vector<int8_t>(fine * K),
              std::vector<float>(fine * ns),
              std::vector<int32_t>(M * nb * 2),
              std::vector<int32_t>(fine * nb * 2),
              std::vector<int16_t>(super * nb),
              std::vector<int16_t>(fine && super ? M * nb : 0)};
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      if (norm != nullptr) {
        norm_row(row, norm, normed + m * K, K, eps);
        row = normed + m * K;
      }
      quantize_row(row, K, block, r.q.data() + m * K, r.d.data() + m * ns, super ? nullptr : r.s.data() + m * nb,
                   r.c.data() + m * nb * 2, super ? r.n.data() + m * nb : nullptr, fine ? r.q2.data() + m * K : nullptr,
                   fine ? r.d2.data() + m * ns : nullptr, fine ? r.c2.data() + m * nb * 2 : nullptr,
                   fine && super ? r.n2.data() + m * nb : nullptr);
    }
  });
  return r;
}

// Weights in groups of 8 output columns (quant.py `pack_q4`, `pack_q8`), per group and block of 32
// inputs:
//   Q4: 4 vectors of 32 bytes, byte 4c + i of vector j holding column c's code for input 4j + i in
//       its low nibble and for input 16 + 4j + i in its high nibble; then the 8 columns' scales and
//       their 8 minimums (float32);
//   Q8 (Q8_0 and Q5_0): 8 vectors of 32 signed bytes, byte 4c + i of vector j column c's code for
//       input 4j + i; then the 8 columns' scales;
//   Q8 in halves (Q6_K, HALVES): Q8's codes, then the 8 columns' scales of inputs 0-15 and their 8
//       scales of inputs 16-31 (Q6_K's sub-blocks of 16 each have their own).
// A block's products for one column then sum in one 32-bit lane: no reduction across lanes, and the
// scales apply to 8 columns in one instruction.
constexpr int64_t G = 8;  // output columns per group

template <bool Q8, bool HALVES = false>
struct Format {
  static constexpr int64_t bytes = Q8 ? G * QK : G * QK / 2;             // code bytes per group and block
  static constexpr int64_t factors = Q8 && !HALVES ? G : 2 * G;          // floats per group and block
};

// K-quants' factors as their files hold them (quant.py `pack_k_factors`): 24 (Q4_K) or 20 (Q6_K) bytes
// a group and block instead of 64, what a forward of one token reads besides the codes. Per group and super-block of 8
// blocks (256 inputs): the 8 columns' float d (Q4_K: then their dmin), then per block 8 columns' bytes
// of one kind and 8 of the other: Q4_K's 6-bit scale and minimum (scale = d sc, minimum = -(dmin mn)),
// Q6_K's signed 8-bit scales of inputs 0-15 and 16-31 (d lo, d hi). expand_factors forms the float32
// factors of a group with the loader's own products (each exact in float32), so the bits are those of
// the float32 layout's.

template <bool HALVES>
struct Compact {
  static constexpr int64_t floats = HALVES ? G : 2 * G;               // per group and super-block
  static constexpr int64_t bytes = floats * 4 + SB * 2 * G;           // ... in all
};

template <bool HALVES>
void expand_factors(const uint8_t* compact, int64_t nb, float* out) {
  using C = Compact<HALVES>;
  for (int64_t sb = 0; sb < nb / SB; ++sb) {
    const uint8_t* at = compact + sb * C::bytes;
    float d[G], dmin[G];
    std::memcpy(d, at, sizeof d);
    if (!HALVES) std::memcpy(dmin, at + sizeof d, sizeof dmin);
    const uint8_t* small = at + C::floats * 4;
    for (int64_t b = 0; b < SB; ++b, small += 2 * G) {
      float* o = out + (sb * SB + b) * 2 * G;
      for (int64_t c = 0; c < G; ++c) {
        if (HALVES) {
          o[c] = d[c] * static_cast<float>(static_cast<int8_t>(small[c]));
          o[G + c] = d[c] * static_cast<float>(static_cast<int8_t>(small[G + c]));
        } else {
          o[c] = d[c] * static_cast<float>(small[c]);
          o[G + c] = -(dmin[c] * static_cast<float>(small[G + c]));
        }
      }
    }
  }
}

#if defined(Q4_AVX2)
inline __m256i x_group(const int8_t* x, int j) {  // x[4j..4j+3] in every lane
  int32_t t;
  std::memcpy(&t, x + 4 * j, 4);
  return _mm256_set1_epi32(t);
}

// u8 x s8 products of 4 bytes a lane summed into acc: VPDPBUSD, or VPMADDUBSW + VPMADDWD (the same
// integers wherever no pair of products passes 16 bits, as in both formats here).
inline __m256i dot_add(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// dot_add against x's group j in every lane. With AVX-512 VNNI the 4 bytes are read by VPDPBUSD itself
// (an embedded broadcast, {1to8}; the same integers): a broadcast apart took a vector operation beside
// each product on Zen 4 (docs/performance.md, the Qwen2.5-Coder pair). As asm: GCC does not fold
// _mm256_set1_epi32 of a load into the instruction.
inline __m256i dot_add_group(__m256i acc, __m256i u, const int8_t* x, int j) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  using Bytes4 = int32_t __attribute__((may_alias));  // the operand names x's own memory, not a copy
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const Bytes4*>(x + 4 * j)));
  return acc;
#else
  return dot_add(acc, u, x_group(x, j));
#endif
}

// Lane c: the exact integer dot product of column c's 32 codes with the row's 32 int8 codes x.
// Q4 (v: the 8 unpacked vectors, codes 0..15): without VNNI the pairs (at most 2 * 15 * 127) add
// eight times in 16 bits exactly before one VPMADDWD. Q8 (v: |w|, w: the signed codes): w's sign
// moved onto x, each pair (at most 2 * 127 * 127) widened at once.
inline __m256i q4_dot(const __m256i* v, const int8_t* x) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) lo = dot_add_group(lo, v[j], x, j), hi = dot_add_group(hi, v[j + 4], x, j + 4);
  return _mm256_add_epi32(lo, hi);
#else
  __m256i pairs = _mm256_maddubs_epi16(v[0], x_group(x, 0));
  for (int j = 1; j < 8; ++j) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[j], x_group(x, j)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define Q8_BIASED 1  // VPDPBUSD widens each product at once: codes read as w + 128, x's sum taken off
#endif

// Q8's lane c: column c's codes against x over vectors [J0, J1) (inputs 4 J0 to 4 J1 - 1). With VNNI
// v holds w + 128 and the sum starts at c, -128 sum x over those inputs; else v holds |w| and w's sign
// moves onto x (VPMADDUBSW's pairs of (w + 128) x would pass 16 bits).
template <int J0 = 0, int J1 = 8>
inline __m256i q8_dot(const __m256i* v, const uint8_t* w, const int8_t* x, int32_t c) {
#if defined(Q8_BIASED)
  if (J1 - J0 < 8) {
    __m256i dot = _mm256_set1_epi32(c);
    for (int j = J0; j < J1; ++j) dot = dot_add_group(dot, v[j], x, j);
    return dot;
  }
  __m256i lo = _mm256_set1_epi32(c), hi = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) lo = dot_add_group(lo, v[j], x, j), hi = dot_add_group(hi, v[j + 4], x, j + 4);
  return _mm256_add_epi32(lo, hi);
#else
  __m256i dot = _mm256_setzero_si256();
  for (int j = J0; j < J1; ++j) {
    const __m256i signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
    dot = dot_add(dot, v[j], _mm256_sign_epi8(x_group(x, j), signs));
  }
  (void)c;
  return dot;
#endif
}
#endif

#if defined(Q4_AVX2)
// A group's block of codes (wb, BYTES of them) as the dot products read them: Q8's signed codes as the
// bytes w + 128 (VNNI) or |w| (q8_dot), Q4's nibbles as 8 vectors of 0..15 (q4_dot); with `prefetch` the
// block PF ahead is asked for (a group's first tile reads its codes from memory).
template <bool Q8, int64_t BYTES>
inline void block_codes(const uint8_t* wb, bool prefetch, __m256i* v) {
  if (prefetch)
    for (int64_t at = 0; at < BYTES; at += 64) __builtin_prefetch(wb + PF * BYTES + at);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < (Q8 ? 8 : 4); ++j) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
    if (Q8) {
#if defined(Q8_BIASED)
      v[j] = _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
      v[j] = _mm256_abs_epi8(p);
#endif
    } else {
      v[j] = _mm256_and_si256(p, low);
      v[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
    }
  }
}

// Block b's float32 factors for the group's 8 columns: its scales, and the second vector (Q4: the
// minimums; halves: the scales of inputs 16-31; Q8: none), from the float32 layout or, COMPACT, formed
// from a K-quant's (expand_factors' products, the same bits).
template <bool Q8, bool HALVES, bool COMPACT>
inline void block_factors(const uint8_t* f, int64_t b, __m256& first, __m256& second) {
  if (!COMPACT) {
    const float* fb = reinterpret_cast<const float*>(f) + b * Format<Q8, HALVES>::factors;
    first = _mm256_loadu_ps(fb);
    if (!Q8 || HALVES) second = _mm256_loadu_ps(fb + G);
    return;
  }
  const uint8_t* at = f + b / SB * Compact<HALVES>::bytes;
  const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(at));
  const uint8_t* small = at + Compact<HALVES>::floats * 4 + b % SB * 2 * G;
  auto widen = [&](const uint8_t* bytes) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    return _mm256_cvtepi32_ps(HALVES ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
  };
  first = _mm256_mul_ps(d, widen(small));
  if (HALVES) {
    second = _mm256_mul_ps(d, widen(small + G));
  } else {
    const __m256 dmin = _mm256_loadu_ps(reinterpret_cast<const float*>(at) + G);
    second = _mm256_xor_ps(_mm256_mul_ps(dmin, widen(small + G)), _mm256_set1_ps(-0.0f));
  }
}
#endif

// Column c's code for input k of a block (w: the group's block).
template <bool Q8>
inline int32_t code_at(const uint8_t* w, int64_t c, int64_t k) {
  if (Q8) return static_cast<int8_t>(w[32 * (k / 4) + 4 * c + k % 4]);
  const uint8_t byte = w[32 * (k % 16 / 4) + 4 * c + k % 4];
  return k < 16 ? byte & 0x0F : byte >> 4;
}

// The tile's rows in int8: codes, scales and sums from row 0 on (rows K codes and K / 32 factors
// apart), and the second level's codes and scales (TWO).
struct TileRows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int8_t* q2;
  const float* d2;
  const int32_t* c;
  const int32_t* c2;
  const int16_t* n;   // super-blocks: each block's code sums (else null)
  const int16_t* n2;
};

// out[r * G + c] = row r of the tile against column c of group `w` / `f`: per block in order,
//     acc = fma(dot, scale * d, acc), (TWO) acc = fma(dot2, scale * d2, acc), (Q4) acc = fma(minimum, s, acc),
// the same operations for every column, row and tile size; in halves each product is two, the block's
// first 16 inputs with their scale, then its last 16 with theirs.
// Not inlined: each tile size compiles alone, and the compiler keeps its accumulators in registers (inlined
// into one dispatch, 8 rows' tile ran 1.3x slower as more sizes were added beside it).
template <bool Q8, int64_t ROWS, bool TWO, bool HALVES, bool COMPACT>
__attribute__((noinline)) void group_tile(const uint8_t* w, const uint8_t* f_bytes, const TileRows& x_rows, int64_t K,
                                          bool prefetch, float* out) {
  const int8_t *q = x_rows.q, *q2 = x_rows.q2;
  const float *d = x_rows.d, *s = x_rows.s, *d2 = x_rows.d2;
  using F = Format<Q8, HALVES>;
  const int64_t nb = K / QK;
#if defined(Q4_AVX2)
  const int32_t *c = x_rows.c, *c2 = x_rows.c2;
  __m256 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * F::bytes;
    __m256i v[8];
    block_codes<Q8, F::bytes>(wb, prefetch, v);
    __m256 scale, second = _mm256_setzero_ps();
    block_factors<Q8, HALVES, COMPACT>(f_bytes, b, scale, second);
    if (HALVES) {
      const __m256 upper = second;
      auto half = [&](__m256 a, const int8_t* x, float dx, const int32_t* cx) {
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot<0, 4>(v, wb, x, cx[0])), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), a);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot<4, 8>(v, wb, x, cx[1])), _mm256_mul_ps(upper, _mm256_set1_ps(dx)),
                               a);
      };
      for (int64_t r = 0; r < ROWS; ++r) {
        acc[r] = half(acc[r], q + r * K + b * QK, d[r * nb + b], c + (r * nb + b) * 2);
        if (TWO) acc[r] = half(acc[r], q2 + r * K + b * QK, d2[r * nb + b], c2 + (r * nb + b) * 2);
      }
      continue;
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* x = q + r * K + b * QK;
      const int32_t* cx = c + (r * nb + b) * 2;
      const __m256i dot = Q8 ? q8_dot(v, wb, x, cx[0] + cx[1]) : q4_dot(v, x);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d[r * nb + b])), acc[r]);
      if (TWO) {
        const int8_t* x2 = q2 + r * K + b * QK;
        const int32_t* cx2 = c2 + (r * nb + b) * 2;
        const __m256i dot2 = Q8 ? q8_dot(v, wb, x2, cx2[0] + cx2[1]) : q4_dot(v, x2);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_mul_ps(scale, _mm256_set1_ps(d2[r * nb + b])), acc[r]);
      }
      if (!Q8) acc[r] = _mm256_fmadd_ps(second, _mm256_set1_ps(s[r * nb + b]), acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * G, acc[r]);
#else
  (void)prefetch;
  std::vector<float> formed(COMPACT ? nb * 2 * G : 0);
  if (COMPACT) expand_factors<HALVES>(f_bytes, nb, formed.data());
  const float* f = COMPACT ? formed.data() : reinterpret_cast<const float*>(f_bytes);
  float acc[ROWS][G] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t c = 0; c < G; ++c) {
      int32_t code[QK];
      for (int64_t k = 0; k < QK; ++k) code[k] = code_at<Q8>(w + b * F::bytes, c, k);
      const float* fb = f + b * F::factors;
      if (HALVES) {
        auto half = [&](float a, const int8_t* x, float dx) {
          int32_t lo = 0, hi = 0;
          for (int64_t k = 0; k < QK / 2; ++k) lo += code[k] * x[k];
          for (int64_t k = QK / 2; k < QK; ++k) hi += code[k] * x[k];
          a = std::fma(static_cast<float>(lo), fb[c] * dx, a);
          return std::fma(static_cast<float>(hi), fb[G + c] * dx, a);
        };
        for (int64_t r = 0; r < ROWS; ++r) {
          acc[r][c] = half(acc[r][c], q + r * K + b * QK, d[r * nb + b]);
          if (TWO) acc[r][c] = half(acc[r][c], q2 + r * K + b * QK, d2[r * nb + b]);
        }
        continue;
      }
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* x = q + r * K + b * QK;
        int32_t dot = 0;
        for (int64_t k = 0; k < QK; ++k) dot += code[k] * x[k];
        acc[r][c] = std::fma(static_cast<float>(dot), fb[c] * d[r * nb + b], acc[r][c]);
        if (TWO) {
          const int8_t* x2 = q2 + r * K + b * QK;
          int32_t dot2 = 0;
          for (int64_t k = 0; k < QK; ++k) dot2 += code[k] * x2[k];
          acc[r][c] = std::fma(static_cast<float>(dot2), fb[c] * d2[r * nb + b], acc[r][c]);
        }
        if (!Q8) acc[r][c] = std::fma(fb[G + c], s[r * nb + b], acc[r][c]);
      }
    }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < G; ++c) out[r * G + c] = acc[r][c];
#endif
}

#if defined(Q4_AVX2)
// A sub-block's integer scales for the group's 8 columns (the compact factors' bytes): Q4_K's 6-bit
// scale or minimum (unsigned), Q6_K's signed byte.
template <bool SIGNED>
inline __m256i small_ints(const uint8_t* bytes) {
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  return SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
}

// Lane c: sc[c] times column c's block dot product with x (Q4 codes), exactly. With VNNI the dot's
// int32 times sc; without, sc multiplies the block's 16-bit pair sums in the VPMADDWD that widens them
// (sc16: sc in both halves of each lane; |pairs| <= 8 * 2 * 15 * 127, times 63 twice: no overflow).
inline __m256i q4_dot_scaled(const __m256i* v, const int8_t* x, __m256i sc, __m256i sc16) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  (void)sc16;
  return _mm256_mullo_epi32(q4_dot(v, x), sc);
#else
  (void)sc;
  __m256i pairs = _mm256_maddubs_epi16(v[0], x_group(x, 0));
  for (int j = 1; j < 8; ++j) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[j], x_group(x, j)));
  return _mm256_madd_epi16(pairs, sc16);
#endif
}
#endif

// Super-blocks (a K-quant layer with k_block 256: one activation scale dx per 256 inputs): per
// super-block, row and column, the integer sums
//     S1 = sum_b sc_b (q . qx)_b   (halves: sum over both halves of each block, lo_b and hi_b)
//     S2 = sum_b mn_b n_b          (Q4_K: n_b the block's code sum; halves: none)
// are exact in int32 (|S1| < 2^25 for Q4_K, < 2^28 for Q6_K), and one float epilogue finishes them:
//     t = float(S1) * d, (Q4_K) t = fma(-float(S2), dmin, t), acc = fma(t, dx, acc)
// (TWO: then the same for the second level's sums and dx2). The same operations for every column, row
// and tile size, on every path: a row's bits depend on that row alone.
template <bool HALVES, int64_t ROWS, bool TWO>
__attribute__((noinline)) void super_tile(const uint8_t* w, const uint8_t* f, const TileRows& x_rows, int64_t K,
                                          bool prefetch, float* out) {
  using F = Format<HALVES, HALVES>;  // Q4 codes (Q4_K) or Q8 codes in halves (Q6_K)
  using C = Compact<HALVES>;
  const int64_t nb = K / QK, ns = nb / SB;
  const int8_t *q = x_rows.q, *q2 = x_rows.q2;
  const float *d = x_rows.d, *d2 = x_rows.d2;
  const int16_t *n = x_rows.n, *n2 = x_rows.n2;
#if defined(Q4_AVX2)
  const int32_t *c = x_rows.c, *c2 = x_rows.c2;
  // The float sums wait in `out` between super-blocks (read and written once per 256 inputs), so the
  // registers hold the integer sums and the block's codes.
  for (int64_t i = 0; i < ROWS * G; ++i) out[i] = 0.0f;
  for (int64_t sb = 0; sb < ns; ++sb) {
    const uint8_t* head = f + sb * C::bytes;
    __m256i s1[ROWS], s2[TWO ? ROWS : 1];
    for (int64_t r = 0; r < ROWS; ++r) s1[r] = _mm256_setzero_si256();
    if (TWO)
      for (int64_t r = 0; r < ROWS; ++r) s2[r] = _mm256_setzero_si256();
    for (int64_t b = sb * SB; b < sb * SB + SB; ++b) {
      const uint8_t* sm = head + C::floats * 4 + b % SB * 2 * G;
      const uint8_t* wb = w + b * F::bytes;
      __m256i v[8];
      block_codes<HALVES, F::bytes>(wb, prefetch, v);
      if (HALVES) {
        const __m256i lo = small_ints<true>(sm), hi = small_ints<true>(sm + G);
        auto scaled = [&](const int8_t* xb, const int32_t* cx) {
          return _mm256_add_epi32(_mm256_mullo_epi32(q8_dot<0, 4>(v, wb, xb, cx[0]), lo),
                                  _mm256_mullo_epi32(q8_dot<4, 8>(v, wb, xb, cx[1]), hi));
        };
        for (int64_t r = 0; r < ROWS; ++r) {
          s1[r] = _mm256_add_epi32(s1[r], scaled(q + r * K + b * QK, c + (r * nb + b) * 2));
          if (TWO) s2[r] = _mm256_add_epi32(s2[r], scaled(q2 + r * K + b * QK, c2 + (r * nb + b) * 2));
        }
      } else {
        const __m256i sc = small_ints<false>(sm), sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
        for (int64_t r = 0; r < ROWS; ++r) {
          s1[r] = _mm256_add_epi32(s1[r], q4_dot_scaled(v, q + r * K + b * QK, sc, sc16));
          if (TWO) s2[r] = _mm256_add_epi32(s2[r], q4_dot_scaled(v, q2 + r * K + b * QK, sc, sc16));
        }
      }
    }
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(head));
    if (HALVES) {
      for (int64_t r = 0; r < ROWS; ++r) {
        __m256 a = _mm256_loadu_ps(out + r * G);
        a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s1[r]), dw), _mm256_set1_ps(d[r * ns + sb]), a);
        if (TWO) a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s2[r]), dw), _mm256_set1_ps(d2[r * ns + sb]), a);
        _mm256_storeu_ps(out + r * G, a);
      }
      continue;
    }
    // The minimums against the blocks' code sums: blocks 2k and 2k + 1 as 16-bit pairs, one VPMADDWD (with
    // VNNI one VPDPWSSD, which adds them in too: the same integers, 8-12% off a Q4_K layer on Zen 4).
    const __m256 dmin = _mm256_loadu_ps(reinterpret_cast<const float*>(head) + G);
    const uint8_t* mins = head + C::floats * 4 + G;
    __m256i mn[SB / 2];
    for (int k = 0; k < SB / 2; ++k)
      mn[k] = _mm256_or_si256(small_ints<false>(mins + 4 * k * G),
                              _mm256_slli_epi32(small_ints<false>(mins + (4 * k + 2) * G), 16));
    auto epilogue = [&](__m256i sum, const int16_t* sums, float dx, __m256 a) {
      __m256i m = _mm256_setzero_si256();
      for (int k = 0; k < SB / 2; ++k) {
        int32_t pair;
        std::memcpy(&pair, sums + 2 * k, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        m = _mm256_dpwssd_epi32(m, mn[k], _mm256_set1_epi32(pair));
#else
        m = _mm256_add_epi32(m, _mm256_madd_epi16(mn[k], _mm256_set1_epi32(pair)));
#endif
      }
      const __m256 t = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), dw));
      return _mm256_fmadd_ps(t, _mm256_set1_ps(dx), a);
    };
    for (int64_t r = 0; r < ROWS; ++r) {
      __m256 a = epilogue(s1[r], n + r * nb + sb * SB, d[r * ns + sb], _mm256_loadu_ps(out + r * G));
      if (TWO) a = epilogue(s2[r], n2 + r * nb + sb * SB, d2[r * ns + sb], a);
      _mm256_storeu_ps(out + r * G, a);
    }
  }
#else
  (void)prefetch;
  float acc[ROWS][G] = {};
  for (int64_t sb = 0; sb < ns; ++sb) {
    const uint8_t* head = f + sb * C::bytes;
    const uint8_t* small = head + C::floats * 4;
    float dw[G], dmin[G];
    std::memcpy(dw, head, sizeof dw);
    if (!HALVES) std::memcpy(dmin, head + sizeof dw, sizeof dmin);
    for (int64_t col = 0; col < G; ++col) {
      int32_t code[SB][QK];
      for (int64_t b = 0; b < SB; ++b)
        for (int64_t k = 0; k < QK; ++k) code[b][k] = code_at<HALVES>(w + (sb * SB + b) * F::bytes, col, k);
      // S1 (and S2) of one level's rows, as the vector path forms them
      auto level = [&](const int8_t* xq, const int16_t* sums, float dx, float a) {
        int32_t s1 = 0, s2 = 0;
        for (int64_t b = 0; b < SB; ++b) {
          const int8_t* xb = xq + (sb * SB + b) * QK;
          const uint8_t* sm = small + b * 2 * G;
          if (HALVES) {
            int32_t lo = 0, hi = 0;
            for (int64_t k = 0; k < QK / 2; ++k) lo += code[b][k] * xb[k];
            for (int64_t k = QK / 2; k < QK; ++k) hi += code[b][k] * xb[k];
            s1 += lo * static_cast<int8_t>(sm[col]) + hi * static_cast<int8_t>(sm[G + col]);
          } else {
            int32_t dot = 0;
            for (int64_t k = 0; k < QK; ++k) dot += code[b][k] * xb[k];
            s1 += dot * sm[col];
            s2 += sm[G + col] * sums[sb * SB + b];
          }
        }
        float t = static_cast<float>(s1) * dw[col];
        if (!HALVES) t = std::fma(-static_cast<float>(s2), dmin[col], t);
        return std::fma(t, dx, a);
      };
      for (int64_t r = 0; r < ROWS; ++r) {
        acc[r][col] = level(q + r * K, HALVES ? nullptr : n + r * nb, d[r * ns + sb], acc[r][col]);
        if (TWO) acc[r][col] = level(q2 + r * K, HALVES ? nullptr : n2 + r * nb, d2[r * ns + sb], acc[r][col]);
      }
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t col = 0; col < G; ++col) out[r * G + col] = acc[r][col];
#endif
}

#if defined(Q4_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_WIDE 1
constexpr int64_t PAIR_ROWS = 4 * R;  // a panel's rows from which super-blocks run two groups a tile
// Two groups side by side in the 512-bit registers (super_pair): each broadcast of x's 4 bytes and each
// row's epilogue serve 16 columns instead of 8, and a pair's minimums are formed once for all its tiles
// (Zen 4, whose 512-bit operations take two 256-bit slots: a Q4_K layer at 64-128 rows +7-12%, Q6_K +15%,
// Q6_K in two levels +56%, whose 256-bit tile spills). Lane c of the low half is group g's column c, of
// the high half group g + 1's: every lane runs super_tile's operations in its order, so a column's bits
// are the same whichever tile ran it.
inline __m512i wide_dot_add_group(__m512i acc, __m512i u, const int8_t* x, int j) {
  using Bytes4 = int32_t __attribute__((may_alias));
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const Bytes4*>(x + 4 * j)));
  return acc;
}

inline __m512i wide_bytes(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each group
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 wide_floats(const uint8_t* a, const uint8_t* b) {  // 8 floats of each group
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(reinterpret_cast<const float*>(a))),
                            _mm256_loadu_ps(reinterpret_cast<const float*>(b)), 1);
}

template <bool SIGNED>
inline __m512i wide_small_ints(const uint8_t* a, const uint8_t* b) {  // small_ints of each group
  const __m128i sixteen = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return SIGNED ? _mm512_cvtepi8_epi32(sixteen) : _mm512_cvtepu8_epi32(sixteen);
}

// block_codes of both groups (Q8 codes biased, as Q8_BIASED reads them: VNNI is given here).
template <bool Q8, int64_t BYTES>
inline void wide_block_codes(const uint8_t* w0, const uint8_t* w1, bool prefetch, __m512i* v) {
  if (prefetch)
    for (int64_t at = 0; at < BYTES; at += 64)
      __builtin_prefetch(w0 + PF * BYTES + at), __builtin_prefetch(w1 + PF * BYTES + at);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < (Q8 ? 8 : 4); ++j) {
    const __m512i p = wide_bytes(w0 + 32 * j, w1 + 32 * j);
    if (Q8) {
      v[j] = _mm512_xor_si512(p, _mm512_set1_epi8(static_cast<char>(0x80)));
    } else {
      v[j] = _mm512_and_si512(p, low);
      v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
  }
}

// q8_dot<J0, J0 + 4> (biased: from c) and q4_dot, both groups' columns.
template <int J0>
inline __m512i wide_q8_half(const __m512i* v, const int8_t* x, int32_t c) {
  __m512i dot = _mm512_set1_epi32(c);
  for (int j = J0; j < J0 + 4; ++j) dot = wide_dot_add_group(dot, v[j], x, j);
  return dot;
}

inline __m512i wide_q4_dot(const __m512i* v, const int8_t* x) {
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) lo = wide_dot_add_group(lo, v[j], x, j), hi = wide_dot_add_group(hi, v[j + 4], x, j + 4);
  return _mm512_add_epi32(lo, hi);
}

// Q4_K's minimums of both groups per super-block as super_tile's epilogue pairs them (blocks 2k and
// 2k + 1 in a lane's 16-bit halves): formed once a pair of groups for all its tiles of rows.
void wide_mins(const uint8_t* f0, const uint8_t* f1, int64_t ns, __m512i* out) {
  using C = Compact<false>;
  const int64_t mins = C::floats * 4 + G;
  for (int64_t sb = 0; sb < ns; ++sb) {
    const uint8_t *m0 = f0 + sb * C::bytes + mins, *m1 = f1 + sb * C::bytes + mins;
    for (int k = 0; k < SB / 2; ++k)
      out[sb * SB / 2 + k] =
          _mm512_or_si512(wide_small_ints<false>(m0 + 4 * k * G, m1 + 4 * k * G),
                          _mm512_slli_epi32(wide_small_ints<false>(m0 + (4 * k + 2) * G, m1 + (4 * k + 2) * G), 16));
  }
}

// super_tile for groups g (codes w0, factors f0) and g + 1 (w1, f1): out [ROWS, 2 G]; Q4_K's minimums
// as wide_mins forms them (Q6_K: none).
template <bool HALVES, int64_t ROWS, bool TWO>
__attribute__((noinline)) void super_pair(const uint8_t* w0, const uint8_t* w1, const uint8_t* f0, const uint8_t* f1,
                                          const __m512i* mins, const TileRows& x_rows, int64_t K, bool prefetch,
                                          float* out) {
  using F = Format<HALVES, HALVES>;
  using C = Compact<HALVES>;
  constexpr int64_t W = 2 * G;
  const int64_t nb = K / QK, ns = nb / SB;
  const int8_t *q = x_rows.q, *q2 = x_rows.q2;
  const float *d = x_rows.d, *d2 = x_rows.d2;
  const int16_t *n = x_rows.n, *n2 = x_rows.n2;
  const int32_t *c = x_rows.c, *c2 = x_rows.c2;
  for (int64_t i = 0; i < ROWS * W; ++i) out[i] = 0.0f;
  for (int64_t sb = 0; sb < ns; ++sb) {
    const uint8_t *head0 = f0 + sb * C::bytes, *head1 = f1 + sb * C::bytes;
    __m512i s1[ROWS], s2[TWO ? ROWS : 1];
    for (int64_t r = 0; r < ROWS; ++r) s1[r] = _mm512_setzero_si512();
    if (TWO)
      for (int64_t r = 0; r < ROWS; ++r) s2[r] = _mm512_setzero_si512();
    for (int64_t b = sb * SB; b < sb * SB + SB; ++b) {
      const int64_t small = C::floats * 4 + b % SB * 2 * G;
      __m512i v[8];
      wide_block_codes<HALVES, F::bytes>(w0 + b * F::bytes, w1 + b * F::bytes, prefetch, v);
      if (HALVES) {
        const __m512i lo = wide_small_ints<true>(head0 + small, head1 + small);
        const __m512i hi = wide_small_ints<true>(head0 + small + G, head1 + small + G);
        auto scaled = [&](const int8_t* xb, const int32_t* cx) {
          return _mm512_add_epi32(_mm512_mullo_epi32(wide_q8_half<0>(v, xb, cx[0]), lo),
                                  _mm512_mullo_epi32(wide_q8_half<4>(v, xb, cx[1]), hi));
        };
        for (int64_t r = 0; r < ROWS; ++r) {
          s1[r] = _mm512_add_epi32(s1[r], scaled(q + r * K + b * QK, c + (r * nb + b) * 2));
          if (TWO) s2[r] = _mm512_add_epi32(s2[r], scaled(q2 + r * K + b * QK, c2 + (r * nb + b) * 2));
        }
      } else {
        const __m512i sc = wide_small_ints<false>(head0 + small, head1 + small);
        for (int64_t r = 0; r < ROWS; ++r) {
          s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(wide_q4_dot(v, q + r * K + b * QK), sc));
          if (TWO) s2[r] = _mm512_add_epi32(s2[r], _mm512_mullo_epi32(wide_q4_dot(v, q2 + r * K + b * QK), sc));
        }
      }
    }
    const __m512 dw = wide_floats(head0, head1);
    if (HALVES) {
      for (int64_t r = 0; r < ROWS; ++r) {
        __m512 a = _mm512_loadu_ps(out + r * W);
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s1[r]), dw), _mm512_set1_ps(d[r * ns + sb]), a);
        if (TWO) a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s2[r]), dw), _mm512_set1_ps(d2[r * ns + sb]), a);
        _mm512_storeu_ps(out + r * W, a);
      }
      continue;
    }
    const __m512 dmin = wide_floats(head0 + G * 4, head1 + G * 4);
    __m512i mn[SB / 2];  // in registers: the epilogue's stores to `out` would otherwise reload them
    for (int k = 0; k < SB / 2; ++k) mn[k] = _mm512_load_si512(mins + sb * SB / 2 + k);
    auto epilogue = [&](__m512i sum, const int16_t* sums, float dx, __m512 a) {
      __m512i m = _mm512_setzero_si512();
      for (int k = 0; k < SB / 2; ++k) {
        int32_t pair;
        std::memcpy(&pair, sums + 2 * k, 4);
        m = _mm512_dpwssd_epi32(m, mn[k], _mm512_set1_epi32(pair));
      }
      const __m512 t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dw));
      return _mm512_fmadd_ps(t, _mm512_set1_ps(dx), a);
    };
    for (int64_t r = 0; r < ROWS; ++r) {
      __m512 a = epilogue(s1[r], n + r * nb + sb * SB, d[r * ns + sb], _mm512_loadu_ps(out + r * W));
      if (TWO) a = epilogue(s2[r], n2 + r * nb + sb * SB, d2[r * ns + sb], a);
      _mm512_storeu_ps(out + r * W, a);
    }
  }
}

template <bool HALVES, int64_t ROWS = R>
void pair_rows_tile(int64_t n_rows, bool two, const uint8_t* w0, const uint8_t* w1, const uint8_t* f0,
                    const uint8_t* f1, const __m512i* mins, const TileRows& t, int64_t K, bool prefetch, float* out) {
  if (n_rows == ROWS && two) return super_pair<HALVES, ROWS, true>(w0, w1, f0, f1, mins, t, K, prefetch, out);
  if (n_rows == ROWS) return super_pair<HALVES, ROWS, false>(w0, w1, f0, f1, mins, t, K, prefetch, out);
  if constexpr (ROWS > 1) pair_rows_tile<HALVES, ROWS - 1>(n_rows, two, w0, w1, f0, f1, mins, t, K, prefetch, out);
}
#endif

// One tile of n_rows rows (1 to R) against a group, in `two` levels or one, per block of 32 or
// (SUPER: a K-quant's compact factors) per super-block.
template <bool Q8, bool HALVES, bool COMPACT, bool SUPER = false, int64_t ROWS = R>
void rows_tile(int64_t n_rows, bool two, const uint8_t* w, const uint8_t* f, const TileRows& t, int64_t K, bool prefetch,
               float* out) {
  if constexpr (SUPER) {
    if (n_rows == ROWS && two) return super_tile<HALVES, ROWS, true>(w, f, t, K, prefetch, out);
    if (n_rows == ROWS) return super_tile<HALVES, ROWS, false>(w, f, t, K, prefetch, out);
  } else {
    if (n_rows == ROWS && two) return group_tile<Q8, ROWS, true, HALVES, COMPACT>(w, f, t, K, prefetch, out);
    if (n_rows == ROWS) return group_tile<Q8, ROWS, false, HALVES, COMPACT>(w, f, t, K, prefetch, out);
  }
  if constexpr (ROWS > 1) rows_tile<Q8, HALVES, COMPACT, SUPER, ROWS - 1>(n_rows, two, w, f, t, K, prefetch, out);
}

#if defined(Q4_AMX)
// AMX (Sapphire Rapids on): 16 rows x 16 columns (two groups) a tile. Per block one TDPBSUD (or
// TDPBSSD for Q8's signed codes) gives the tile's exact integer dot products, the same integers as
// q4_dot / q8_dot, and the AVX-512 epilogue applies them per column and row with the operations of
// group_tile in its order (a product of two floats is the same either way round): a row's outputs
// keep their bits whichever path ran its tile.
constexpr int64_t TM = 16;                   // rows per AMX tile
constexpr int64_t TN = 2 * G;                // columns per AMX tile: two groups
constexpr int64_t TILE_CODES = QK * TN;      // bytes of one block's codes for the pair
constexpr int64_t TILE_DOTS = TM * TN;       // int32 dot products per tile

// Linux grants a process the tiles' state on request, once; without it the instructions fault.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// The tile instructions as asm that names what it reads and writes: GCC's intrinsics do not tell the
// compiler they touch memory, so it could drop the configuration's stores or read a stored tile early.
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int C, int A, int B, bool SIGNED_B>  // C += A (int8 rows) . B (unsigned or signed codes)
inline void tile_dot() {
  if (SIGNED_B) asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  else asm volatile("tdpbsud %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two slots, so one block's products run while the other's are applied: slot S has tiles S and 2 + S
// for the dot products [16 rows, 16 columns] int32 (2 + S: the second level's), 4 + S for the rows'
// codes of a block [16, 32] and 6 + S for the pair's codes of that block as [8 input quads,
// 16 columns x 4] bytes. Tile state is per thread: each task loads it.
void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = TN * 4, c.rows[t] = TM;
  for (int t = 4; t < 6; ++t) c.colsb[t] = QK, c.rows[t] = TM;
  for (int t = 6; t < 8; ++t) c.colsb[t] = TN * 4, c.rows[t] = QK / 4;
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Groups g and g + 1's codes, block by block, in a B tile's layout: quad row j holds every column's
// codes for inputs 4j..4j+3 (group g's 8 columns, then g + 1's). Q4 codes are unpacked to 0..15.
// The next pair's codes and factors (contiguous after this pair's; null: none) are prefetched block by
// block, so that they arrive while this pair's tiles run: with one tile of rows the kernel otherwise
// waited on each pair's weights, then computed with the memory idle.
template <bool Q8>
void pair_codes(const uint8_t* w0, const uint8_t* w1, int64_t nb, uint8_t* out, const uint8_t* next_codes,
                const float* next_factors) {
  using F = Format<Q8>;
  constexpr int64_t code_span = 2 * F::bytes, factor_span = 2 * F::factors * sizeof(float);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    if (next_codes != nullptr) {
      for (int64_t at = 0; at < code_span; at += 64) __builtin_prefetch(next_codes + b * code_span + at);
      const char* f = reinterpret_cast<const char*>(next_factors) + b * factor_span;
      for (int64_t at = 0; at < factor_span; at += 64) __builtin_prefetch(f + at);
    }
    uint8_t* o = out + b * TILE_CODES;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* wb = (h ? w1 : w0) + b * F::bytes;
      for (int j = 0; j < (Q8 ? 8 : 4); ++j) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
        __m256i* row = reinterpret_cast<__m256i*>(o + j * TN * 4 + 32 * h);
        if (Q8) {
          _mm256_storeu_si256(row, p);
        } else {
          _mm256_storeu_si256(row, _mm256_and_si256(p, low));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (j + 4) * TN * 4 + 32 * h),
                              _mm256_and_si256(_mm256_srli_epi16(p, 4), low));
        }
      }
    }
  }
}

// Slot S's products for block b: the rows' codes (and the second level's) against the pair's codes.
template <int S, bool Q8, bool TWO>
inline void block_dots(const uint8_t* codes, const TileRows& x, int64_t b, int64_t K) {
  tile_load<6 + S>(codes + b * TILE_CODES, TN * 4);
  tile_load<4 + S>(x.q + b * QK, K);
  tile_zero<S>();
  tile_dot<S, 4 + S, 6 + S, Q8>();
  if (TWO) {
    tile_load<4 + S>(x.q2 + b * QK, K);
    tile_zero<2 + S>();
    tile_dot<2 + S, 4 + S, 6 + S, Q8>();
  }
}

template <int S, bool TWO>
inline void block_store(int32_t* dots) {
  tile_store<S>(dots, TN * 4);
  if (TWO) tile_store<2 + S>(dots + TILE_DOTS, TN * 4);
}

inline __m512 pair_floats(const float* f0, const float* f1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f0)), _mm256_loadu_ps(f1), 1);
}

// out[r * 16 + c] for the tile's 16 rows against the pair's 16 columns (codes: pair_codes' blocks;
// f0, f1: the two groups' factors), per block in group_tile's order. Blocks go in rounds of two, one a
// slot, and a round's products are started before the previous round is applied.
template <bool Q8, bool TWO>
void amx_tile(const uint8_t* codes, const float* f0, const float* f1, const TileRows& x, int64_t K, float* out) {
  using F = Format<Q8>;
  const int64_t nb = K / QK;
  constexpr int64_t levels = TWO ? 2 : 1;
  alignas(64) int32_t dots[2][2][levels * TILE_DOTS];  // [round parity][slot]
  __m512 acc[TM];
  for (int64_t r = 0; r < TM; ++r) acc[r] = _mm512_setzero_ps();
  auto start = [&](int64_t b) {
    block_dots<0, Q8, TWO>(codes, x, b, K);
    if (b + 1 < nb) block_dots<1, Q8, TWO>(codes, x, b + 1, K);
  };
  auto apply = [&](const int32_t* d1, int64_t b) {
    const __m512 scale = pair_floats(f0 + b * F::factors, f1 + b * F::factors);
    const __m512 minimum = Q8 ? scale : pair_floats(f0 + b * F::factors + G, f1 + b * F::factors + G);
    for (int64_t r = 0; r < TM; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(d1 + r * TN));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(x.d[r * nb + b])), acc[r]);
      if (TWO) {
        const __m512 dot2 = _mm512_cvtepi32_ps(_mm512_load_si512(d1 + TILE_DOTS + r * TN));
        acc[r] = _mm512_fmadd_ps(dot2, _mm512_mul_ps(scale, _mm512_set1_ps(x.d2[r * nb + b])), acc[r]);
      }
      if (!Q8) acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x.s[r * nb + b]), acc[r]);
    }
  };
  start(0);
  for (int64_t b = 0; b < nb; b += 2) {
    int32_t(*round)[levels * TILE_DOTS] = dots[(b / 2) & 1];
    block_store<0, TWO>(round[0]);
    if (b + 1 < nb) block_store<1, TWO>(round[1]);
    if (b + 2 < nb) start(b + 2);
    apply(round[0], b);
    if (b + 1 < nb) apply(round[1], b + 1);
  }
  for (int64_t r = 0; r < TM; ++r) _mm512_storeu_ps(out + r * TN, acc[r]);
}
#endif

// x [.., K] as float32 rows [M, K] (normalized first by `norm`, a weight [K], where it is defined)
// and their int8 blocks.
struct Rows {
  at::Tensor xf;
  QuantRows qx;
  int64_t M;
};

Rows quantized_rows(const at::Tensor& x, int64_t K, const char* name, const at::Tensor& norm, double eps,
                    int64_t levels, int64_t block) {
  TORCH_CHECK(x.dim() > 0 && x.size(-1) == K, name, ": x has ", x.dim() ? x.size(-1) : 0, " features, the weight ", K);
  // float32 rows in place where they are (the C++ layers' case: no op at one token), else a copy
  const bool in_place = x.scalar_type() == at::kFloat && x.is_contiguous();
  at::Tensor xf = in_place ? x : x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  if (norm.defined()) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && norm.scalar_type() == at::kFloat && norm.is_contiguous() &&
                    norm.numel() == K,
                name, ": a norm weight [", K, "] float32 for float32 rows");
    at::Tensor normed = at::empty_like(xf);
    QuantRows qx = quantize(xf.data_ptr<float>(), M, K, levels, block, norm.data_ptr<float>(),
                            static_cast<float>(eps), normed.data_ptr<float>());
    return {normed, std::move(qx), M};
  }
  QuantRows qx = quantize(xf.data_ptr<float>(), M, K, levels, block);
  return {xf, std::move(qx), M};
}

// y [M, N] float32 -> x's type and shape with N features.
at::Tensor shaped(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  if (x.dim() == 2 && x.scalar_type() == at::kFloat) return y;  // already [M, N] float32
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.to(x.scalar_type()).reshape(shape);
}

const float* bias_ptr(const at::Tensor& bias, at::Tensor& holder) {
  if (!bias.numel()) return nullptr;
  holder = bias.to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// y = x W^T (+ bias) for W in groups of 8 columns of format Q8 or Q4 (packed [N / 8, K / 32 * bytes],
// factors [N / 8, K / 32, factors / 8, 8]), in x's type and shape, x in `levels` int8 levels with a
// scale per 32 inputs, or per `k_block` (256: super-blocks) where W is a K-quant's (compact factors);
// x's rows normalized first by `norm` and `residual` + y returned where they are defined (q4_int8_fused).
template <bool Q8, bool HALVES = false>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factors,
                          const at::Tensor& bias, const char* name, int64_t levels, int64_t k_block,
                          const at::Tensor& norm = {}, double eps = 0.0, const at::Tensor& residual = {}) {
  using F = Format<Q8, HALVES>;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) % F::bytes == 0 && packed.size(1) > 0,
              name, ": packed codes [N / 8, K / 32 * ", F::bytes, "] uint8 (quant.py pack_q4 / pack_q8)");
  const int64_t groups = packed.size(0), nb = packed.size(1) / F::bytes, K = nb * QK, N = groups * G;
  const bool compact = factors.scalar_type() == at::kByte;  // a K-quant's (expand_factors)
  if (compact) {
    TORCH_CHECK((!Q8 || HALVES) && nb % SB == 0 && factors.is_contiguous() &&
                    factors.sizes() == at::IntArrayRef({groups, nb / SB, Compact<HALVES>::bytes}),
                name, ": compact factors [N / 8, K / 256, ", Compact<HALVES>::bytes, "] uint8 (Q4_K or Q6_K)");
  } else {
    TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.is_contiguous() &&
                    factors.sizes() == at::IntArrayRef({groups, nb, F::factors / G, G}),
                name, ": factors [N / 8, K / 32, ", F::factors / G, ", 8] float32");
  }
  TORCH_CHECK(k_block == QK || k_block == SB * QK, name, ": k_block (inputs per activation scale on a K-quant) ", QK,
              " or ", SB * QK, ", not ", k_block);
  const bool super = compact && k_block == SB * QK;  // the super-block kernel (super_tile)
  Rows rows = quantized_rows(x, K, name, norm, eps, levels, super ? k_block : QK);
  const int64_t M = rows.M;
  at::Tensor y = at::empty({M, N}, rows.xf.options());
  const float* rp = nullptr;
  if (residual.defined()) {
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.numel() == M * N,
                name, ": a residual [.., ", N, "] float32, contiguous");
    rp = residual.data_ptr<float>();
  }
  at::Tensor bias_f;
  const float* bp = bias_ptr(bias, bias_f);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint8_t* fp = static_cast<const uint8_t*>(factors.data_ptr());
  const int64_t factor_bytes = compact ? nb / SB * Compact<HALVES>::bytes : nb * F::factors * 4;  // a group's
  const QuantRows& qx = rows.qx;
  const bool two = !qx.q2.empty();
  const int64_t ns = K / qx.block;  // activation scales a row
  auto tile_rows = [&](int64_t m) {
    return TileRows{qx.q.data() + m * K,
                    qx.d.data() + m * ns,
                    super ? nullptr : qx.s.data() + m * nb,
                    two ? qx.q2.data() + m * K : nullptr,
                    two ? qx.d2.data() + m * ns : nullptr,
                    qx.c.data() + m * nb * 2,
                    two ? qx.c2.data() + m * nb * 2 : nullptr,
                    super ? qx.n.data() + m * nb : nullptr,
                    super && two ? qx.n2.data() + m * nb : nullptr};
  };
  // out [n_rows, cols] (row stride cols) for rows m.. and columns from group g's first on: y = out +
  // bias (+ 0 without one: the bits of a zero bias), then residual + y,
  // the residual add's one rounding as h + linear(x). The cases apart, so each row is one vector loop.
  auto store = [&](const float* out, int64_t m, int64_t n_rows, int64_t g, int64_t cols) {
    for (int64_t r = 0; r < n_rows; ++r) {
      float* __restrict y = yp + (m + r) * N + g * G;
      const float* __restrict o = out + r * cols;
      const float* __restrict h = rp ? rp + (m + r) * N + g * G : nullptr;
      const float* __restrict b = bp ? bp + g * G : nullptr;
      if (b && h) {
        for (int64_t c = 0; c < cols; ++c) y[c] = h[c] + (o[c] + b[c]);
      } else if (b) {
        for (int64_t c = 0; c < cols; ++c) y[c] = o[c] + b[c];
      } else if (h) {
        for (int64_t c = 0; c < cols; ++c) y[c] = h[c] + (o[c] + 0.0f);
      } else {
        for (int64_t c = 0; c < cols; ++c) y[c] = o[c] + 0.0f;
      }
    }
  };
#if defined(Q4_AMX)
  // rows in AMX tiles (none in halves: a tile's product spans a whole block, one scale; none on
  // super-blocks: their tiles are not built, the VNNI tiles run them)
  const int64_t m_amx = !HALVES && !super && M >= TM && amx_permitted() ? M / TM * TM : 0;
#else
  const int64_t m_amx = 0;
#endif
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // The task's groups in pairs take rows [0, m_amx) in AMX tiles; the rest run group_tile.
    const int64_t paired = m_amx ? begin + (end - begin) / 2 * 2 : begin;
#if defined(Q4_AMX)
    if (paired > begin) {
      // Group g's float32 factors for the AMX tiles: in place, or formed from the compact ones into `buffer`.
      auto group_factors = [&](int64_t g, std::vector<float>& buffer) -> const float* {
        const uint8_t* at = fp + g * factor_bytes;
        if (!compact) return reinterpret_cast<const float*>(at);
        buffer.resize(nb * 2 * G);
        expand_factors<HALVES>(at, nb, buffer.data());
        return buffer.data();
      };
      configure_tiles();
      std::vector<uint8_t> codes(nb * TILE_CODES);
      std::vector<float> own0, own1;
      float out[TM * TN];
      for (int64_t g = begin; g < paired; g += 2) {
        const bool more = g + 2 < paired;
        pair_codes<Q8>(wp + g * nb * F::bytes, wp + (g + 1) * nb * F::bytes, nb, codes.data(),
                       more ? wp + (g + 2) * nb * F::bytes : nullptr,
                       more ? reinterpret_cast<const float*>(fp + (g + 2) * factor_bytes) : nullptr);
        const float *f0 = group_factors(g, own0), *f1 = group_factors(g + 1, own1);
        for (int64_t m = 0; m < m_amx; m += TM) {
          if (two) amx_tile<Q8, true>(codes.data(), f0, f1, tile_rows(m), K, out);
          else amx_tile<Q8, false>(codes.data(), f0, f1, tile_rows(m), K, out);
          store(out, m, TM, g, TN);
        }
      }
      _tile_release();
    }
#endif
    float out[R * 2 * G];
#if defined(Q4_WIDE)
    std::vector<__m512i> pair_mins;  // sized where a pair first runs: a forward of a few rows runs none
#endif
    // Rows in panels whose int8 codes stay in L2 while the task's groups pass over them.
    for (int64_t m0 = 0; m0 < M; m0 += MP) {
      const int64_t m1 = std::min(M, m0 + MP);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = std::max(m0, g < paired ? m_amx : 0);
        if (first >= m1) continue;
        const uint8_t* w = wp + g * nb * F::bytes;
        const uint8_t* f = fp + g * factor_bytes;
#if defined(Q4_WIDE)
        if constexpr (!Q8 || HALVES) {
          // Two groups a tile where the panel's rows reuse the codes from cache; with fewer the forward
          // waits on memory, whose prefetchers follow one group's stream better than two (Zen 4: 8 rows
          // 10% slower in pairs, 64 rows 6% faster).
          if (super && g + 1 < end && m1 - first >= PAIR_ROWS) {
            if (!HALVES) {
              pair_mins.resize(nb / SB * SB / 2);
              wide_mins(f, f + factor_bytes, nb / SB, pair_mins.data());
            }
            auto pair_tile = [&](int64_t m, int64_t n_rows) {
              pair_rows_tile<HALVES>(n_rows, two, w, w + nb * F::bytes, f, f + factor_bytes, pair_mins.data(),
                                     tile_rows(m), K, m == first, out);
              store(out, m, n_rows, g, 2 * G);
            };
            int64_t m = first;
            for (; m + R <= m1; m += R) pair_tile(m, R);
            if (m < m1) pair_tile(m, m1 - m);
            ++g;
            continue;
          }
        }
#endif
        auto tile = [&](int64_t m, int64_t n_rows) {
          constexpr bool compact_kind = !Q8 || HALVES;  // the formats K-quants come in
          const bool prefetch = m == first;  // the group's first pass reads its codes from memory
          if (super) rows_tile<Q8, HALVES, compact_kind, compact_kind>(n_rows, two, w, f, tile_rows(m), K, prefetch, out);
          else if (compact) rows_tile<Q8, HALVES, compact_kind>(n_rows, two, w, f, tile_rows(m), K, prefetch, out);
          else rows_tile<Q8, HALVES, false>(n_rows, two, w, f, tile_rows(m), K, prefetch, out);
          store(out, m, n_rows, g, G);
        };
        // Tiles of R rows, then the rest in one tile: in smaller ones (7 rows as 4 + 2 + 1) each would
        // unpack the block's codes again, and a one-row tile waits on its products' latency.
        int64_t m = first;
        for (; m + R <= m1; m += R) tile(m, R);
        if (m < m1) tile(m, m1 - m);
      }
    }
  });
  return shaped(y, x, N);
}

// The format a layer's weights were packed in (quant.py pack_q4 / pack_q8 / pack_q8 in halves), told
// by the code bytes per block (Q4: 128 a group, Q8: 256) and the factors per block (1 or 2 vectors;
// compact ones, a K-quant's, hold Q4_K's or Q6_K's halves).
enum class Packing { Q4, Q8, Q8_HALVES };
Packing packing(const at::Tensor& packed, const at::Tensor& factors) {
  if (factors.scalar_type() == at::kByte && factors.dim() == 3 && packed.dim() == 2)
    return packed.size(1) == factors.size(1) * SB * G * QK ? Packing::Q8_HALVES : Packing::Q4;
  if (factors.dim() == 4 && factors.size(2) == 1) return Packing::Q8;
  const bool wide = factors.dim() == 4 && packed.dim() == 2 && packed.size(1) == factors.size(1) * G * QK;
  return wide ? Packing::Q8_HALVES : Packing::Q4;
}

template <typename... Args>
at::Tensor any_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factors, const at::Tensor& bias,
                      const char* name, int64_t levels, int64_t k_block, Args&&... rest) {
  switch (packing(packed, factors)) {
    case Packing::Q8:
      return grouped_linear<true>(x, packed, factors, bias, name, levels, k_block, rest...);
    case Packing::Q8_HALVES:
      return grouped_linear<true, true>(x, packed, factors, bias, name, levels, k_block, rest...);
    default:
      return grouped_linear<false>(x, packed, factors, bias, name, levels, k_block, rest...);
  }
}

}  // namespace

const char* q4_int8_path() {
#if defined(Q4_AMX)
  if (amx_permitted()) return "amx-int8";  // tiles of 16 rows; fewer rows on AVX-512 VNNI
#endif
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
                          const at::Tensor& bias, int64_t levels, int64_t k_block) {
  RECORD_FUNCTION("tot::q4_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  return any_linear(x, packed, factors, bias, "q4_int8_linear", levels, k_block);
}

at::Tensor q4_int8_fused(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factors,
                         const at::Tensor& bias, int64_t levels, int64_t k_block, const at::Tensor& norm, double eps,
                         const at::Tensor& residual) {
  RECORD_FUNCTION("tot::q4_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  return any_linear(x, packed, factors, bias, "q4_int8_fused", levels, k_block, norm, eps, residual);
}

at::Tensor q8_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& factors,
                          const at::Tensor& bias, int64_t levels, int64_t k_block) {
  RECORD_FUNCTION("tot::q8_int8_linear", std::vector<c10::IValue>());  // torch.profiler counts it as a linear
  return any_linear(x, packed, factors, bias, "q8_int8_linear", levels, k_block);
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
        for (int j = 0; j < 8; ++j) acc[j] = dot_add(acc[j], w, x);
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

// The same for the tile unit: TDPBSUD on the kernel's tiles ([16 rows, 32] x [32, 16 columns]) into
// four tiles in turn, on every thread; 0 where the kernel has no AMX path.
double q4_int8_tile_peak(int64_t iterations) {
#if defined(Q4_AMX)
  if (!amx_permitted()) return 0.0;
  const int64_t threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      configure_tiles();
      tile_zero<4>(), tile_zero<5>(), tile_zero<6>(), tile_zero<7>();
      for (int64_t i = 0; i < iterations; ++i) {
        tile_dot<0, 4, 6, false>(), tile_dot<1, 5, 7, false>();
        tile_dot<2, 4, 7, false>(), tile_dot<3, 5, 6, false>();
      }
      _tile_release();
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(threads * iterations * 4 * TILE_DOTS * QK) / seconds;
#else
  return 0.0 * static_cast<double>(iterations);
#endif
}

std::vector<at::Tensor> q4_int8_quantize(const at::Tensor& x, int64_t levels, int64_t block) {
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(K % QK == 0, "q4_int8_quantize: ", K, " features is not a multiple of ", QK);
  QuantRows r = quantize(xf.data_ptr<float>(), M, K, levels, block);
  auto codes = [&](std::vector<int8_t>& from) {
    at::Tensor t = at::empty({M, K}, xf.options().dtype(at::kChar));
    std::memcpy(t.data_ptr<int8_t>(), from.data(), M * K);
    return t;
  };
  auto floats = [&](std::vector<float>& from) {
    return at::from_blob(from.data(), {M, static_cast<int64_t>(from.size()) / M}, xf.options()).clone();
  };
  auto sums = [&](std::vector<int16_t>& from) {
    return at::from_blob(from.data(), {M, K / QK}, xf.options().dtype(at::kShort)).clone();
  };
  // per 32: codes, scales, the blocks' s; per 256: codes, scales, the blocks' code sums; then the second level's
  std::vector<at::Tensor> out{codes(r.q), floats(r.d), block == QK ? floats(r.s) : sums(r.n)};
  if (levels == 2) {
    out.push_back(codes(r.q2));
    out.push_back(floats(r.d2));
    if (block != QK) out.push_back(sums(r.n2));
  }
  return out;
}
