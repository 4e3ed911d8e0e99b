// H2OAttention's per-row machinery (h2o_attention.cc holds the op, its contract and the eviction rule): a row
// (batch, kv head) takes its new tokens in turn, each one attended over the live slots in one blocked pass
// and then accounted (heavy update, eviction); decode with few rows splits a row's slots over tasks.
#pragma once

#include <atomic>

#include "aqua_ops.h"

namespace aqua::h2o {
constexpr int64_t kBlock = 256;       // positions per score block: the tile's scores stay in L1
constexpr int64_t kTasksWanted = 16;  // split a row's slots over tasks at decode when fewer rows exist

// max(1, ceil(ratio n)) with aqua_export/ops/rules.py budget's slack (a float32 ratio keeps what its double does)
inline int64_t budget(double ratio, int64_t n) {
  const double x = static_cast<double>(n);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio * x - 1e-6 * x - 1e-9)));
}

// The query rows j0..j0 + nr of a group: their weights dense over r (wbuf[c * kRows + rr], 0 where row rr did
// not select c) and the union of their selections; returns its size. q [g][r], idx [g][k].
inline int64_t tile_weights(const float* q, const int64_t* idx, int64_t r, int64_t k, int64_t j0, int nr,
                            float* wbuf, int32_t* uni) {
  static thread_local std::vector<char> mark;
  mark.assign(static_cast<size_t>(r), 0);
  std::fill(wbuf, wbuf + kRows * r, 0.0f);
  for (int rr = 0; rr < nr; ++rr) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t c = idx[(j0 + rr) * k + i];
      wbuf[c * kRows + rr] = q[(j0 + rr) * r + c];
      mark[c] = 1;
    }
  }
  return union_of(mark.data(), r, uni);
}

// One block of n slots for nr rows, x[rr * pitch + i] their scores -> e^(s - m'[rr]), free slots (on[i] = 0)
// exactly 0 whatever score they held (a select, not an added -inf: a stale inf stays out); the running max m
// and sum l of each row updated and its o [rv] rescaled (online softmax). The block has a live slot.
inline void block_softmax(int nr, float* x, int64_t pitch, const int32_t* on, int64_t n, float softcap, float* m,
                          float* l, float* o, int64_t rv) {
  for (int rr = 0; rr < nr; ++rr) {
    float* xr = x + rr * pitch;
    if (softcap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) xr[i] = std::tanh(xr[i] / softcap) * softcap;
    }
    float lane[kLanes];  // partial maxima: see kLanes
    std::fill(lane, lane + kLanes, -INFINITY);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int e = 0; e < kLanes; ++e) {
        xr[i + e] = on[i + e] ? xr[i + e] : -INFINITY;
        lane[e] = std::max(lane[e], xr[i + e]);
      }
    }
    for (; i < n; ++i) xr[i] = on[i] ? xr[i] : -INFINITY, lane[0] = std::max(lane[0], xr[i]);
    online_block(xr, n, *std::max_element(lane, lane + kLanes), m[rr], l[rr], o + rr * rv, rv);
  }
}

// heavy[i] += the group's summed softmax weights sum_h x[h][i] f[h][block of i] (x as block_softmax left it,
// f [g][blocks] = e^(bm - m) / l), and in the same pass, when pick: the live slot to free, the smallest (updated)
// heavy among the slots whose token is before position `recent` (outside the most recent real tokens kept),
// ties -> the later token; -1 if none. One pass: at decode the per-slot state is read once per step beside K^
// and V; the choice is branch-free (recent tokens sit in scattered slots once evictions began).
inline int64_t accumulate_and_pick(const float* x, const float* f, int64_t g, int64_t cap, int64_t blocks,
                                   float* heavy, const int64_t* token, int64_t hw, bool pick, int64_t recent) {
  int64_t best = -1, best_token = -1;
  float best_heavy = INFINITY;
  for (int64_t blk = 0; blk < blocks && blk * kBlock < hw; ++blk) {
    const int64_t i0 = blk * kBlock, i1 = std::min(hw, i0 + kBlock);
    for (int64_t h = 0; h < g; ++h) {
      const float w = f[h * blocks + blk];
      const float* xr = x + h * cap;
      if (w == 0.0f) continue;  // a row with nothing live in the block (or none at all): its weights are 0
      for (int64_t i = i0; i < i1; ++i) heavy[i] += xr[i] * w;
    }
    if (!pick) continue;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tk = token[i];
      const float hv = heavy[i];
      const bool better = tk >= 0 && tk < recent && (hv < best_heavy || (hv == best_heavy && tk > best_token));
      best = better ? i : best;
      best_heavy = better ? hv : best_heavy;
      best_token = better ? tk : best_token;
    }
  }
  return best;
}

