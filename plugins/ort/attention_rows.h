// What AquaAttention's dense pass (aqua_attention.cc) and its token-selection pass (aqua_tokens.cc) share: the
// query rows of a task and their selections, the online softmax of a block, and the output of a task's rows
// (written, or kept as a split's partial state and merged).
//
// Query rows are tiled token-major (all g heads of a token together): at decode a tile is the GQA group, or a
// part of it when g > kRows.
#pragma once

#include "aqua_ops.h"

namespace aqua {

constexpr int64_t kPos = 256;        // positions per block: the tile's scores stay in L1
constexpr int64_t kTasksWanted = 16; // split the positions when fewer (batch, kv head, tile) tasks exist
constexpr float kLowest = -3.40282347e38f;  // the mask entry of a hidden key (float32's lowest: ops/rules.py HIDDEN)

// The keys one query row sees (ops/rules.py visible): j in [lo, hi] whose attention_mask entry is not 0.
struct Seen {
  const int64_t* am;  // the row's attention_mask [L]
  int64_t lo, hi;     // hi: the query's own position; lo: after a sliding window, else 0

  bool operator()(int64_t j) const { return j >= lo && j <= hi && am[j] != 0; }
  // Whether any key of [s0, s0 + n) is seen.
  bool any(int64_t s0, int64_t n) const {
    for (int64_t j = std::max(s0, lo); j < std::min(s0 + n, hi + 1); ++j) {
      if (am[j] != 0) return true;
    }
    return false;
  }
  // out[0..n) = what the scores of keys s0..s0+n are added: 0 where seen, kLowest where not (the dense and token
  // passes' online softmax; written per block, never for the whole [T, L]). The window's ends bound the loop, so
  // its body is a select the compiler vectorises (a test of lo and hi per key was a tenth of an int8 dense pass).
  void block(int64_t s0, int64_t n, float* out) const {
    const auto [a, b] = span(s0, n);
    const int64_t* m = am + s0;
    std::fill(out, out + a, kLowest);
    for (int64_t i = a; i < b; ++i) out[i] = m[i] != 0 ? 0.0f : kLowest;
    std::fill(out + b, out + n, kLowest);
  }
  // x[0..n), the scores of keys s0..s0+n, with every key not seen set to -inf, in place (the prompt kernel's blocks
  // that some of their rows see only in part), by the same bounded select.
  void hide(int64_t s0, int64_t n, float* x) const {
    const auto [a, b] = span(s0, n);
    const int64_t* m = am + s0;
    std::fill(x, x + a, -INFINITY);
    for (int64_t i = a; i < b; ++i) x[i] = m[i] != 0 ? x[i] : -INFINITY;
    std::fill(x + b, x + n, -INFINITY);
  }
  // The part of [s0, s0 + n) inside [lo, hi], relative to s0: [a, b).
  std::pair<int64_t, int64_t> span(int64_t s0, int64_t n) const {
    const int64_t a = std::clamp<int64_t>(lo - s0, 0, n);
    return {a, std::clamp<int64_t>(hi + 1 - s0, a, n)};
  }
};

// A task's per-thread buffers (the dense pass's and the token attend pass's), reached through one call: the address
// of a thread_local array used in an inlined loop was recomputed (a __tls_get_addr call) on every iteration, as in
// the int8 pass's per-token scale loop.
struct TileScratch {
  alignas(64) float wbuf[kRows * kMaxWidth];
  alignas(64) float s[kRows * kPos];
  alignas(64) float o[kRows * kMaxWidth];
  alignas(64) float mask[kRows * kPos];  // each row's Seen::block
  alignas(64) float scale[kPos];
  int32_t uni[kMaxWidth];
};

__attribute__((noinline)) inline TileScratch& tile_scratch() {
  static thread_local TileScratch scratch;
  return scratch;
}

// A call's attention_mask [rows, L] (rows 1: shared by the batch) and the positions of its T query tokens, the last
// at L - 1; window > 0: a sliding window (the node's sliding_window).
struct MaskRows {
  const int64_t* am;
  int64_t rows, len, t, window;

