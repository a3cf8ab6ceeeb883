// Batch- and tree-invariant attention for CPU forwards (decoding/runtime/attention.py loads it).
//
// The output for one query depends only on that query and the keys/values it sees, in position
// order: every score is one dot product summed over the head dimension in index order, the softmax
// sum and the weighted sum of values run over the visible positions in increasing order (a hidden
// position adds nothing, exactly), and exp is a fixed polynomial. Vector lanes run across positions
// or across the head dimension, never across a reduction, and no reduction is split by the number
// of rows, queries or positions. So a query's output has the same bits
// alone, beside other rows of any length, or inside a draft tree (its ancestors are the chain it
// would have had). Keys may be stored with positions contiguous (the RowKVCache) or with dimensions
// contiguous (transformers' DynamicCache): both are widened block by block into the same [D][64]
// float layout, so both give the same bits. Built with -ffp-contract=off: the only fused multiply-adds are the explicit
// std::fma calls, the same in vector and scalar code.
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t W = 16;  // vector lanes (floats) the loops below are written for
constexpr int64_t U = 4;   // independent score chains per query, to hide the fused multiply-add latency

// Widen n values to float (bfloat16 through its bits: a shift the compiler vectorizes).
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void widen<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  widen_bfloat16(src, dst, n);
}

constexpr int64_t BL = U * W;  // positions per key block
constexpr int64_t SPAN = 8 * BL;  // positions of keys widened at once: [D][SPAN] floats, 128 KiB at D 64
constexpr int64_t QC = 16;     // queries per task at most (tasks split a row's queries, never a reduction)

// One query row of a task: where its queries, outputs, mask and live tokens are, and its cache row:
// a row of its own (k, v at its first position) or, paged, a table of pages of P positions (P
// dividing BL) in a pool (k, v at the pool's first page, of this head).
template <typename scalar_t>
struct Member {
  const scalar_t *q, *k, *v;
  const int64_t* table;  // the row's block ids (null: a row of its own)
  scalar_t* out;
  const bool* mask;  // null: causal
  const bool* live;  // [T] of the row: the tokens whose outputs are read (null: all)
};

// One task: queries [j0, j1) of one key/value head, of G * T in all, for each of nm query rows against
// L positions. The rows of one task are a group whose caches hold the same first S positions (the
// caller vouches for it: siblings admitted with one prompt); those positions' keys and values are
// read once, from the first member's row, for the queries of all of them, and the rest from each
// row's own. A query's reductions run over its positions in order whichever row they are read from,
// so its bits are those of a task of its row alone (S = 0, nm = 1). Keys are read through strides:
// the RowKVCache stores them position-contiguous (ksl == 1), so a block of BL positions is widened
// with vector loads; keys stored [L][D] (transformers' DynamicCache) are transposed block by block.
// Either way each score is one chain of fused multiply-adds over d in order with lanes across
// positions, the same bits.
template <typename scalar_t>
struct Task {
  const Member<scalar_t>* members;
  int64_t nm, S;  // S: a multiple of BL, at most L
  int64_t qs1, qs2, ksl, ksd, vs2, os1, os2;  // strides: query head/token, key position/dim, value
                                              // position, output token/head
  int64_t P, kbs, vbs;  // positions a page holds (a row of its own: BL), strides of the pool's pages
  int64_t ms2, ms3, G, T, L, D, j0, j1;
  float scale;
};

// Where page b (positions b * P on) of a member's keys or values starts: in its own row, or in the
// pool's page its table names. Positions are read page by page, in position order.
template <typename scalar_t>
inline const scalar_t* key_block(const Task<scalar_t>& a, const Member<scalar_t>& m, int64_t b) {
  return m.table != nullptr ? m.k + m.table[b] * a.kbs : m.k + b * a.P * a.ksl;
}
template <typename scalar_t>
inline const scalar_t* value_block(const Task<scalar_t>& a, const Member<scalar_t>& m, int64_t b) {
  return m.table != nullptr ? m.v + m.table[b] * a.vbs : m.v + b * a.P * a.vs2;
}

struct Scratch {
  std::vector<float> qf, kblk, vf, p, allow, o, sum;
  std::vector<int64_t> live;   // the task's queries whose outputs are read, member by member
  std::vector<int64_t> first;  // [nm + 1]: where each member's live queries start in `live`
};

