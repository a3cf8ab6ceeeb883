// The project's Gumbel-max draw of one row (decoding/speculation/gumbel.py `gumbel_pick`): the token of
// largest processed logit + G(key, token), G a fixed function of splitmix64's bits for (key, token).
//
// One pass with no logarithm for most tokens: each token's 52 random bits are hashed (integer work),
// and its noise is bounded from above by a table over the bits' top 12 (G grows with the bits); only a
// token whose score plus that bound reaches the best value found so far gets its exact noise (two
// logarithms). The best-scored token is drawn first, so the running best starts near the final one and
// a handful of tokens a row pass the bound. The numpy form hashed every token, took the largest bits
// and then the logarithms of every token within reach of them: 0.25 ms a peaked 49k row, 1.2 ms a flat
// one (the reach then holds thousands).
//
// Included by gumbel.cpp (the draw alone) and draw_top.cpp (the draw in one pass with a row's top k).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace gumbel {

constexpr uint64_t GAMMA = 0x9E3779B97F4A7C15ull;
constexpr uint64_t M1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t M2 = 0x94D049BB133111EBull;
constexpr double SCALE = 1.0 / 4503599627370496.0;  // 2^-52
constexpr int TABLE_BITS = 12;
constexpr int BLOCK = 64;

inline double gumbel_of(uint64_t bits) { return -std::log(-std::log((static_cast<double>(bits) + 0.5) * SCALE)); }

// Eight tokens' bits at once (GCC's vector extensions: AVX-512's 64-bit multiply where the CPU has it,
// an emulation in 32-bit halves on AVX2): the hash, not the logarithms, is the pass's cost.
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

inline u64x8 mix(u64x8 x) {
  x ^= x >> 30;
  x *= M1;
  x ^= x >> 27;
  x *= M2;
  x ^= x >> 31;
  return x >> 12;
}

inline uint64_t bits_of(uint64_t start, uint64_t token) {
  u64x8 x = {token * GAMMA + start};
  return mix(x)[0];
}

// Per bucket of the bits' top 12, an upper bound of its tokens' noise in float32, rounded up (the last
// bucket's is infinite: its tokens always get their own noise).
inline const std::array<float, 1 << TABLE_BITS>& noise_bounds() {
  static const std::array<float, 1 << TABLE_BITS> table = [] {
    std::array<float, 1 << TABLE_BITS> t{};
    constexpr int shift = 52 - TABLE_BITS;
    for (uint64_t k = 0; k < t.size(); ++k) {
      const double g = gumbel_of(((k + 1) << shift) - 1);
      t[k] = k + 1 == t.size() ? std::numeric_limits<float>::infinity()
                               : std::nextafter(static_cast<float>(g + 1e-6 * (1.0 + std::fabs(g))),
                                                std::numeric_limits<float>::infinity());
    }
    return t;
  }();
  return table;
}

// `on_block(lo, m)` is called for each block of BLOCK tokens [lo, lo + m) in order, before its tokens are
// weighed: a pass that reads the same row (draw_top.cpp's sum of exp) rides along with the draw's.
template <typename OnBlock>
int64_t pick_row(const float* s, int64_t n, uint64_t start, OnBlock&& on_block) {
  const float* bound = noise_bounds().data();
  const float finite = bound[(1 << TABLE_BITS) - 2];
  const uint64_t last_bucket = static_cast<uint64_t>((1 << TABLE_BITS) - 1) << (52 - TABLE_BITS);

  // The best score in lanes of eight (a loop GCC vectorizes), then its first token.
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = s[0];
  int64_t i8 = 0;
  for (; i8 + 8 <= n; i8 += 8)
    for (int j = 0; j < 8; ++j) lanes[j] = s[i8 + j] > lanes[j] ? s[i8 + j] : lanes[j];
  float most = lanes[0];
  for (int j = 1; j < 8; ++j) most = lanes[j] > most ? lanes[j] : most;
  for (; i8 < n; ++i8) most = s[i8] > most ? s[i8] : most;
  int64_t best = 0;
  while (best + 1 < n && s[best] != most) ++best;
  double top = static_cast<double>(s[best]) + gumbel_of(bits_of(start, static_cast<uint64_t>(best)));
  int64_t pick = best;
  // The float32 filter's threshold, a little below the best value (the float sums round).
  auto threshold = [&] { return static_cast<float>(top - 1e-5 * (1.0 + std::fabs(top))); };
  float reach_at_least = threshold();

  u64x8 x;
  for (int j = 0; j < 8; ++j) x[j] = start + static_cast<uint64_t>(j) * GAMMA;
  const uint64_t stride = 8 * GAMMA;
  alignas(64) uint64_t bits[BLOCK];
  for (int64_t lo = 0; lo < n; lo += BLOCK) {
    const int64_t m = std::min<int64_t>(BLOCK, n - lo);
    on_block(lo, m);
    // First with no table: only a token within the largest finite bound of the best value, or in the
    // last bucket, can reach it (most rows' tokens are neither). In vectors: a token's bits are in the
    // last bucket where adding one bucket's width carries past bit 52 (shifts, no unsigned compare,
    // which AVX2 lacks); the block's bits past a short last block only send it to the exact test.
    u64x8 last = {};
    for (int j = 0; j < BLOCK; j += 8) {
      const u64x8 b = mix(x);
      __builtin_memcpy(bits + j, &b, sizeof b);
      last |= (b + (uint64_t{1} << (52 - TABLE_BITS))) >> 52;
      x += stride;
    }
    const float near = reach_at_least - finite;
    bool any;
    if (m == BLOCK) {
      i32x16 hit;
      __builtin_memcpy(&hit, &last, sizeof hit);
      for (int j = 0; j < BLOCK; j += 16) {
        f32x16 v;
        __builtin_memcpy(&v, s + lo + j, sizeof v);
        hit |= v >= near;
      }
      int32_t folded = 0;
      for (int j = 0; j < 16; ++j) folded |= hit[j];
      any = folded != 0;
    } else {
      any = false;
      for (int64_t j = 0; j < m; ++j) any |= (s[lo + j] >= near) | (bits[j] >= last_bucket);
    }
    if (!any) continue;
    for (int64_t j = 0; j < m; ++j) {
      if (!(s[lo + j] + bound[bits[j] >> (52 - TABLE_BITS)] >= reach_at_least)) continue;
      const int64_t i = lo + j;
      const double v = static_cast<double>(s[i]) + gumbel_of(bits[j]);
      if (v > top || (v == top && i < pick)) {  // numpy's argmax: the first of equal values
        top = v;
        pick = i;
        reach_at_least = threshold();
      }
    }
  }
  return pick;
}

}  // namespace gumbel