  Seen at(int64_t b, int64_t tt) const {
    const int64_t p = len - t + tt;
    return {am + (rows == 1 ? 0 : b) * len, window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, p};
  }
};

// The query side of a task: q^ [B, Hkv, g, T, r], or q [B, Hkv, g, T, qw] with P [Hkv, qw, r] (q^ = q P).
template <typename T>
struct QueryRows {
  const T* q;
  const T* proj;  // null: q is q^
  int64_t heads, g, t, qw, r, k, rule;
  const float* prices = nullptr;  // [heads]: the pooled selection (aqua_ops.h PoolCut), or null
  const float* cut_value = nullptr;  // [B][T] each token's cut (pool_cut)
  const int64_t* cut_index = nullptr;
  // [heads][r] or null: the node scores K^'s rows divided by its key_weights w, so the rows' selected coordinates
  // are scaled by these 1 / w after the selection ranked them (q^ . (K^ / w) = (q^ / w) . K^)
  const float* unweight = nullptr;
};

// q^ [g][r] of kv head `kvh`, after its selection ranked it, as the scores take it: times unweight (if any).
template <typename T>
inline void unweigh(const QueryRows<T>& j, int64_t kvh, float* q) {
  if (j.unweight == nullptr) return;
  const float* u = j.unweight + kvh * j.r;
  for (int64_t h = 0; h < j.g; ++h) {
    for (int64_t c = 0; c < j.r; ++c) q[h * j.r + c] *= u[c];
  }
}

// The g query rows of (batch, kv head) `bh` at token tt as float q^ [g][r].
template <typename T>
void load_rows(const QueryRows<T>& j, int64_t bh, int64_t tt, float* q) {
  for (int64_t hh = 0; hh < j.g; ++hh) {
    const T* src = j.q + ((bh * j.g + hh) * j.t + tt) * j.qw;
    if (j.proj == nullptr) {
      for (int64_t c = 0; c < j.r; ++c) q[hh * j.r + c] = load(src, c);
    } else {
      project(src, j.proj + (bh % j.heads) * j.qw * j.r, j.qw, j.r, q + hh * j.r);
    }
  }
}

// Whether rows selecting k coordinates share them across the layer's heads (a pooled node; not the static rule).
template <typename T>
bool pooled(const QueryRows<T>& j, int64_t k) {
  return j.prices != nullptr && k < j.r && j.rule != kStatic;
}

// The cut of the pooled selection under k for token `at` = b T + tt (cut_value / cut_index [batch][T]): the K-th of
// the layer's Hkv g' r priced scores, K = Hkv g' k, ranked as PoolCut says.
template <typename T>
void pool_cut(const QueryRows<T>& j, int64_t at, int64_t k, float* value, int64_t* index) {
  static thread_local std::vector<float> q, priced;  // scratch reused across tokens: no allocation per token
  static thread_local std::vector<int64_t> order;
  const int64_t gp = j.rule == kGroup ? 1 : j.g, n = j.heads * gp * j.r, want = j.heads * gp * k;
  const int64_t b = at / j.t, tt = at % j.t;
  q.resize(static_cast<size_t>(j.g * j.r));
  priced.resize(static_cast<size_t>(n));
  order.resize(static_cast<size_t>(n));
  for (int64_t h = 0; h < j.heads; ++h) {
    load_rows(j, b * j.heads + h, tt, q.data());
    float* row = priced.data() + h * gp * j.r;
    row_scores(q.data(), j.g, j.r, j.rule, row);
    for (int64_t i = 0; i < gp * j.r; ++i) row[i] *= j.prices[h];
  }
  std::iota(order.begin(), order.end(), int64_t{0});
  const float* p = priced.data();
  std::nth_element(order.begin(), order.begin() + (want - 1), order.end(), [p](int64_t a, int64_t c) {
    return p[a] > p[c] || (p[a] == p[c] && a < c);
  });
  value[at] = p[order[want - 1]];
  index[at] = order[want - 1];
}

// What the cut tasks share (the kernel's ParallelFor: one task per token of the batch).
template <typename T>
struct PoolJob {
  QueryRows<T> rows;
  int64_t k;
  float* value;
  int64_t* index;
};

template <typename T>
void pool_cut_task(void* data, size_t task_index) {
  const auto& j = *static_cast<const PoolJob<T>*>(data);
  pool_cut(j.rows, static_cast<int64_t>(task_index), j.k, j.value, j.index);
}

// The rows of tile `tile` of (batch, kv head) `bh`, each keeping k of its r coordinates under the rule (k = r:
// all; a pooled node: what the token's cut keeps), laid out densely: wbuf[c][rr] = q^[rr][c] where row rr keeps c,
// else 0; uni[0..nu) the union of the coordinates kept, ascending; returns nu.
template <typename T>
int64_t tile_weights(const QueryRows<T>& j, int64_t k, int64_t bh, int64_t tile, int nr, float* wbuf, int32_t* uni) {
  static thread_local std::vector<float> q;  // scratch reused across tasks: no allocation per tile
  static thread_local std::vector<int64_t> idx;  // row h's kept coordinates at idx + h r
  static thread_local std::vector<int64_t> count;
  static thread_local std::vector<char> mark;
  q.resize(static_cast<size_t>(j.g * j.r));
  idx.resize(static_cast<size_t>(j.g * j.r));
  count.resize(static_cast<size_t>(j.g));
  mark.assign(static_cast<size_t>(j.r), 0);
  std::fill(wbuf, wbuf + kRows * j.r, 0.0f);
  const bool pool = pooled(j, k);
  int64_t loaded = -1;
  for (int rr = 0; rr < nr; ++rr) {
    const int64_t row = tile * kRows + rr, tt = row / j.g, h = row % j.g;
    if (tt != loaded) {
      load_rows(j, bh, tt, q.data());
      if (pool) {
        const int64_t at = (bh / j.heads) * j.t + tt, kvh = bh % j.heads;
        select_pooled(q.data(), j.g, j.r, j.rule, kvh, PoolCut{j.prices[kvh], j.cut_value[at], j.cut_index[at]},
                      idx.data(), count.data());
      } else {
        select_group(q.data(), j.g, j.r, k, j.rule, idx.data(), j.r);
        std::fill(count.begin(), count.end(), k);
      }
      unweigh(j, bh % j.heads, q.data());
      loaded = tt;
    }
    for (int64_t i = 0; i < count[h]; ++i) {
      const int64_t c = idx[h * j.r + i];
      wbuf[c * kRows + rr] = q[h * j.r + c];
      mark[c] = 1;
    }
  }
  return union_of(mark.data(), j.r, uni);
}

// The tile's scores s[rr][0..n) (rows kPos apart) soft-capped (softcap > 0) and squashed in place: s = tanh(s / c) c.
inline void soft_cap(int nr, int64_t n, float softcap, float* s) {
  if (softcap <= 0.0f) return;
  for (int rr = 0; rr < nr; ++rr) {
    for (int64_t i = 0; i < n; ++i) s[rr * kPos + i] = std::tanh(s[rr * kPos + i] / softcap) * softcap;
  }
}

// s[rr][0..n) (rows kPos apart) + mask row mrow[rr] -> e^(s - m') with the running max m and sum l of each row
// updated and o (rows kMaxWidth apart) rescaled.
inline void online_softmax(int nr, int64_t n, float softcap, const float* const* mrow, float* s, float* m, float* l,
                           float* o, int64_t r) {
  soft_cap(nr, n, softcap, s);
  for (int rr = 0; rr < nr; ++rr) {
    float* x = s + rr * kPos;
    const float* mk = mrow[rr];
    float lane[kLanes];
    std::fill(lane, lane + kLanes, -INFINITY);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int e = 0; e < kLanes; ++e) {
        x[i + e] += mk[i + e];
        lane[e] = std::max(lane[e], x[i + e]);
      }
    }
    for (; i < n; ++i) x[i] += mk[i], lane[0] = std::max(lane[0], x[i]);
    online_block(x, n, *std::max_element(lane, lane + kLanes), m[rr], l[rr], o + rr * kMaxWidth, r);
  }
}