// Queries a pass shares each key and value load between: their chains are independent, so a pass
// keeps J * U (scores) or J * C (values) vector accumulators in flight where one query had U or C,
// enough to hide the fused multiply-add's latency. A query's own chains are unchanged.
constexpr int J = 4;

// Scores of NJ queries over one block of BL positions (keys as D rows of BL floats, ks apart): per query
// and position one chain of fused multiply-adds over d in order, lanes across positions.
template <int NJ>
inline void block_scores(const float* const* q, const float* kb, int64_t ks, int64_t D, float scale,
                         float* const* p) {
  float acc[NJ][U][W];
  for (int j = 0; j < NJ; ++j)
    for (int64_t u = 0; u < U; ++u)
      for (int64_t i = 0; i < W; ++i) acc[j][u][i] = q[j][0] * kb[u * W + i];
  for (int64_t d = 1; d < D; ++d) {
    const float* kd = kb + d * ks;
    for (int j = 0; j < NJ; ++j) {
      const float qd = q[j][d];
      for (int64_t u = 0; u < U; ++u)
        for (int64_t i = 0; i < W; ++i) acc[j][u][i] = std::fma(qd, kd[u * W + i], acc[j][u][i]);
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int64_t u = 0; u < U; ++u)
      for (int64_t i = 0; i < W; ++i) p[j][u * W + i] = acc[j][u][i] * scale;
}

// sum_l w[l] * v[l] over each of NJ queries' visible positions l0 <= l < l1, in order, continuing the
// sums in acc (C vectors of W lanes across d per query) and sum: a query's positions may come in
// ranges read from different rows, each sum still runs position after position. A position no query
// sees is not read. A hidden position adds nothing: its weight is +0 (s + 0 is s, s >= +0) and its
// products are not taken (its values may be anything, even a pad slot's unwritten ones). With
// AVX-512 the products run as masked fused multiply-adds on 16-lane registers (GCC spilled the plain
// loop's accumulators); each lane's value is the plain loop's. v points at position l0.
template <int C, int NJ, typename value_t>
inline void weighted_values(const float* const* w, const value_t* v, int64_t vs, int64_t l0, int64_t l1,
                            float* const* acc_io, float* sum_io) {
  float s[NJ];
  for (int j = 0; j < NJ; ++j) s[j] = sum_io[j];
#if defined(__AVX512F__)
  static_assert(W == 16, "one 512-bit register a vector");
  __m512 acc[NJ][C];
  for (int j = 0; j < NJ; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_loadu_ps(acc_io[j] + c * W);
#else
  float acc[NJ][C * W];
  for (int j = 0; j < NJ; ++j)
    for (int64_t i = 0; i < C * W; ++i) acc[j][i] = acc_io[j][i];
#endif
  for (int64_t l = l0; l < l1; ++l) {
    bool seen = false;
    for (int j = 0; j < NJ; ++j) seen = seen || w[j][l] != 0.0f;
    if (!seen) continue;
    float vl[C * W];
    widen(v + (l - l0) * vs, vl, C * W);
#if defined(__AVX512F__)
    __m512 x[C];
    for (int c = 0; c < C; ++c) x[c] = _mm512_loadu_ps(vl + c * W);
    for (int j = 0; j < NJ; ++j) {
      const float wl = w[j][l];
      s[j] = s[j] + wl;
      const __mmask16 take = wl != 0.0f ? 0xFFFF : 0;
      const __m512 wv = _mm512_set1_ps(wl);
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_mask3_fmadd_ps(wv, x[c], acc[j][c], take);
    }
#else
    for (int j = 0; j < NJ; ++j) {
      const float wl = w[j][l];
      if (wl == 0.0f) continue;
      s[j] = s[j] + wl;
      for (int64_t i = 0; i < C * W; ++i) acc[j][i] = std::fma(wl, vl[i], acc[j][i]);
    }
#endif
  }
  for (int j = 0; j < NJ; ++j) {
    sum_io[j] = s[j];
#if defined(__AVX512F__)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_io[j] + c * W, acc[j][c]);
#else
    for (int64_t i = 0; i < C * W; ++i) acc_io[j][i] = acc[j][i];
#endif
  }
}

// The most queries a values pass takes at C vectors a query (32 vector registers in all).
constexpr int values_width(int C) { return C <= 4 ? J : C == 8 ? 2 : 1; }

// Query j of a task: its member, head in the group and token.
struct Query {
  int64_t m, g, t;
};
template <typename scalar_t>
inline Query query_of(const Task<scalar_t>& a, int64_t j) {
  const int64_t nl = a.j1 - a.j0, local = a.j0 + j % nl;
  return {j / nl, local / a.T, local % a.T};
}

// Scores of the queries js[0..NJ) (rows of qf, Dp apart) over the key block at l0 into their rows of p.
template <int NJ>
inline void scores_pass(const int64_t* js, const float* qf, int64_t Dp, const float* kb, int64_t ks, int64_t D,
                        float scale, float* p, int64_t Lp, int64_t l0) {
  const float* q[NJ];
  float* out[NJ];
  for (int j = 0; j < NJ; ++j) {
    q[j] = qf + js[j] * Dp;
    out[j] = p + js[j] * Lp + l0;
  }
  block_scores<NJ>(q, kb, ks, D, scale, out);
}

// Scores of the queries js[0..n) over positions [from, to) (multiples of BL, past L: zeros) of the keys
// k, a block of BL positions at a time, the queries J at a time, over keys widened a span of blocks at
// a time into [D][Ls] floats. Position-contiguous keys are read row d after row d: one ascending sweep
// through the cache that the hardware prefetcher follows (block by block the D rows, a capacity
// apart, would be D short streams it loses, and a forward of many rows would wait on memory). A span
// of one block where several passes reuse it: it stays in the first-level cache. While a span's keys
// are widened, each row's part of the next span (where there is one) and a D-th of the range's value
// lines with each row are requested: they arrive while the scores run instead of when the next span
// or the values pass asks for them.
template <typename scalar_t>
void scores_range(const Task<scalar_t>& a, Scratch& s, const Member<scalar_t>& m, int64_t from, int64_t to,
                  const int64_t* js, int64_t n, int64_t Dp, int64_t Lp) {
  const int64_t L = a.L, D = a.D, end = std::min(to, L);
  const int64_t span = n <= J ? std::min(SPAN, to - from) : BL;
  s.kblk.resize(D * (span + W));
  float* kspan = s.kblk.data();
  // The range's value lines, block after block (a block's lines are contiguous).
  const int64_t P = a.P, block_bytes = P * a.vs2 * static_cast<int64_t>(sizeof(scalar_t));
  const auto value_line = [&](int64_t i) {
    const int64_t byte = i * 64;
    return reinterpret_cast<const char*>(value_block(a, m, from / P + byte / block_bytes)) + byte % block_bytes;
  };
  const int64_t vlines = ((end - from) * a.vs2 * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
  int64_t vline = 0;
  for (int64_t s0 = from; s0 < to; s0 += span) {
    const int64_t Ls = std::min(span, to - s0), nl = std::min(Ls, L - s0);  // Ls: a multiple of BL
    const int64_t kstride = Ls + W;  // rows of keys not a multiple of 4 KiB apart (cache sets)
    const int64_t vstep = (vlines * Ls / (to - from) + D - 1) / D;
    if (a.ksl == 1) {
      const int64_t next = std::min(span, end - s0 - Ls);
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t i = 0; i < vstep && vline < vlines; ++i, ++vline) __builtin_prefetch(value_line(vline), 0, 2);
        for (int64_t b0 = s0 + Ls; b0 < s0 + Ls + next; b0 += P) {
          const char* row = reinterpret_cast<const char*>(key_block(a, m, b0 / P) + d * a.ksd);
          const int64_t bytes = std::min(P, s0 + Ls + next - b0) * static_cast<int64_t>(sizeof(scalar_t));
          for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
        }
        for (int64_t b0 = s0; b0 < s0 + nl; b0 += P)
          widen(key_block(a, m, b0 / P) + d * a.ksd, kspan + d * kstride + (b0 - s0), std::min(P, s0 + nl - b0));
        for (int64_t l = nl; l < Ls; ++l) kspan[d * kstride + l] = 0.0f;
      }
    } else {
      float row[16 * W];
      for (int64_t l = 0; l < Ls; ++l) {
        if (l < nl) widen(key_block(a, m, (s0 + l) / a.P) + (s0 + l) % a.P * a.ksl, row, D);
        for (int64_t d = 0; d < D; ++d) kspan[d * kstride + l] = l < nl ? row[d] : 0.0f;
      }
    }
    for (int64_t l0 = s0; l0 < s0 + Ls; l0 += BL) {
      const float* kb = kspan + (l0 - s0);
      int64_t at = 0;
      for (; at + J <= n; at += J) scores_pass<J>(js + at, s.qf.data(), Dp, kb, kstride, D, a.scale, s.p.data(), Lp, l0);
      switch (n - at) {
        case 3: scores_pass<3>(js + at, s.qf.data(), Dp, kb, kstride, D, a.scale, s.p.data(), Lp, l0); break;
        case 2: scores_pass<2>(js + at, s.qf.data(), Dp, kb, kstride, D, a.scale, s.p.data(), Lp, l0); break;
        case 1: scores_pass<1>(js + at, s.qf.data(), Dp, kb, kstride, D, a.scale, s.p.data(), Lp, l0); break;
        default: break;
      }
    }
  }
}

// The queries js[0..n) take positions [from, to) of the values v into their sums (s.o, s.sum), NJ at a
// time. Values are read in place where a row of them is whole vectors (D == Dp), else widened first
// into rows padded to Dp.
template <int C, typename scalar_t>
void values_range(const Task<scalar_t>& a, Scratch& s, const Member<scalar_t>& m, int64_t from, int64_t to,
                  const int64_t* js, int64_t n, int64_t Lp) {
  constexpr int64_t Dp = C * W;
  if (from >= to || n == 0) return;
  const bool direct = a.D == Dp;
  if (!direct) {
    s.vf.assign((to - from) * Dp, 0.0f);
    for (int64_t l = from; l < to; ++l)
      widen(value_block(a, m, l / a.P) + l % a.P * a.vs2, s.vf.data() + (l - from) * Dp, a.D);
  }
  auto pass = [&](auto width, int64_t at) {
    constexpr int NJ = decltype(width)::value;
    const float* w[NJ];
    float* acc[NJ];
    float sum[NJ];
    for (int j = 0; j < NJ; ++j) {
      w[j] = s.p.data() + js[at + j] * Lp;
      acc[j] = s.o.data() + js[at + j] * Dp;
      sum[j] = s.sum[js[at + j]];
    }
    if (direct)  // page by page, each sum continued in position order
      for (int64_t b0 = from; b0 < to; b0 = (b0 / a.P + 1) * a.P)
        weighted_values<C, NJ>(w, value_block(a, m, b0 / a.P) + b0 % a.P * a.vs2, a.vs2, b0,
                               std::min(to, (b0 / a.P + 1) * a.P), acc, sum);
    else
      weighted_values<C, NJ>(w, s.vf.data(), Dp, from, to, acc, sum);
    for (int j = 0; j < NJ; ++j) s.sum[js[at + j]] = sum[j];
  };
  for (int64_t at = 0; at < n;) {
    const int64_t width = std::min<int64_t>(values_width(C), n - at);
    if (width == 4) pass(std::integral_constant<int, 4>(), at);
    else if (width == 3) pass(std::integral_constant<int, 3>(), at);
    else if (width == 2) pass(std::integral_constant<int, 2>(), at);
    else pass(std::integral_constant<int, 1>(), at);
    at += width;
  }
}

template <int C, typename scalar_t>
void attend_task(const Task<scalar_t>& a, Scratch& s) {
  constexpr int64_t Dp = C * W;
  const int64_t nq = a.nm * (a.j1 - a.j0), L = a.L, D = a.D, Lr = (L + BL - 1) / BL * BL;
  const int64_t Lp = Lr + W;  // the row stride of scores: not a multiple of 4 KiB (cache sets)
  s.qf.assign(nq * Dp, 0.0f);
  s.p.assign(nq * Lp, 0.0f);
  s.allow.assign(nq * Lr, 0.0f);  // 1 where the query sees the position, else 0
  // A ragged forward's pad slots are never read: their queries are skipped (zeros written), so a
  // wide row costs the rows beside it nothing. Each query is its own computation: the others' bits
  // do not change.
  s.live.clear();
  s.first.assign(1, 0);
  for (int64_t j = 0; j < nq; ++j) {
    const Query at = query_of(a, j);
    const Member<scalar_t>& m = a.members[at.m];
    if (m.live != nullptr && !m.live[at.t]) {
      scalar_t* dst = m.out + at.t * a.os1 + at.g * a.os2;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(0.0f);
    } else {
      s.live.push_back(j);
      widen(m.q + at.g * a.qs1 + at.t * a.qs2, s.qf.data() + j * Dp, D);
      float* al = s.allow.data() + j * Lr;
      if (m.mask != nullptr && a.ms3 == 1) {  // a contiguous mask row: a vector loop
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(m.mask + at.t * a.ms2);  // a bool is 0 or 1
        for (int64_t l = 0; l < L; ++l) al[l] = static_cast<float>(bytes[l]);
      } else if (m.mask != nullptr) {
        const bool* mrow = m.mask + at.t * a.ms2;
        for (int64_t l = 0; l < L; ++l) al[l] = mrow[l * a.ms3] ? 1.0f : 0.0f;
      } else {
        for (int64_t l = 0; l <= L - a.T + at.t; ++l) al[l] = 1.0f;
      }
    }
    if ((j + 1) % (a.j1 - a.j0) == 0) s.first.push_back(static_cast<int64_t>(s.live.size()));
  }
  const int64_t n_live = static_cast<int64_t>(s.live.size());
  if (n_live == 0) return;
  const int64_t* js = s.live.data();
  // The shared positions once for every live query of the group, then each row's own.
  if (a.S > 0) scores_range(a, s, a.members[0], 0, a.S, js, n_live, Dp, Lp);
  for (int64_t m = 0; m < a.nm; ++m)
    if (a.S < Lr && s.first[m + 1] > s.first[m])
      scores_range(a, s, a.members[m], a.S, Lr, js + s.first[m], s.first[m + 1] - s.first[m], Dp, Lp);
  for (int64_t at = 0; at < n_live; ++at) {
    float* __restrict pj = s.p.data() + js[at] * Lp;
    const float* __restrict al = s.allow.data() + js[at] * Lr;
    const float hidden = -std::numeric_limits<float>::infinity();
    float lane_max[W];
    // A maximum is exact in any order. lane_max[i] = std::max(lane_max[i], x), (lane < x) ? x : lane,
    // is MAXPS(x, lane) lane by lane (GCC kept the scalar loop's branches).
#if defined(__AVX512F__)
    __m512 most = _mm512_set1_ps(hidden);
    for (int64_t l0 = 0; l0 < Lr; l0 += W) {
      const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(al + l0), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      most = _mm512_max_ps(_mm512_mask_blend_ps(seen, _mm512_set1_ps(hidden), _mm512_loadu_ps(pj + l0)), most);
    }
    _mm512_storeu_ps(lane_max, most);
#else
    for (int64_t i = 0; i < W; ++i) lane_max[i] = hidden;
    for (int64_t l0 = 0; l0 < Lr; l0 += W)
      for (int64_t i = 0; i < W; ++i) lane_max[i] = std::max(lane_max[i], al[l0 + i] != 0.0f ? pj[l0 + i] : hidden);
#endif
    float m = hidden;
    for (int64_t i = 0; i < W; ++i) m = std::max(m, lane_max[i]);
    // Softmax weights, exactly 0 where hidden (clamped first: a hidden score may exceed the maximum).
    for (int64_t l = 0; l < Lr; ++l) pj[l] = fixed_exp(std::min(pj[l] - m, 0.0f)) * al[l];
  }
  s.o.assign(nq * Dp, 0.0f);
  s.sum.assign(nq, 0.0f);
  values_range<C>(a, s, a.members[0], 0, a.S, js, n_live, Lp);
  for (int64_t m = 0; m < a.nm; ++m)
    values_range<C>(a, s, a.members[m], a.S, L, js + s.first[m], s.first[m + 1] - s.first[m], Lp);
  for (int64_t at = 0; at < n_live; ++at) {
    const int64_t j = js[at];
    const Query q = query_of(a, j);
    scalar_t* dst = a.members[q.m].out + q.t * a.os1 + q.g * a.os2;
    const float sc = s.sum[j] > 0.0f ? s.sum[j] : 1.0f;  // no visible position: zeros
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(s.o[j * Dp + d] / sc);
  }
}

template <typename scalar_t>
void attend_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mask, bool has_mask, const at::Tensor& rows, bool has_rows,
                   const at::Tensor& live, const at::Tensor& share, const at::Tensor& tables, int64_t L,
                   double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), G = H / Hk, nq = G * T;
  // Groups of query rows read together: rows given one group id in `share` hold the same first
  // share[b][1] positions; every other row is a group of its own.
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> shared;  // per group: positions read once for all its rows
  {
    std::vector<std::pair<int64_t, int64_t>> at;  // (group id, its index in groups)
    const int64_t* sp = share.numel() > 0 ? share.data_ptr<int64_t>() : nullptr;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t id = sp != nullptr ? sp[2 * b] : -1, n = sp != nullptr ? sp[2 * b + 1] : 0;
      auto found = std::find_if(at.begin(), at.end(), [&](const auto& e) { return e.first == id; });
      if (id < 0 || found == at.end()) {
        if (id >= 0) at.emplace_back(id, static_cast<int64_t>(groups.size()));
        groups.push_back({b});
        shared.push_back(n);
      } else {
        groups[found->second].push_back(b);
        shared[found->second] = std::min(shared[found->second], n);
      }
    }
    for (size_t g = 0; g < groups.size(); ++g)
      shared[g] = groups[g].size() > 1 ? std::min(shared[g], L) / BL * BL : 0;
  }
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  // Tasks of at most QC queries a row; a few tasks (each thread's share decides the time) are split
  // finer until every thread gets as many: one row's 16-token tree was 9 tasks on 2 threads, one ran 5.
  const int64_t threads = at::get_num_threads();
  int64_t chunks_per_head = (nq + QC - 1) / QC;
  const bool few = n_groups * Hk * chunks_per_head < 8 * threads;
  for (int64_t c = chunks_per_head; few && c <= std::min(nq, 2 * chunks_per_head); ++c)
    if (n_groups * Hk * c % threads == 0) {
      chunks_per_head = c;
      break;
    }
  const int64_t chunk = (nq + chunks_per_head - 1) / chunks_per_head;
  chunks_per_head = (nq + chunk - 1) / chunk;
  const int64_t C = (D + W - 1) / W;
  TORCH_CHECK(C == 1 || C == 2 || C == 4 || C == 8 || C == 16,
              "attend: head dimension ", D, " is not supported (up to 256, in steps of 16, 32, 64 or 128)");
  const int64_t* rp = has_rows ? rows.data_ptr<int64_t>() : nullptr;
  const bool* lp = live.numel() > 0 ? live.data_ptr<bool>() : nullptr;
  const int64_t* tp = tables.numel() > 0 ? tables.data_ptr<int64_t>() : nullptr;
  Task<scalar_t> base{};
  base.qs1 = q.stride(1);
  base.qs2 = q.stride(2);
  base.ksl = k.stride(2);
  base.ksd = k.stride(3);
  base.vs2 = v.stride(2);
  base.P = tp != nullptr ? k.size(2) : BL;
  base.kbs = k.stride(0);
  base.vbs = v.stride(0);
  base.os1 = out.stride(1);
  base.os2 = out.stride(2);
  base.ms2 = has_mask ? mask.stride(2) : 0;
  base.ms3 = has_mask ? mask.stride(3) : 0;
  base.G = G;
  base.T = T;
  base.L = L;
  base.D = D;
  base.scale = static_cast<float>(scale);
  at::parallel_for(0, n_groups * Hk * chunks_per_head, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    std::vector<Member<scalar_t>> members;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t gi = task / (Hk * chunks_per_head), hk = task / chunks_per_head % Hk;
      const int64_t part = task % chunks_per_head;
      members.clear();
      for (const int64_t b : groups[gi]) {
        const int64_t r = tp != nullptr ? 0 : has_rows ? rp[b] : b;  // paged: the pool's first block
        members.push_back({q.data_ptr<scalar_t>() + b * q.stride(0) + hk * G * q.stride(1),
                           k.data_ptr<scalar_t>() + r * k.stride(0) + hk * k.stride(1),
                           v.data_ptr<scalar_t>() + r * v.stride(0) + hk * v.stride(1),
                           tp != nullptr ? tp + b * tables.size(1) : nullptr,
                           out.data_ptr<scalar_t>() + b * out.stride(0) + hk * G * out.stride(2),
                           has_mask ? mask.data_ptr<bool>() + b * mask.stride(0) : nullptr,
                           lp != nullptr ? lp + b * T : nullptr});
      }
      Task<scalar_t> a = base;
      a.members = members.data();
      a.nm = static_cast<int64_t>(members.size());
      a.S = shared[gi];
      a.j0 = part * chunk;
      a.j1 = std::min(nq, a.j0 + chunk);
      switch (C) {
        case 1: attend_task<1>(a, s); break;
        case 2: attend_task<2>(a, s); break;
        case 4: attend_task<4>(a, s); break;
        case 8: attend_task<8>(a, s); break;
        default: attend_task<16>(a, s); break;
      }
    }
  });
}

}  // namespace