// A row's (batch, kv head) slot bookkeeping while its tokens are taken in turn.
struct Row {
  int64_t n;          // real tokens before the current one
  int64_t live, hw;   // live slots; one past the last live one (-1: the row's state was refused)
  int64_t free_from;  // no free slot before this one
  bool real;          // the current token is real
};

template <typename T>
struct H2OJob {
  const T* q;
  const T* proj;  // P [Hkv, qw, r], or null: q is q^
  const T* key_new;
  const T* value_new;
  T* key;      // [B, Hkv, r, C]
  T* value;    // [B, Hkv, C, rv]
  float* heavy;
  int64_t* token;
  const int64_t* mask;  // [B, L]
  const int64_t* before;  // [B, L + 1]: real tokens at positions < p
  T* out;                 // [B, Hkv, g, T, rv]
  std::atomic<bool>* foreign;  // set by a task whose row holds a state this op cannot have left (row untouched)
  int64_t heads, g, t, qw, r, rv, k, rule, len, cap, blocks;  // blocks: of kBlock slots in cap
  double ratio;
  float softcap;
  // split decode (split_len blocks per task) keeps each row's state between its passes: Row, q [g][r],
  // idx [g][k], s [g][cap], f [g][blocks] per row, and per task and query row o [rv], m, l
  int64_t splits = 1, split_len = 0;
  Row* rows = nullptr;
  float *q_rows = nullptr, *s_rows = nullptr, *f_rows = nullptr, *part = nullptr;
  int64_t* idx_rows = nullptr;
};

// Row bh's state as this op leaves it (true), or not (false, nothing written): at most budget(n) live slots, all
// holding tokens before the new ones, which is what the slot search relies on.
template <typename T>
bool open_row(const H2OJob<T>& j, int64_t bh, Row& w) {
  const int64_t* token = j.token + bh * j.cap;
  const int64_t first = j.len - j.t;
  w.n = j.before[(bh / j.heads) * (j.len + 1) + first];
  int64_t ahead = 0;
  w.live = 0, w.hw = j.cap, w.free_from = 0;
  for (int64_t i = 0; i < j.cap; ++i) w.live += token[i] >= 0, ahead |= token[i] >= first;  // vectorised
  while (w.hw > 0 && token[w.hw - 1] < 0) --w.hw;
  while (w.free_from < j.cap && token[w.free_from] >= 0) ++w.free_from;
  return !ahead && w.live <= std::min(w.n, budget(j.ratio, w.n));
}

// Token tt of row bh: written to the first free slot when real; its g query rows loaded, or projected (q^ = q P),
// into q [g][r] and their selections made (idx [g][k]).
template <typename T>
void take_token(const H2OJob<T>& j, int64_t bh, int64_t tt, Row& w, float* q, int64_t* idx) {
  const int64_t cap = j.cap, r = j.r, rv = j.rv, pos = j.len - j.t + tt;
  int64_t* token = j.token + bh * cap;
  w.real = j.mask[(bh / j.heads) * j.len + pos] != 0;
  if (w.real) {
    while (token[w.free_from] >= 0) ++w.free_from;  // one exists: cap >= need
    const int64_t slot = w.free_from;
    const T* kn = j.key_new + (bh * j.t + tt) * r;
    const T* vn = j.value_new + (bh * j.t + tt) * rv;
    T* key = j.key + bh * r * cap;
    for (int64_t c = 0; c < r; ++c) key[c * cap + slot] = kn[c];
    std::copy(vn, vn + rv, j.value + (bh * cap + slot) * rv);
    token[slot] = pos, j.heavy[bh * cap + slot] = 0.0f, ++w.live, w.hw = std::max(w.hw, slot + 1);
  }
  for (int64_t h = 0; h < j.g; ++h) {
    const T* src = j.q + ((bh * j.g + h) * j.t + tt) * j.qw;
    if (j.proj == nullptr) {
      for (int64_t c = 0; c < r; ++c) q[h * r + c] = load(src, c);
    } else {
      project(src, j.proj + (bh % j.heads) * j.qw * r, j.qw, r, q + h * r);
    }
  }
  select_group(q, j.g, r, j.k, j.rule, idx);
}