// The output side of a job: out [B, Hkv, g, T, rv]; part [tasks, kRows, rv + 2] holds each split's o, m, l.
template <typename T>
struct RowsOut {
  T* out;
  float* part;
  int64_t rv, tiles, splits;
};

// The tile's rows done: normalised into out (one split) or kept as task `task`'s partial state (several).
template <typename T>
void finish_rows(const RowsOut<T>& j, const QueryRows<T>& q, int64_t task, int64_t bh, int64_t tile, int nr,
                 const float* o, const float* m, const float* l) {
  for (int rr = 0; rr < nr; ++rr) {
    const int64_t row = tile * kRows + rr, tt = row / q.g, h = row % q.g;
    if (j.splits == 1) {
      T* dst = j.out + ((bh * q.g + h) * q.t + tt) * j.rv;
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
      for (int64_t c = 0; c < j.rv; ++c) store(dst, c, o[rr * kMaxWidth + c] * inv);
    } else {
      float* dst = j.part + (task * kRows + rr) * (j.rv + 2);
      std::copy(o + rr * kMaxWidth, o + rr * kMaxWidth + j.rv, dst);
      dst[j.rv] = m[rr], dst[j.rv + 1] = l[rr];
    }
  }
}

// The splits of one (batch, kv head, tile) -- index -- merged into out: out = sum_i o_i e^(m_i - M) / sum_i
// l_i e^(m_i - M). Job: a RowsOut<T> and a QueryRows<T>.
template <typename T, typename Job>
void merge_task(void* data, size_t index) {
  const auto& j = *static_cast<const Job*>(data);
  const RowsOut<T>& w = j;
  const QueryRows<T>& q = j;
  const int64_t tile = static_cast<int64_t>(index) % w.tiles, bh = static_cast<int64_t>(index) / w.tiles;
  const int nr = static_cast<int>(std::min<int64_t>(kRows, q.g * q.t - tile * kRows));
  float acc[kMaxWidth];
  for (int rr = 0; rr < nr; ++rr) {
    float top, den;
    merge_splits(w.part + ((static_cast<int64_t>(index) * w.splits) * kRows + rr) * (w.rv + 2), kRows * (w.rv + 2),
                 w.splits, w.rv, acc, top, den);
    const int64_t row = tile * kRows + rr, tt = row / q.g, h = row % q.g;
    T* dst = w.out + ((bh * q.g + h) * q.t + tt) * w.rv;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int64_t c = 0; c < w.rv; ++c) store(dst, c, acc[c] * inv);
  }
}