// q [B, H, T, D]; k, v [Bk, Hk, L, D] (keys with positions or dimensions contiguous); mask bool [B or 1, 1, T, L] or empty for
// causal (query t sees positions up to L - T + t); rows [B] int64: the k/v row of each query row
// (empty: the same row); live bool [B, T]: the queries whose outputs are read (empty: all); share
// int64 [B, 2]: per query row a group id (negative: none) and a count n: the k/v rows of one group
// hold the same first n positions, read once for all of them (empty: no sharing). Paged: `tables`
// int64 [B, nb] names per query row the pool pages of its positions (page i: positions i * P on), k
// and v are pools [N, Hk, P, D] (P dividing BL) and `length` is L (rows then empty); else tables is empty and
// length -1 (L: k's positions). Returns [B, T, H, D] in q's dtype, the same bits with sharing or
// without, paged or not.
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor mask, at::Tensor rows,
                     double scale, at::Tensor live, at::Tensor share, at::Tensor tables, int64_t length) {
  RECORD_FUNCTION("tot::attend", std::vector<c10::IValue>());  // seen by torch.profiler (decoding.profile_forward)
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: q, k, v must be 4D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "attend: one dtype");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "attend: query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3) && v.size(2) == k.size(2), "attend: shapes");
  const bool has_mask = mask.numel() > 0, has_rows = rows.numel() > 0, paged = tables.numel() > 0;
  const int64_t L = paged ? length : k.size(2);
  if (paged) {
    TORCH_CHECK(!has_rows && BL % k.size(2) == 0 && v.size(0) == k.size(0),
                "attend: pools [N, Hk, P, D] with P dividing ", BL, ", without rows");
    TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == q.size(0) &&
                    tables.size(1) * k.size(2) >= (L + BL - 1) / BL * BL && L >= 0,
                "attend: tables [B, pages] covering length in whole blocks of ", BL);
    tables = tables.contiguous();
    TORCH_CHECK(tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < k.size(0), "attend: a block past the pool");
  }
  // Rows of the head dimension are read as vectors.
  if (q.stride(3) != 1) q = q.contiguous();
  if (k.stride(3) != 1 && k.stride(2) != 1) k = k.contiguous();  // keys: either dimension contiguous
  if (v.stride(3) != 1) v = v.contiguous();
  if (has_mask) {
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(1) == 1, "attend: mask");
    mask = mask.expand({q.size(0), 1, q.size(2), L});
  }
  if (has_rows) {
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == q.size(0), "attend: rows");
    rows = rows.contiguous();
  } else if (!paged) {
    TORCH_CHECK(k.size(0) == q.size(0), "attend: key/value rows must match query rows");
  }
  if (live.numel() > 0) {
    TORCH_CHECK(live.scalar_type() == at::kBool && live.numel() == q.size(0) * q.size(2), "attend: live [B, T]");
    live = live.contiguous();
  }
  if (share.numel() > 0) {
    TORCH_CHECK(share.scalar_type() == at::kLong && share.dim() == 2 && share.size(0) == q.size(0) &&
                    share.size(1) == 2, "attend: share [B, 2]");
    share = share.contiguous();
  }
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend", [&] {
    attend_kernel<scalar_t>(q, k, v, mask, has_mask, rows, has_rows, live, share, tables, L, scale, out);
  });
  return out;
}