// Query rows h0..h0 + nr of row bh's current token over the blocks [b0, b1) of its slots: the online-softmax
// state m, l, o [nr][rv] (o unnormalised) carried on; per block, e^(x - bm) into s [g][cap] and bm (the running
// max after it) into f [g][blocks] (-inf: no live slot). Per block K^[union of I, block] -> x (L1) -> softmax -> x V[block]:
// the block's scores are still in L1 when they meet V.
template <typename T>
void attend_blocks(const H2OJob<T>& j, int64_t bh, const Row& w, int64_t h0, int nr, const float* q,
                   const int64_t* idx, int64_t b0, int64_t b1, float* s, float* f, float* m, float* l, float* o) {
  const int64_t cap = j.cap, rv = j.rv;
  const T* key = j.key + bh * j.r * cap;
  const T* value = j.value + bh * cap * rv;
  const int64_t* token = j.token + bh * cap;
  alignas(64) static thread_local float wbuf[kRows * kMaxWidth];
  static thread_local int32_t uni[kMaxWidth];
  static thread_local int32_t on[kBlock];  // the block's live slots (1) and free ones (0)
  // the block's scores, in L1 from the key rows to the value product (accumulated straight into s, rows cap
  // apart, the step ran 5% slower); copied to s for the heavy update
  alignas(64) static thread_local float xb[kRows * kBlock];
  const int64_t nu = tile_weights(q, idx, j.r, j.k, h0, nr, wbuf, uni);
  for (int64_t blk = b0; blk < b1 && blk * kBlock < w.hw; ++blk) {
    const int64_t s0 = blk * kBlock, n = std::min(kBlock, w.hw - s0);
    int32_t any = 0;
    for (int64_t i = 0; i < n; ++i) on[i] = token[s0 + i] >= 0, any |= on[i];
    if (!any) {  // nothing live: no K^ or V read, weights 0
      for (int rr = 0; rr < nr; ++rr) f[(h0 + rr) * j.blocks + blk] = -INFINITY;
      continue;
    }
    accumulate_rows(nr, key + s0, cap, uni, nu, wbuf, n, xb, kBlock);
    block_softmax(nr, xb, kBlock, on, n, j.softcap, m, l, o, rv);
    add_values_rows(nr, xb, kBlock, value + s0 * rv, n, rv, rv, o, rv);
    for (int rr = 0; rr < nr; ++rr) {
      f[(h0 + rr) * j.blocks + blk] = m[rr];  // the max the block's e^(x - m) are relative to
      std::memcpy(s + (h0 + rr) * cap + s0, xb + rr * kBlock, sizeof(float) * n);
    }
  }
}

// Query row h of row bh's token tt, its softmax state (m, l, o) complete: out = o / l, and f[h] turned into
// the block scales of its weights, e^(bm - m) / l (0 for every block when nothing is live: zeros out).
template <typename T>
void finish_row(const H2OJob<T>& j, int64_t bh, int64_t tt, int64_t h, const Row& w, float m, float l, const float* o,
                float* f) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* fr = f + h * j.blocks;
  for (int64_t blk = 0; blk * kBlock < w.hw; ++blk) fr[blk] = inv > 0.0f ? std::exp(fr[blk] - m) * inv : 0.0f;
  T* dst = j.out + ((bh * j.g + h) * j.t + tt) * j.rv;
  for (int64_t c = 0; c < j.rv; ++c) store(dst, c, o[c] * inv);
}

// After a real token: heavy += its group's weights, and over the budget the chosen slot freed.
template <typename T>
void account(const H2OJob<T>& j, int64_t bh, Row& w, const float* s, const float* f) {
  if (!w.real) return;
  const int64_t* before = j.before + (bh / j.heads) * (j.len + 1);
  const int64_t n = ++w.n, keep = budget(j.ratio, n);
  // outside the keep / 2 most recent real tokens: positions before the first p with before[p] >= n - keep / 2
  const int64_t recent = std::lower_bound(before, before + j.len + 1, n - keep / 2) - before;
  int64_t* token = j.token + bh * j.cap;
  const int64_t v = accumulate_and_pick(s, f, j.g, j.cap, j.blocks, j.heavy + bh * j.cap, token, w.hw, w.live > keep,
                                        recent);
  if (v >= 0) token[v] = -1, --w.live, w.free_from = std::min(w.free_from, v);
}