// Token selection at a decode step (aqua_tokens.cc): the step's settings.
struct TokenRule {
  double ratio;  // share of the visible tokens attended (token_ratio), unless budget > 0
  int64_t budget, sink, window;
  bool on() const { return ratio < 1.0 || budget > 0; }
};

// One decode step (T = 1) of AquaAttention with token selection: pages scored with the selected coordinates,
// chosen (ops/rules.py select_pages), attended with all r. Inputs as AquaAttention's (aqua_tokens.cc).
template <typename T, typename C>
void attend_pages(Ort::KernelContext& ctx, const QueryRows<T>& q, const C* key, const C* value, const MaskRows& mask,
                  T* out, int64_t batch, int64_t rv, int64_t key_stride, int64_t value_slots, float softcap,
                  const TokenRule& rule);

// Sparse prefill (ops/rules.py prefill_chosen): the rows of a prompt's sparse query blocks attend the key blocks
// their estimate keeps. k: the estimate's coordinates (round(prefill_k_ratio r)).
struct PrefillRule {
  float threshold = 1.0f;  // prefill_threshold: 1 = a dense prompt
  int64_t stride = 1, k = 1;
  bool on() const { return threshold < 1.0f; }
};
constexpr int64_t kPrefillBlock = 64;  // ops/spec.py PREFILL_BLOCK
constexpr int64_t kPrefillTail = 128;  // ops/spec.py PREFILL_TAIL

// A prompt (T >= kPromptTokens) of AquaAttention: exact attention over blocks of queries and keys as small matrix
// products (aqua_prompt.cc), each row's q^ zeroed outside its selection.
constexpr int64_t kPromptTokens = 16;
// bf16 (attribute prompt_bf16, settings/precision.py): its two products in bfloat16 where the CPU has AVX512_BF16
// (prompt_bf16_runs), float32 elsewhere.
template <typename T, typename C>
void attend_prompt(Ort::KernelContext& ctx, const QueryRows<T>& q, const C* key, const C* value, const MaskRows& mask,
                   T* out, int64_t batch, int64_t rv, int64_t key_stride, int64_t value_slots, float softcap,
                   const PrefillRule& prefill, bool bf16);
// Whether this library and CPU run a prompt's products in bfloat16 (AVX512_BF16 in an AVX-512 variant).
bool prompt_bf16_runs();

}  // namespace aqua
