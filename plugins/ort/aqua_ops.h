// What the kernels of the com.aqua domain share (topk_gather_dot.cc, aqua_attention.cc, h2o_attention.cc):
// element access, the selection rules, the query projection, the key-row accumulation, the value product, the
// total_length input and the op declaration.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <type_traits>
#include <vector>

#include "simd/simd.h"

namespace aqua {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const Ort::Float16_t* p, int64_t i) { return p[i].ToFloat(); }
// An int8 cache (contract cache_dtype int8) is read as its stored integers; the kernels apply each token's scale
// to its scores (keys) and probabilities (values) instead, one multiply a token rather than one a value (scale_rows).
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(Ort::Float16_t* p, int64_t i, float v) { p[i] = Ort::Float16_t(v); }

// x[0..n) -> out[0..n) float32. A float16 cache (contract cache_dtype) is read through this a vector at a time where
// the CPU converts them (F16C: one instruction per 8 or 16); Ort::Float16_t's own conversion is a scalar bit-level
// routine that held a float16 cache's key pass at a fraction of the bandwidth its halved bytes allow.
inline void widen(const Ort::Float16_t* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) {
    simd::store(out + i, simd::load_f16(reinterpret_cast<const uint16_t*>(x + i)));
  }
  for (; i < n; ++i) out[i] = x[i].ToFloat();
}

