// Sparse prefill's choice in the prompt kernel (aqua_prompt.cc; the rule: ops/rules.py prefill_chosen, node
// attributes prefill_*): for a query block of kPrefillBlock slots, every stride-th row's top-k' coordinates of |q^|
// score the keys from the packed panels the walk reads, each row's softmax is summed per key block of
// kPrefillBlock, and the blocks are kept in order of their mass until the threshold. The walk then skips the
// products of the blocks left out. Under prompt_bf16 the estimate's products are bfloat16 too, as the walk's: the
// choice of the reference on q^ and K^ rounded to bfloat16 (what the catalogue's bf16 cases compare with).

#pragma once

#include "prompt_tiles.h"

namespace aqua {
namespace prompt {

// The keys one sampled row of one head sees: [lo, hi].
struct EstimateRow {
  int64_t lo, hi;
};

// A row's softmax over one key block of kPrefillBlock, kept as l = sum e^(s - m) over the keys the row sees with
// the row's shift m at the time (m = -inf, l = 0: nothing seen yet): the blocks' shares of the row's mass follow
// from all of them (choose_blocks), so no [L] row of scores is kept.
struct BlockSum {
  float m, l;
};

// One row's scores sc[0..kKeys) over the packed block at s0 (soft-capped, + kmask[j] when given: -inf at padding;
// -inf outside [row.lo, row.hi]) -> out[0..2), the two key blocks' BlockSums. sc is overwritten. shift: the row's
// running shift, moved to a block's maximum only when a score passes it by kShiftSlack (or it is -inf), as the
// walk's softmax does: one vector compare a block, not a reduction across lanes. The e^ by exp_lanes' degree-4
// polynomial (2.9e-6 relative: a choice of blocks by their share of the mass reads no finer).
inline void block_sums(float* sc, const EstimateRow& row, int64_t s0, const float* kmask, float softcap,
                       BlockSum* out, float& shift) {
  static_assert(kKeys == 2 * kPrefillBlock, "two key blocks a packed block");
  if (softcap > 0.0f) {
    for (int64_t x = 0; x < kKeys; ++x) sc[x] = std::tanh(sc[x] / softcap) * softcap;
  }
  if (kmask != nullptr) {
    for (int64_t x = 0; x < kKeys; ++x) sc[x] += kmask[s0 + x];
  }
  if (s0 < row.lo || s0 + kKeys - 1 > row.hi) {  // a block the row sees part of
    for (int64_t x = 0; x < kKeys; ++x) sc[x] = s0 + x < row.lo || s0 + x > row.hi ? -INFINITY : sc[x];
  }
  constexpr int kPanels = kPrefillBlock / kNR;  // a key block's panels of 16 scores
  for (int h = 0; h < 2; ++h) {
    const float* v = sc + h * kPrefillBlock;
    simd::vf x[kPanels][kPV], top[kPV];
    for (int u = 0; u < kPV; ++u) top[u] = simd::splat(-INFINITY);
    for (int q = 0; q < kPanels; ++q) {
      for (int u = 0; u < kPV; ++u) {
        x[q][u] = simd::load(v + q * kNR + u * simd::kLanes);
        top[u] = simd::max(x[q][u], top[u]);
      }
    }
    if (simd::any_gt_panel(top, shift + kShiftSlack)) shift = simd::fold_max(top);
    if (shift == -INFINITY) {
      out[h] = {shift, 0.0f};
      continue;
    }
    const simd::vf at = simd::splat(shift);
    simd::vf e[kPV];  // the four panels' e^ summed lane by lane, as (0 + 1) + (2 + 3)
    for (int u = 0; u < kPV; ++u) {
      e[u] = (simd::exp<true>(x[0][u] - at) + simd::exp<true>(x[1][u] - at)) +
             (simd::exp<true>(x[2][u] - at) + simd::exp<true>(x[3][u] - at));
    }
    out[h] = {shift, simd::fold_sum(e)};
  }
}

// The rows' BlockSums: q [rows_pad][r] (the sampled rows' q^, zero outside each row's k' coordinates) ->
// sums[i * nb + kb] for each key block kb of [lo, hi] of row i (others not written). A packed block's scores for
// all rows as one matrix product over the panels the walk reads (its micro-kernel: 16 multiply-adds a 2 loads, where
// gathering a row's k' coordinates ran one load a multiply-add; the zeros add nothing, so each score is the sum
// over the row's k' coordinates in increasing order), then each row's two BlockSums from an L1 tile.
template <typename Job>
void estimate_rows(const Job& j, int64_t bh, const float* q, int64_t rows_pad, const std::vector<EstimateRow>& rows,
                   const float* kmask, BlockSum* sums, int64_t nb) {
  static thread_local std::vector<float> sc;
  static thread_local std::vector<uint16_t> q16;
  static thread_local std::vector<float> shift;
  sc.resize(static_cast<size_t>(rows_pad * kKeys));
  shift.assign(rows.size(), -INFINITY);
  const float* panels = j.packed + bh * j.key_blocks * j.block_floats();
  const uint16_t* halves = j.packed16 != nullptr ? j.packed16 + bh * j.key_blocks * j.block_halves() : nullptr;
  const int64_t r = j.r, r2 = j.r2();
  if (halves != nullptr) {
    q16.resize(static_cast<size_t>(rows_pad * r2));
    to_bf16_rows(q, r, rows_pad, r, q16.data(), r2);
  }
  int64_t a = INT64_MAX, b = 0;
  for (const EstimateRow& row : rows) a = std::min(a, row.lo), b = std::max(b, row.hi + 1);
  for (int64_t s0 = a / kKeys * kKeys; s0 < b; s0 += kKeys) {
    if (halves != nullptr) {
      gemm_bf16<false>(q16.data(), r2, halves + (s0 / kKeys) * j.block_halves(), r2 / 2, sc.data(), kKeys, rows_pad,
                       kKeys);
    } else {
      gemm<false>(q, r, panels + (s0 / kKeys) * j.block_floats(), r, sc.data(), kKeys, rows_pad, kKeys);
    }
    const int64_t kb = s0 / kPrefillBlock;
    for (size_t i = 0; i < rows.size(); ++i) {
      const EstimateRow& row = rows[i];
      if (s0 + kKeys <= row.lo || s0 > row.hi) continue;
      BlockSum two[2];
      block_sums(sc.data() + static_cast<int64_t>(i) * kKeys, row, s0, kmask, j.softcap, two, shift[i]);
      BlockSum* out = sums + static_cast<int64_t>(i) * nb;
      out[kb] = two[0];
      if (kb + 1 < nb) out[kb + 1] = two[1];
    }
  }
}

// Sparse prefill's choice for the task's query block (ops/rules.py prefill_chosen): kept[0..ceil(L / 64)) the key
// blocks its rows attend, from the task's q^ rows qhat [nt g][rp] (aqua_prompt.cc project_rows). Returns false when
// the block is dense (not wholly inside the call and before its last kPrefillTail rows, or no row sampled): then
// kept is not read.
template <typename Job>
bool choose_blocks(const Job& j, int64_t bh, int64_t t0, int64_t nt, const float* qhat, std::vector<uint8_t>& kept) {
  const int64_t first = j.mask.len - j.t, p0 = first + t0, len = j.mask.len, b = bh / j.heads;
  if (p0 % kPrefillBlock != 0 || nt != kPrefillBlock || p0 + kPrefillBlock > len - kPrefillTail) return false;
  const int64_t nb = (len + kPrefillBlock - 1) / kPrefillBlock, g = j.g, r = j.r;
  static thread_local std::vector<float> row, est_q, kmask;
  static thread_local std::vector<int64_t> idx, order;
  static thread_local std::vector<double> mass;
  static thread_local std::vector<EstimateRow> est;
  static thread_local std::vector<BlockSum> sums;
  const int64_t end = p0 + kPrefillBlock;  // the block's rows see no key at or past its end
  row.resize(static_cast<size_t>(g * r));
  idx.resize(static_cast<size_t>(g * r));
  // the sampled rows' q^, every row zero outside its k' coordinates: at most ceil(nt / stride) tokens' g rows
  est_q.assign(static_cast<size_t>(round_up((nt / j.prefill.stride + 1) * g, kMR) * r), 0.0f);
  est.clear();
  mass.assign(static_cast<size_t>(nb), 0.0);
  const int64_t* am = j.mask.am + (j.mask.rows == 1 ? 0 : b) * len;
  const bool padded = j.first_pad[j.mask.rows == 1 ? 0 : b] < end;  // kmask: 0 at a real key, -inf at padding,
  if (padded) {                                                       // over the packed blocks the rows reach
    kmask.assign(static_cast<size_t>(round_up(end, kKeys)), 0.0f);
    for (int64_t i = 0; i < end; ++i) kmask[i] = am[i] != 0 ? 0.0f : -INFINITY;
  }
  int64_t sampled = 0, sink = len;
  for (int64_t t = t0; t < t0 + nt; ++t) {
    const int64_t p = first + t;
    if (p % j.prefill.stride != j.prefill.stride - 1 || am[p] == 0) continue;
    const Seen seen = j.mask.at(b, t);
    for (int64_t i = seen.lo; i <= seen.hi; ++i) {
      if (am[i] != 0) {
        sink = std::min(sink, i);
        break;
      }
    }
    float* q = row.data();
    for (int64_t h = 0; h < g; ++h) {
      const float* src = qhat + ((t - t0) * g + h) * j.rp();
      std::copy(src, src + r, q + h * r);
    }
    select_group(q, g, r, j.prefill.k, kPerHead, idx.data(), r);
    unweigh(j, bh % j.heads, q);
    for (int64_t h = 0; h < g; ++h) {
      float* dst = est_q.data() + (sampled * g + h) * r;
      for (int64_t c = 0; c < j.prefill.k; ++c) dst[idx[h * r + c]] = q[h * r + idx[h * r + c]];
      est.push_back({seen.lo, seen.hi});
    }
    ++sampled;
  }
  if (sampled == 0) return false;
  sums.resize(est.size() * static_cast<size_t>(nb));
  estimate_rows(j, bh, est_q.data(), round_up(sampled * g, kMR), est, padded ? kmask.data() : nullptr,
                sums.data(), nb);
  for (size_t i = 0; i < est.size(); ++i) {  // each row's blocks as shares of its mass: l e^(m - max m) / total
    BlockSum* s = sums.data() + i * nb;
    const int64_t k0 = est[i].lo / kPrefillBlock, k1 = est[i].hi / kPrefillBlock;
    float top = -INFINITY;
    for (int64_t kb = k0; kb <= k1; ++kb) top = std::max(top, s[kb].m);
    if (top == -INFINITY) continue;  // a row that sees no real key (not sampled: its own token is real)
    float total = 0.0f;
    for (int64_t kb = k0; kb <= k1; ++kb) {  // l now at the max (most blocks were summed at it already)
      if (s[kb].m != top) s[kb].l *= std::exp(s[kb].m - top);
      total += s[kb].l;
    }
    const float inv = 1.0f / total;
    for (int64_t kb = k0; kb <= k1; ++kb) mass[kb] += s[kb].l * inv;
  }
  const double count = static_cast<double>(sampled * g);
  for (double& x : mass) x /= count;
  kept.assign(static_cast<size_t>(nb), 0);
  double before = 0.0;
  for (int64_t kb : {std::min(p0, sink) / kPrefillBlock, std::max(p0, sink) / kPrefillBlock}) {
    if (kept[kb]) continue;  // the sink's block, then the diagonal: forced, in the order of their index
    kept[kb] = 1;
    before += mass[kb];
  }
  order.clear();
  for (int64_t kb = 0; kb < nb; ++kb) {
    if (!kept[kb]) order.push_back(kb);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return mass[x] > mass[y]; });
  const double bar = static_cast<double>(j.prefill.threshold) - 1e-6;
  for (int64_t kb : order) {
    if (before >= bar) break;
    kept[kb] = 1;
    before += mass[kb];
  }
  return true;
}

}  // namespace prompt
}  // namespace aqua