// One row (batch, kv head), its new tokens in turn: the path of prefill, and of decode with rows enough.
template <typename T>
void h2o_task(void* data, size_t index) {
  const auto& j = *static_cast<const H2OJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(index), g = j.g, rv = j.rv;
  Row w;
  if (!open_row(j, bh, w)) {
    j.foreign->store(true);
    return;
  }
  static thread_local std::vector<float> q, o, s, f;  // scratch reused across tasks
  static thread_local std::vector<int64_t> idx;
  q.resize(static_cast<size_t>(g * j.r)), o.resize(static_cast<size_t>(kRows * rv));
  s.resize(static_cast<size_t>(g * j.cap)), f.resize(static_cast<size_t>(g * j.blocks));
  idx.resize(static_cast<size_t>(g * j.k));
  for (int64_t tt = 0; tt < j.t; ++tt) {
    take_token(j, bh, tt, w, q.data(), idx.data());
    for (int64_t h0 = 0; h0 < g; h0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, g - h0));
      float m[kRows], l[kRows];
      std::fill(m, m + kRows, -INFINITY), std::fill(l, l + kRows, 0.0f), std::fill(o.begin(), o.end(), 0.0f);
      attend_blocks(j, bh, w, h0, nr, q.data(), idx.data(), 0, j.blocks, s.data(), f.data(), m, l, o.data());
      for (int rr = 0; rr < nr; ++rr) finish_row(j, bh, tt, h0 + rr, w, m[rr], l[rr], o.data() + rr * rv, f.data());
    }
    account(j, bh, w, s.data(), f.data());
  }
}

// Decode with few rows (batch 1): each row's slots split over tasks as AquaAttention's positions are, in three
// passes: open + take the token per row | a split of the blocks per task -> part (o, m, l per query row) |
// per row, the splits merged (out = sum o_i e^(m_i - M) / sum l_i e^(m_i - M)), heavy and eviction.
template <typename T>
void split_open(void* data, size_t index) {
  const auto& j = *static_cast<const H2OJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(index);
  Row& w = j.rows[bh];
  if (!open_row(j, bh, w)) {
    j.foreign->store(true);
    w.hw = -1;
    return;
  }
  take_token(j, bh, 0, w, j.q_rows + bh * j.g * j.r, j.idx_rows + bh * j.g * j.k);
}

template <typename T>
void split_attend(void* data, size_t index) {
  const auto& j = *static_cast<const H2OJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(index) / j.splits, b0 = (static_cast<int64_t>(index) % j.splits) * j.split_len;
  const Row& w = j.rows[bh];
  if (w.hw < 0) return;
  for (int64_t h0 = 0; h0 < j.g; h0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, j.g - h0));
    float m[kRows], l[kRows];
    alignas(64) float o[kRows * kMaxWidth];
    std::fill(m, m + kRows, -INFINITY), std::fill(l, l + kRows, 0.0f), std::fill(o, o + nr * j.rv, 0.0f);
    attend_blocks(j, bh, w, h0, nr, j.q_rows + bh * j.g * j.r, j.idx_rows + bh * j.g * j.k, b0, b0 + j.split_len,
                  j.s_rows + bh * j.g * j.cap, j.f_rows + bh * j.g * j.blocks, m, l, o);
    for (int rr = 0; rr < nr; ++rr) {
      float* dst = j.part + (static_cast<int64_t>(index) * j.g + h0 + rr) * (j.rv + 2);
      std::copy(o + rr * j.rv, o + (rr + 1) * j.rv, dst);
      dst[j.rv] = m[rr], dst[j.rv + 1] = l[rr];
    }
  }
}

template <typename T>
void split_merge(void* data, size_t index) {
  const auto& j = *static_cast<const H2OJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(index), rv = j.rv;
  Row& w = j.rows[bh];
  if (w.hw < 0) return;
  float* f = j.f_rows + bh * j.g * j.blocks;
  float o[kMaxWidth];
  for (int64_t h = 0; h < j.g; ++h) {
    float m, l;  // split i of query row h at part + ((bh splits + i) g + h) (rv + 2)
    merge_splits(j.part + (bh * j.splits * j.g + h) * (rv + 2), j.g * (rv + 2), j.splits, rv, o, m, l);
    finish_row(j, bh, 0, h, w, m, l, o, f);
  }
  account(j, bh, w, j.s_rows + bh * j.g * j.cap, f);
}

}  // namespace aqua::h2o