// x[0..n) -> out[0..n) float32: an int8 cache's stored integers.
inline void widen(const int8_t* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) simd::store(out + i, simd::load_i8(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// The nodes' `rule` attribute (aqua_export/ops/spec.py: MAGNITUDE 0, GROUP 1, STATIC 2). The weighted rules
// reach the kernels as magnitude / group: export folds rms(k^) into P.
enum Rule : int64_t { kPerHead = 0, kGroup = 1, kStatic = 2 };

// order[0..k) = the k largest score[] (ties -> lower index), in increasing index order: under this strict total
// order the set is unique, so one pass finds it below the k-th largest value (nth_element over plain floats), and
// the ties at that value go to the lower indices. A partition of indices under a comparing lambda cost ~2,000
// cycles at r = 64 (perf: a fifth of sparse prefill's estimate, which selects for every sampled row).
inline void top_k(const float* score, int64_t r, int64_t k, int64_t* order) {
  if (k <= 0) return;
  if (k >= r) {
    std::iota(order, order + r, int64_t{0});
    return;
  }
  static thread_local std::vector<float> tmp;
  tmp.assign(score, score + r);
  std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<float>());
  const float kth = tmp[static_cast<size_t>(k - 1)];
  int64_t ties = k;  // how many entries equal to kth are kept: k minus those above it
  for (int64_t c = 0; c < r; ++c) ties -= score[c] > kth;
  int64_t n = 0;
  for (int64_t c = 0; c < r; ++c) {
    if (score[c] > kth || (score[c] == kth && ties-- > 0)) order[n++] = c;
  }
}

// The selection scores of one (batch, kv head, token): q [g][r] -> score [g'][r], |q_j| per row, or one row of
// sum_j |q_j| under the group rule (what select_group and the pooled selection rank).
inline void row_scores(const float* q, int64_t g, int64_t r, int64_t rule, float* score) {
  if (rule == kGroup) {
    std::fill(score, score + r, 0.0f);
    for (int64_t j = 0; j < g; ++j) {
      for (int64_t c = 0; c < r; ++c) score[c] += std::fabs(q[j * r + c]);
    }
    return;
  }
  for (int64_t i = 0; i < g * r; ++i) score[i] = std::fabs(q[i]);
}

// The selections of the g query rows of one (batch, kv head, token): q [g][r] (float copies) ->
// idx [g][k] (rows `stride` apart, default k). Per head: top-k |q_j|; group: one top-k of sum_j |q_j| shared by all
// g; static: 0..k-1.
inline void select_group(const float* q, int64_t g, int64_t r, int64_t k, int64_t rule, int64_t* idx,
                         int64_t stride = 0) {
  const int64_t s = stride > 0 ? stride : k;
  static thread_local std::vector<float> score;  // per-call scratch, reused: no allocation per token
  static thread_local std::vector<int64_t> order;
  score.resize(static_cast<size_t>(g * r));
  order.resize(static_cast<size_t>(r));
  if (rule == kStatic || k == r) {
    for (int64_t j = 0; j < g; ++j) std::iota(idx + j * s, idx + j * s + k, int64_t{0});
    return;
  }
  row_scores(q, g, r, rule, score.data());
  for (int64_t j = 0; j < g; ++j) {
    if (rule != kGroup || j == 0) top_k(score.data() + (rule == kGroup ? 0 : j * r), r, k, order.data());
    std::copy(order.begin(), order.begin() + k, idx + j * s);
  }
}

// The pooled selection (ops/rules.py; a node with head_prices): per token a layer's heads share Hkv g' k
// coordinates, ranked by score * price[kv head] in float32 (g' = g, or 1 under the group rule), ties to the lower
// flat index (kv head, row, coordinate). A cut is that token's K-th ranked entry: a coordinate is kept when its
// priced score beats it (ranks at or before it).
struct PoolCut {
  float price;  // of the row's kv head
  float value;  // the K-th priced score of the token
  int64_t index;  // its flat index
};

// A row's (or group's) score[0..r) at flat offset `base` -> idx[0..n) the coordinates it keeps; returns n.
inline int64_t pooled_row(const float* score, int64_t r, const PoolCut& cut, int64_t base, int64_t* idx) {
  int64_t n = 0;
  for (int64_t c = 0; c < r; ++c) {
    const float p = score[c] * cut.price;
    if (p > cut.value || (p == cut.value && base + c <= cut.index)) idx[n++] = c;
  }
  return n;
}

// select_group under a pooled cut: idx [g][r] (row j's kept coordinates at idx + j r), count [g].
inline void select_pooled(const float* q, int64_t g, int64_t r, int64_t rule, int64_t kvh, const PoolCut& cut,
                          int64_t* idx, int64_t* count) {
  static thread_local std::vector<float> score;
  score.resize(static_cast<size_t>(g * r));
  row_scores(q, g, r, rule, score.data());
  if (rule == kGroup) {
    const int64_t n = pooled_row(score.data(), r, cut, kvh * r, idx);
    for (int64_t j = 0; j < g; ++j) {
      std::copy(idx, idx + n, idx + j * r);
      count[j] = n;
    }
    return;
  }
  for (int64_t j = 0; j < g; ++j) {
    count[j] = pooled_row(score.data() + j * r, r, cut, (kvh * g + j) * r, idx + j * r);
  }
}

// Eight floats (simd.h: one AVX register, or two SSE ones), for the decode kernels' float32 inner loops, which walk
// positions eight at a time; loads and stores are unaligned. float16 or int8 cache elements are widened in registers
// where the CPU has the instructions (F16C; AVX2's sign extension).
using simd::f8;
inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline f8 splat8(float x) { return x - f8{}; }  // one broadcast (0 + x would add first: simd::splat)
inline f8 load8(const Ort::Float16_t* p) { return simd::load8_f16(reinterpret_cast<const uint16_t*>(p)); }
inline f8 load8(const int8_t* p) { return simd::load8_i8(p); }

// An int8 cache's rows (ops.spec, ops.rules.int8_rows): each token's K^ column and V row end in the code c of its
// scale 2^(c / 4), one element past the width (K^: one more dim-major row; V: one more column).
template <typename C>
constexpr int64_t kScaleSlots = std::is_same_v<C, int8_t> ? 1 : 0;

// The scale of code c (ops.spec int8_scales): 2^floor(c / 4), built from its bits, times 2^((c mod 4) / 4) rounded
// from double to float as the table is (a power of two times a constant: exact, the table's bits); std::ldexp /
// exp2f are library calls per value and not bit-equal to the table.
constexpr float kScaleRoots[4] = {1.0f, static_cast<float>(1.189207115002721),
                                  static_cast<float>(1.4142135623730951), static_cast<float>(1.681792830507429)};

inline float int8_scale(int8_t c) {
  const uint32_t bits = static_cast<uint32_t>((c >> 2) + 127) << 23;  // c >> 2: floor(c / 4), in [-32, 31]
  float two;
  std::memcpy(&two, &bits, sizeof two);
  return two * kScaleRoots[c & 3];
}

// out[i] = the scale of code c[i * stride] for n codes; contiguous codes eight at a time, as int8_scale computes
// each (the power of two from its bits, the root picked by a lane permute: the same product, the same bits).
inline void scales_of(const int8_t* c, int64_t n, int64_t stride, float* out) {
  typedef int32_t i8v __attribute__((vector_size(32)));
  typedef int8_t c8 __attribute__((vector_size(8)));
  int64_t i = 0;
  if (stride == 1) {
    f8 roots;
    for (int e = 0; e < 8; ++e) roots[e] = kScaleRoots[e & 3];
    for (; i + 8 <= n; i += 8) {
      c8 raw;
      std::memcpy(&raw, c + i, sizeof raw);
      const i8v code = __builtin_convertvector(raw, i8v);  // one sign-extending load
      const i8v bits = ((code >> 2) + 127) << 23;
      f8 two;
      std::memcpy(&two, &bits, sizeof two);
      store8(out + i, two * __builtin_shuffle(roots, code & 3));
    }
  }
  for (; i < n; ++i) out[i] = int8_scale(c[i * stride]);
}

// s[rr][0..n) *= scale[0..n) for nr rows `pitch` apart: a token's scale applied to its score or probability (what
// scaling its cached values first would give, up to float32 rounding).
inline void scale_rows(int nr, float* s, int64_t pitch, int64_t n, const float* scale) {
  for (int rr = 0; rr < nr; ++rr) {
    float* x = s + rr * pitch;
    for (int64_t i = 0; i < n; ++i) x[i] *= scale[i];
  }
}

constexpr int kLanes = 8;  // independent partial maxima / sums: a reduction the compiler can vectorise

// x[0..n) -> e^(x - top) in place; returns their sum: sixteen partial sums (a panel, simd.h), one a lane, folded
// in simd::fold_sum's order, the tail through one padded panel (-inf lanes give 0). The softmax loops of every
// attention kernel. The same operations on each element and each partial sum at every width: the same bits.
inline float exp_sum(float* x, int64_t n, float top) {
  using simd::kLanes;
  using simd::kPanel;
  using simd::kPanelVecs;
  const simd::vf shift = simd::splat(top);
  simd::vf acc[kPanelVecs] = {};
  int64_t i = 0;
  for (; i + kPanel <= n; i += kPanel) {  // kPanelVecs exps in flight side by side
    for (int v = 0; v < kPanelVecs; ++v) {
      const simd::vf e = simd::exp(simd::load(x + i + v * kLanes) - shift);
      simd::store(x + i + v * kLanes, e);
      acc[v] += e;
    }
  }
  if (i < n) {
    alignas(64) float tail[kPanel];
    std::fill(tail, tail + kPanel, -INFINITY);
    std::copy(x + i, x + n, tail);
    for (int v = 0; v < kPanelVecs; ++v) {
      const simd::vf e = simd::exp(simd::load(tail + v * kLanes) - shift);
      simd::store(tail + v * kLanes, e);
      acc[v] += e;
    }
    std::copy(tail, tail + (n - i), x + i);
  }
  return simd::fold_sum(acc);
}

// out[c0..c0 + W kLanes) = x[0..d) P[d][c0..): W vector accumulators held in registers over the d rows of P.
template <int W>
inline void project_columns(const float* x, const float* P, int64_t d, int64_t r, float* out) {
  simd::vf acc[W] = {};
  for (int64_t i = 0; i < d; ++i) {
    for (int w = 0; w < W; ++w) acc[w] += x[i] * simd::load(P + i * r + simd::kLanes * w);
  }
  for (int w = 0; w < W; ++w) simd::store(out + simd::kLanes * w, acc[w]);
}

// out[0..r) = x[0..d) P[d][r], float32 accumulation: q^ of one query row (d^2 multiply-adds, the cost that
// sets AQUA's break-even, so float32 keeps them in vector registers; other types take the plain loop). Each output
// takes the same operations (a sum over i in order) whichever loop computes it.
template <typename T>
inline void project(const T* x, const T* P, int64_t d, int64_t r, float* __restrict out) {
  int64_t c0 = 0;
  if constexpr (std::is_same_v<T, float>) {
    constexpr int64_t wide = simd::kProjectVecs * simd::kLanes;
    for (; c0 + wide <= r; c0 += wide) project_columns<simd::kProjectVecs>(x, P + c0, d, r, out + c0);
    for (; c0 + simd::kLanes <= r; c0 += simd::kLanes) project_columns<1>(x, P + c0, d, r, out + c0);
  }
  std::fill(out + c0, out + r, 0.0f);
  for (int64_t i = 0; i < d; ++i) {
    const float xi = load(x, i);
    for (int64_t c = c0; c < r; ++c) out[c] += xi * load(P + i * r, c);
  }
}

// One block of one query row in an online softmax: x[0..n) (its masked scores, top their max) -> e^(x - m')
// with m' = max(m, top); l and the row's output o[0..rv) rescaled by e^(m - m') (0 while m = -inf: nothing
// seen yet, o and l 0), l += the block's sum, m = m'. AquaAttention's and H2OAttention's blocks alike.
inline void online_block(float* x, int64_t n, float top, float& m, float& l, float* o, int64_t rv) {
  const float m_new = std::max(m, top);
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // e^0 without the call (most blocks of a long row)
  if (alpha != 1.0f) {
    for (int64_t c = 0; c < rv; ++c) o[c] *= alpha;
  }
  l = l * alpha + exp_sum(x, n, m_new);
  m = m_new;
}

// One query row's partial softmax states from the splits of its positions merged: records [o[rv], m, l] at
// first + i step (i < splits) -> o[rv] = sum o_i e^(m_i - M) (unnormalised), l = sum l_i e^(m_i - M), m = M; a
// split that saw nothing (l = 0) counts nothing (m -inf, l 0 when none did). Both attention kernels' merge.
inline void merge_splits(const float* first, int64_t step, int64_t splits, int64_t rv, float* o, float& m, float& l) {
  m = -INFINITY, l = 0.0f;
  for (int64_t i = 0; i < splits; ++i) {
    if (first[i * step + rv + 1] > 0.0f) m = std::max(m, first[i * step + rv]);
  }
  std::fill(o, o + rv, 0.0f);
  for (int64_t i = 0; i < splits; ++i) {
    const float* p = first + i * step;
    if (!(p[rv + 1] > 0.0f)) continue;
    const float w = std::exp(p[rv] - m);
    l += p[rv + 1] * w;
    for (int64_t c = 0; c < rv; ++c) o[c] += p[c] * w;
  }
}

// The per-call buffers (call_buffer): one tag each, so no two uses share one.
enum class Buffer { kPoolValue, kPoolIndex, kDensePartials, kPageBest, kPageForced, kPageWant, kPageOrigin, kPageChosen, kPagePartials, kH2OVisibleBefore, kPromptPanels,
                   kPromptPanels16, kPromptProjection };

// A per-call buffer of n elements, kept by the calling thread between calls. Its elements are stale: each use
// writes what it reads. Fresh vectors of tens to hundreds of KB cost 15-27 us a call here (measured: glibc hands
// the heap's top back on free, and the next call faults it in again).
template <typename E, Buffer Tag>
std::vector<E>& call_buffer(size_t n) {
  static thread_local std::vector<E> v;
  v.resize(n);
  return v;
}

constexpr int kRows = 4;  // query rows accumulated together
constexpr int64_t kMaxWidth = 512;  // the widest K^ / V row the attention kernels take (r, rv)

// uni[0..nu) = the coordinates c < r with mark[c] set, ascending (the union of a tile's selections, which
// accumulate_rows walks); returns nu.
inline int64_t union_of(const char* mark, int64_t r, int32_t* uni) {
  int64_t nu = 0;
  for (int64_t c = 0; c < r; ++c) {
    if (mark[c]) uni[nu++] = static_cast<int32_t>(c);
  }
  return nu;
}
constexpr int64_t kLine = 16;        // positions per step of the accumulate_* loops
constexpr int64_t kKeyAhead = 512;   // elements ahead on a key row that accumulate_stream prefetches

// acc[rr][0..n) = sum over c in the union of w[c][rr] * key[c][0..n) (rows `pitch` floats apart; uni[0..nu) the
// coordinates, ascending; key rows `stride` elements apart, float32, float16 or int8 widened in registers). Two
// shapes, for the two ways the kernels read K^, with the same sums (four rows' products added, then the rows left
// one at a time), so either gives the same float32 scores:
//   streams (the dense pass, token selection's score pass, TopKGatherDot): long segments of a few rows. Four
//     rows per pass over the segment, the accumulators in L1, read and written once per four rows: four streams at
//     a time (16 at once, one per selected row, ran 1.3x slower on a float16 cache at 8k), each requested
//     kKeyAhead on;
//   pages (token selection's attend pass): runs of 16 positions of every row, scattered. 8 positions at a time,
//     NR accumulator vectors held in registers over all the rows and stored once (the stream shape on 16-position
//     runs spent the pass in its accumulators' loads and stores: 1.6x slower at batch 16, 1k context; one pass of
//     16 positions, each row's weights broadcast once, ran 0.87-0.95x at 8k and 16k, caches flushed: the page's
//     requests lose the first pass's time). What it requests from memory meanwhile: PageRequests.
template <int NR, typename T>
void accumulate_stream(const T* __restrict key, int64_t stride, const int32_t* uni, int64_t nu, const float* wbuf,
                       int64_t n, float* __restrict acc, int64_t pitch) {
  constexpr int64_t kLineElems = 64 / sizeof(T);
  for (int rr = 0; rr < NR; ++rr) std::memset(acc + rr * pitch, 0, sizeof(float) * n);
  const int64_t whole = n / kLine * kLine;
  int64_t u = 0;
  for (; u + 4 <= nu; u += 4) {
    const T* k[4];
    f8 w[4][NR];
    for (int t = 0; t < 4; ++t) {
      k[t] = key + uni[u + t] * stride;
      for (int rr = 0; rr < NR; ++rr) w[t][rr] = splat8(wbuf[uni[u + t] * kRows + rr]);
    }
    for (int64_t i0 = 0; i0 < whole; i0 += kLine) {
      if (i0 % kLineElems == 0) {
        for (int t = 0; t < 4; ++t) __builtin_prefetch(k[t] + i0 + kKeyAhead);
      }
      f8 lo[4], hi[4];
      for (int t = 0; t < 4; ++t) lo[t] = load8(k[t] + i0), hi[t] = load8(k[t] + i0 + 8);
      for (int rr = 0; rr < NR; ++rr) {
        float* a = acc + rr * pitch + i0;
        store8(a, load8(a) + (w[0][rr] * lo[0] + w[1][rr] * lo[1] + w[2][rr] * lo[2] + w[3][rr] * lo[3]));
        store8(a + 8, load8(a + 8) + (w[0][rr] * hi[0] + w[1][rr] * hi[1] + w[2][rr] * hi[2] + w[3][rr] * hi[3]));
      }
    }
    for (int64_t i = whole; i < n; ++i) {
      for (int rr = 0; rr < NR; ++rr) {
        acc[rr * pitch + i] += w[0][rr][0] * load(k[0], i) + w[1][rr][0] * load(k[1], i) +
                               w[2][rr][0] * load(k[2], i) + w[3][rr][0] * load(k[3], i);
      }
    }
  }
  for (; u < nu; ++u) {
    const T* kr = key + uni[u] * stride;
    for (int64_t i = 0; i < n; ++i) {
      const float kv = load(kr, i);
      for (int rr = 0; rr < NR; ++rr) acc[rr * pitch + i] += wbuf[uni[u] * kRows + rr] * kv;
    }
  }
}

// What accumulate_pages requests from memory while it scores a run, per page i (16 positions) of the run:
//   key[i]: the K^ lines of a page further on in the chosen order, one line (coordinate row uni[u]) beside each load
//     of page i's first 8 positions, then row extra_row (int8: the scale codes; -1 none);
//   value[i]: page i's own V rows (value_lines lines from there), spread over the loads of its last 8 positions.
// nullptr: nothing for that page. Spread this way the misses stay in flight beside the loads; requested in bursts
// (a page's r lines at once, a chunk's V rows at once) they queued behind each other and the V rows left L1 before
// their pass (measured: the attend pass 1.25x faster at batch 16, 1k context, float16 cache).
template <typename T>
struct PageRequests {
  const T* const* key = nullptr;
  int64_t extra_row = -1;
  const char* const* value = nullptr;
  int64_t value_lines = 0;
};

template <int NR, typename T>
void accumulate_pages(const T* __restrict key, int64_t stride, const int32_t* uni, int64_t nu, const float* wbuf,
                      int64_t n, float* __restrict acc, int64_t pitch, const PageRequests<T>& req) {
  // the sums grouped as accumulate_stream groups them (four rows, then one at a time): the same float32 results,
  // so the path a step takes never changes a score
  int64_t i0 = 0;
  for (; i0 + kLine <= n; i0 += kLine) {
    const T* ahead = req.key != nullptr ? req.key[i0 / kLine] : nullptr;
    const char* rows = req.value != nullptr ? req.value[i0 / kLine] : nullptr;
    for (int half = 0; half < 2; ++half) {
      const int64_t at = i0 + 8 * half;
      f8 sum[NR];
      for (int rr = 0; rr < NR; ++rr) sum[rr] = f8{};
      int64_t u = 0;
      for (; u + 4 <= nu; u += 4) {
        if (half == 0 && ahead != nullptr) {  // non-temporal: read twice (both halves) soon after, then not again
          for (int t = 0; t < 4; ++t) __builtin_prefetch(ahead + uni[u + t] * stride, 0, 0);
        }
        if (half == 1 && rows != nullptr) {
          for (int64_t l = u * req.value_lines / nu; l < (u + 4) * req.value_lines / nu; ++l) {
            __builtin_prefetch(rows + 64 * l);
          }
        }
        f8 k[4];
        const float* w[4];
        for (int t = 0; t < 4; ++t) k[t] = load8(key + uni[u + t] * stride + at), w[t] = wbuf + uni[u + t] * kRows;
        for (int rr = 0; rr < NR; ++rr) {
          sum[rr] = sum[rr] + (w[0][rr] * k[0] + w[1][rr] * k[1] + w[2][rr] * k[2] + w[3][rr] * k[3]);
        }
      }
      if (half == 1 && rows != nullptr) {  // the lines the loop above left (nu not a multiple of 4)
        for (int64_t l = u * req.value_lines / nu; l < req.value_lines; ++l) __builtin_prefetch(rows + 64 * l);
      }
      for (; u < nu; ++u) {
        const f8 k = load8(key + uni[u] * stride + at);
        for (int rr = 0; rr < NR; ++rr) sum[rr] += wbuf[uni[u] * kRows + rr] * k;
      }
      for (int rr = 0; rr < NR; ++rr) store8(acc + rr * pitch + at, sum[rr]);
    }
    if (ahead != nullptr && req.extra_row >= 0) __builtin_prefetch(ahead + req.extra_row * stride, 0, 0);
  }
  if (i0 < n && req.value != nullptr && req.value[i0 / kLine] != nullptr) {
    for (int64_t l = 0; l < req.value_lines; ++l) __builtin_prefetch(req.value[i0 / kLine] + 64 * l);
  }
  for (int64_t i = i0; i < n; ++i) {  // the last n mod 16 positions (a sequence's last, partial page)
    float sum[NR] = {};
    int64_t u = 0;
    for (; u + 4 <= nu; u += 4) {
      float k[4];
      for (int t = 0; t < 4; ++t) k[t] = load(key + uni[u + t] * stride, i);
      for (int rr = 0; rr < NR; ++rr) {
        sum[rr] += wbuf[uni[u] * kRows + rr] * k[0] + wbuf[uni[u + 1] * kRows + rr] * k[1] +
                   wbuf[uni[u + 2] * kRows + rr] * k[2] + wbuf[uni[u + 3] * kRows + rr] * k[3];
      }
    }
    for (; u < nu; ++u) {
      const float kv = load(key + uni[u] * stride, i);
      for (int rr = 0; rr < NR; ++rr) sum[rr] += wbuf[uni[u] * kRows + rr] * kv;
    }
    for (int rr = 0; rr < NR; ++rr) acc[rr * pitch + i] = sum[rr];
  }
}

// The two shapes for nr <= kRows query rows: accumulate_rows streams, accumulate_page_rows reads a run of pages.
template <typename T>
void accumulate_rows(int nr, const T* key, int64_t stride, const int32_t* uni, int64_t nu, const float* wbuf,
                     int64_t n, float* acc, int64_t pitch) {
  switch (nr) {
    case 1: accumulate_stream<1>(key, stride, uni, nu, wbuf, n, acc, pitch); break;
    case 2: accumulate_stream<2>(key, stride, uni, nu, wbuf, n, acc, pitch); break;
    case 3: accumulate_stream<3>(key, stride, uni, nu, wbuf, n, acc, pitch); break;
    default: accumulate_stream<4>(key, stride, uni, nu, wbuf, n, acc, pitch); break;
  }
}

template <typename T>
void accumulate_page_rows(int nr, const T* key, int64_t stride, const int32_t* uni, int64_t nu, const float* wbuf,
                          int64_t n, float* acc, int64_t pitch, const PageRequests<T>& req) {
  switch (nr) {
    case 1: accumulate_pages<1>(key, stride, uni, nu, wbuf, n, acc, pitch, req); break;
    case 2: accumulate_pages<2>(key, stride, uni, nu, wbuf, n, acc, pitch, req); break;
    case 3: accumulate_pages<3>(key, stride, uni, nu, wbuf, n, acc, pitch, req); break;
    default: accumulate_pages<4>(key, stride, uni, nu, wbuf, n, acc, pitch, req); break;
  }
}

// o[rr][0..r) += p[rr][i] * V[i][0..r) over n positions (V rows r apart; p rows p_pitch apart, o rows o_pitch
// apart): the value product of AquaAttention and H2OAttention.
//   r a multiple of 8 (float32, or float16 / int8 widened 8 at a time): GCC/Clang vector registers, a pass over the
//     V rows per tile of 8 kValueVectors columns, the row kValueAhead positions on prefetched (without prefetch,
//     passes per column tile ran at half the machine's streaming bandwidth on 2 cores);
//   otherwise: column tiles of kCols with NR x kCols accumulators (o read and written once per call).
constexpr int64_t kCols = 32;
constexpr int64_t kValueAhead = 16;

template <int NR, bool Full, typename T>
void add_value_tile(const float* p, int64_t p_pitch, const T* __restrict v, int64_t n, int64_t vs, int64_t nc,
                    float* __restrict o, int64_t o_pitch) {
  float acc[NR][kCols];
  for (int rr = 0; rr < NR; ++rr) {
    for (int64_t c = 0; c < kCols; ++c) acc[rr][c] = Full || c < nc ? o[rr * o_pitch + c] : 0.0f;
  }
  for (int64_t i = 0; i < n; ++i) {
    const T* vr = v + i * vs;
    float vv[kCols];
    for (int64_t c = 0; c < kCols; ++c) vv[c] = Full || c < nc ? load(vr, c) : 0.0f;
    for (int rr = 0; rr < NR; ++rr) {
      const float w = p[rr * p_pitch + i];
      for (int64_t c = 0; c < kCols; ++c) acc[rr][c] += w * vv[c];
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    for (int64_t c = 0; c < kCols; ++c) {
      if (Full || c < nc) o[rr * o_pitch + c] = acc[rr][c];
    }
  }
}

template <int NR, int W, bool Ahead, typename T>
void add_value_vectors(const float* p, int64_t p_pitch, const T* __restrict v, int64_t n, int64_t vs,
                       float* __restrict o, int64_t o_pitch) {
  constexpr int kPerLine = 64 / (8 * sizeof(T));  // vectors of 8 per 64-byte line: one prefetch each
  f8 acc[NR][W];
  for (int rr = 0; rr < NR; ++rr) {
    for (int w = 0; w < W; ++w) acc[rr][w] = load8(o + rr * o_pitch + 8 * w);
  }
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (Ahead) {
      for (int w = 0; w < W; w += kPerLine) __builtin_prefetch(v + (i + kValueAhead) * vs + 8 * w);
    }
    f8 pw[NR];
    for (int rr = 0; rr < NR; ++rr) pw[rr] = splat8(p[rr * p_pitch + i]);
    for (int w = 0; w < W; ++w) {
      const f8 vv = load8(v + i * vs + 8 * w);
      for (int rr = 0; rr < NR; ++rr) acc[rr][w] += pw[rr] * vv;
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    for (int w = 0; w < W; ++w) store8(o + rr * o_pitch + 8 * w, acc[rr][w]);
  }
}

// Vectors of 8 columns per pass over the V rows for NR rows: simd::kValueVectors (the width's register file); the
// passes after the first read the rows from L1.
using simd::kValueVectors;

// V rows `vs` elements apart (r, or r + 1 in an int8 cache: the scale's code rides at the end of each row).
template <int NR, bool Ahead, typename T>
void add_values(const float* p, int64_t p_pitch, const T* v, int64_t n, int64_t r, int64_t vs, float* o,
                int64_t o_pitch) {
  constexpr int W = kValueVectors<NR>;
  int64_t c0 = 0;
  {  // float32, float16 and int8 rows alike (load8 widens float16 and int8)
    for (; c0 + 8 * W <= r; c0 += 8 * W) add_value_vectors<NR, W, Ahead>(p, p_pitch, v + c0, n, vs, o + c0, o_pitch);
    for (; c0 + 8 <= r; c0 += 8) add_value_vectors<NR, 1, Ahead>(p, p_pitch, v + c0, n, vs, o + c0, o_pitch);
  }
  for (; c0 < r; c0 += kCols) {
    const int64_t nc = std::min(kCols, r - c0);
    if (nc == kCols) {
      add_value_tile<NR, true>(p, p_pitch, v + c0, n, vs, nc, o + c0, o_pitch);
    } else {
      add_value_tile<NR, false>(p, p_pitch, v + c0, n, vs, nc, o + c0, o_pitch);
    }
  }
}

// Ahead: as accumulate_rows' (V rows kValueAhead on, off for token selection's scattered pages).
template <bool Ahead = true, typename T>
void add_values_rows(int nr, const float* p, int64_t p_pitch, const T* v, int64_t n, int64_t r, int64_t vs, float* o,
                     int64_t o_pitch) {
  switch (nr) {
    case 1: add_values<1, Ahead>(p, p_pitch, v, n, r, vs, o, o_pitch); break;
    case 2: add_values<2, Ahead>(p, p_pitch, v, n, r, vs, o, o_pitch); break;
    case 3: add_values<3, Ahead>(p, p_pitch, v, n, r, vs, o, o_pitch); break;
    default: add_values<4, Ahead>(p, p_pitch, v, n, r, vs, o, o_pitch); break;
  }
}

// An optional int attribute (`rule` is absent from nodes written before the selection rules were exported).
inline int64_t int_attribute(const Ort::ConstKernelInfo& ki, const char* name, int64_t fallback) {
  try {
    return ki.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// An optional float attribute.
inline float float_attribute(const Ort::ConstKernelInfo& ki, const char* name, float fallback) {
  try {
    return ki.GetAttribute<float>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// The int64 total_length input (one element): the sequence length so far, new tokens included.
inline int64_t total_length(Ort::KernelContext& ctx, size_t index) {
  auto t = ctx.GetInput(index);
  if (t.GetTensorTypeAndShapeInfo().GetElementCount() != 1) {
    ORT_CXX_API_THROW("total_length must hold one int64", ORT_INVALID_ARGUMENT);
  }
  return t.GetTensorData<int64_t>()[0];
}

template <typename T>
constexpr ONNXTensorElementDataType element_type() {
  if constexpr (std::is_same_v<T, float>) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if constexpr (std::is_same_v<T, int8_t>) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

// What every op of the library declares alike: a CPU kernel of element type T (float or float16) with
// NInputs inputs of which the first NRequired must be given, input `LengthAt` an int64 total_length (none when
// out of range), input `FloatAt` float32 whatever T is (none when out of range), the inputs whose bits are set in
// `CacheInputs` of type C (the cache's element type, contract cache_dtype) and those in `IntInputs` int64, and one
// output of type T.
template <typename Self, typename K, typename T, size_t NInputs, size_t LengthAt, size_t FloatAt = 99,
          size_t NRequired = NInputs, typename C = T, unsigned CacheInputs = 0, unsigned IntInputs = 0>
struct CpuOp : Ort::CustomOpBase<Self, K> {
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < NRequired ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                         : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const { return new K(info); }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return NInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == LengthAt || ((IntInputs >> i) & 1u)) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (i == FloatAt) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if ((CacheInputs >> i) & 1u) return element_type<C>();
    return element_type<T>();
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return element_type<T>(); }
};

// Add AquaAttention (aqua_attention.cc) and H2OAttention (h2o_attention.cc) to the domain.
void add_attention_ops(Ort::CustomOpDomain& domain);
void add_h2o_ops(Ort::CustomOpDomain& domain);
void add_logit_rows_ops(Ort::CustomOpDomain& domain);  // logit_rows.cc
void add_quantize_rows_ops(Ort::CustomOpDomain& domain);  // quantize_rows.cc
void add_matmul_q4a8_ops(Ort::CustomOpDomain& domain);  // matmul_q4a8.cc

}  // namespace aqua
