// AquaAttention over a prompt (T >= kPromptTokens new tokens): exact attention of the new tokens' query rows,
// each row's q^ zeroed outside the coordinates its selection keeps (all r under token selection), as blocked matrix
// products in the manner of flash attention: no [T, L] scores, no [T, L] mask.
//
//   tasks (batch, kv head, block of kQueryRows query rows: all g heads of consecutive tokens, so K^ and V are read
//   once for the GQA group), each walking the keys its rows see in blocks of kKeys:
//
//     K^[:, block] --packed in panels [kKeys / 16][r][16]--> S = Q K^  (Q [rows][r])   tiles of 8 x 32 / 6 x 16 scores
//     S --softcap, mask (attention_mask, causal, sliding window)--> online softmax: m, l, O rescaled, P = e^(S - m)
//     V[block] --packed in panels [rv / 16][kKeys][16]--> O += P V                     the same micro-kernel
//
//   then O / l into out. A block the mask hides from every row of the task (a causal prompt's later keys, a
//   window's earlier ones) is skipped. The panels are packed once per call, before the tasks (pack_task), which
//   converts a float16 or int8 cache (and pads a short last block with zeros): the 16 columns a micro-kernel reads
//   lie in one contiguous run (4 KB of K^,
//   8 KB of V) that stays in L1 while every row tile of the task passes over it. Rows of a plain [r][kKeys] tile
//   lie 512 bytes apart, which maps a column tile's lines onto an eighth of L1's sets, where the streamed query
//   rows evicted them.
//
// Sparse prefill (ops/rules.py prefill_chosen; node attributes prefill_*): tasks are then query blocks of
// kPrefillBlock slots, and choose_blocks (prefill_choice.h) estimates each sparse block's key-block masses from
// the packed panels (every stride-th row's top-k' coordinates) before the walk, which skips the products of the
// 64-key halves it leaves out.
//
// The micro-kernel keeps a tile of its output in vector registers (GCC vector extensions): 8 x 32 in 16 of AVX-512's
// zmm registers, 6 x 16 in 12 of AVX2's ymm ones (which hold it with the two B vectors and the broadcast A value),
// and runs the shared dimension through it, 16 (12) multiply-adds per 2 loads of B and 8 (6) broadcasts of A: the
// matrix-product shape that keeps the FMA units busy. Tasks are spread dynamically over ORT's thread pool (a
// causal prompt's later blocks cost more).

#include "prefill_choice.h"

namespace aqua {
namespace {

using namespace prompt;

constexpr int64_t kQueryRows = 192;    // query rows per task (all g heads of kQueryRows / g tokens, at least one)

template <typename T, typename C>
struct PromptJob : QueryRows<T> {
  const C* key;
  const C* value;
  MaskRows mask;
  T* out;
  int64_t rv, key_stride, value_slots, blocks;  // blocks: query blocks per (batch, kv head)
  int64_t tokens_per_block;
  float softcap;
  float* packed;        // [B * Hkv][key_blocks][K^ panels kKeys * r, then V panels kKeys * rvp]
  int64_t key_blocks;   // blocks of kKeys keys per (batch, kv head): ceil(L / kKeys)
  PrefillRule prefill;
  int64_t shift;        // positions of the first query block before the call's first row (sparse prefill's blocks
                        // start at multiples of kPrefillBlock slots), else 0
  uint16_t* packed16;   // bf16: the same panels' bfloat16 pairs [B * Hkv][key_blocks][K^ kKeys * r2, V kKeys * rvp]
  const int64_t* first_pad;  // [mask rows]: each attention_mask row's first 0 (padding), or L: sparse prefill's
  const float* proj_panels;  // float32 q with P: P [Hkv][qw][r] as panels [Hkv][rp / 16][qw][16] (zeros past r), else
                             // null (then each row is projected by load_rows)
  int64_t rp() const { return round_up(this->r, kNR); }
  int64_t rvp() const { return round_up(rv, kNR); }
  int64_t r2() const { return round_up(this->r, 2); }
  int64_t block_floats() const { return kKeys * (this->r + rvp()); }
  int64_t block_halves() const { return kKeys * (r2() + rvp()); }
};

// Pack task (batch, kv head, block of keys): K^[:, block] and V[block] as float32 panels (K^ [kKeys / 16][r][16],
// V [rvp / 16][kKeys][16]; an int8 cache times each token's scale, exact; a short last block padded with zeros),
// once per call. Every query task of the (batch, kv head) reads them: packed per task instead, a key was copied by
// every task of 64 tokens that sees it (~T / 128 on average in a causal prompt; perf at T 8000: a tenth of the
// kernel in the copies).
template <typename T, typename C>
void pack_task(void* data, size_t index) {
  const auto& j = *static_cast<const PromptJob<T, C>*>(data);
  const int64_t blk = static_cast<int64_t>(index) % j.key_blocks, bh = static_cast<int64_t>(index) / j.key_blocks;
  const int64_t b = bh / j.heads, s0 = blk * kKeys, r = j.r, rvp = j.rvp();
  // the keys the call's rows can see: [first row's lo, last row's hi] (a block before or after them is never read)
  if (s0 + kKeys <= j.mask.at(b, 0).lo / kKeys * kKeys || s0 > j.mask.at(b, j.t - 1).hi) return;
  const int64_t n = std::min(kKeys, j.mask.len - s0);
  constexpr int64_t extra = kScaleSlots<C>;  // an int8 cache: K^'s scale-code row, each V row's last element
  const int64_t vs = j.rv + extra;
  const C* key = j.key + bh * (r + extra) * j.key_stride;
  const C* value = j.value + bh * j.value_slots * vs;
  float* kp = j.packed + (bh * j.key_blocks + blk) * j.block_floats();
  float* vp = kp + kKeys * r;
  alignas(64) float scale[kKeys];
  alignas(64) float w[kMaxWidth > kKeys ? kMaxWidth : kKeys];
  if constexpr (extra > 0) scales_of(key + r * j.key_stride + s0, n, 1, scale);
  for (int64_t c = 0; c < r; ++c) {
    widen_row(key + c * j.key_stride + s0, n, w, kKeys, extra > 0 ? scale : nullptr);
    to_panels(w, kKeys, kp, r, c);
  }
  for (int64_t p = 0; p < kKeys; ++p) {
    const C* row = value + (s0 + std::min(p, n - 1)) * vs;
    widen_row(row, p < n ? j.rv : 0, w, rvp);
    if constexpr (extra > 0) {
      const float sv = int8_scale(row[j.rv]);
      for (int64_t c = 0; c < j.rv; ++c) w[c] *= sv;
    }
    to_panels(w, rvp, vp, kKeys, p);
  }
  if (j.packed16 != nullptr) {
    uint16_t* kb = j.packed16 + (bh * j.key_blocks + blk) * j.block_halves();
    pair_panels(kp, kKeys, r, kb);
    pair_panels(vp, rvp, kKeys, kb + kKeys * j.r2());
  }
}

// The task's tokens [t0, t0 + nt) as float q^ before any selection, token-major (row = token * g + head):
// qhat [nt g][rp] (rp = r rounded up to 16; columns past r are not read). Float32 q with P: one matrix product
// over the task's rows, P packed once per call (its float32 multiply-adds in the order project's take: the same
// q^), where one row at a time ran eight-lane FMAs over P from L1; otherwise load_rows a token at a time.
template <typename T, typename C>
void project_rows(const PromptJob<T, C>& j, int64_t bh, int64_t t0, int64_t nt, std::vector<float>& qhat) {
  const int64_t g = j.g, rows = nt * g, rp = j.rp();
  if constexpr (std::is_same_v<T, float>) {
    if (j.proj_panels != nullptr) {
      static thread_local std::vector<float> x;
      const int64_t qw = j.qw, rows_pad = round_up(rows, kMR);
      x.resize(static_cast<size_t>(rows_pad * qw));
      std::fill(x.begin() + rows * qw, x.end(), 0.0f);
      for (int64_t h = 0; h < g; ++h) {
        const float* src = j.q + ((bh * g + h) * j.t + t0) * qw;
        for (int64_t t = 0; t < nt; ++t) std::copy(src + t * qw, src + (t + 1) * qw, x.data() + (t * g + h) * qw);
      }
      qhat.resize(static_cast<size_t>(rows_pad * rp));
      gemm<false>(x.data(), qw, j.proj_panels + (bh % j.heads) * qw * rp, qw, qhat.data(), rp, rows_pad, rp);
      return;
    }
  }
  static thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(g * j.r));
  qhat.resize(static_cast<size_t>(rows * rp));
  for (int64_t t = 0; t < nt; ++t) {
    load_rows(j, bh, t0 + t, row.data());
    for (int64_t h = 0; h < g; ++h) std::copy(row.begin() + h * j.r, row.begin() + (h + 1) * j.r,
                                              qhat.begin() + (t * g + h) * rp);
  }
}

// The task's query rows from qhat (project_rows) as the scores take them: each row's unselected coordinates zero
// and its kept ones times unweight, q [rows_pad][r]; rows beyond the task's are zero.
template <typename T>
void query_block(const QueryRows<T>& j, int64_t bh, int64_t t0, int64_t nt, const float* qhat, int64_t rp, float* q,
                 int64_t rows_pad) {
  static thread_local std::vector<float> rows;
  static thread_local std::vector<int64_t> idx, count;
  rows.resize(static_cast<size_t>(j.g * j.r));
  idx.resize(static_cast<size_t>(j.g * j.r));
  count.resize(static_cast<size_t>(j.g));
  std::fill(q, q + rows_pad * j.r, 0.0f);
  const bool pool = pooled(j, j.k);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t tt = t0 + t;
    for (int64_t h = 0; h < j.g; ++h) {
      const float* src = qhat + (t * j.g + h) * rp;
      std::copy(src, src + j.r, rows.begin() + h * j.r);
    }
    float* dst = q + t * j.g * j.r;
    const int64_t kvh = bh % j.heads;
    if (j.k == j.r) {
      unweigh(j, kvh, rows.data());
      std::copy(rows.begin(), rows.end(), dst);
      continue;
    }
    if (pool) {
      const int64_t at = (bh / j.heads) * j.t + tt;
      select_pooled(rows.data(), j.g, j.r, j.rule, kvh, PoolCut{j.prices[kvh], j.cut_value[at], j.cut_index[at]},
                    idx.data(), count.data());
    } else {
      select_group(rows.data(), j.g, j.r, j.k, j.rule, idx.data(), j.r);
      std::fill(count.begin(), count.end(), j.k);
    }
    unweigh(j, kvh, rows.data());
    for (int64_t h = 0; h < j.g; ++h) {
      for (int64_t i = 0; i < count[h]; ++i) {
        const int64_t c = idx[h * j.r + i];
        dst[h * j.r + c] = rows[h * j.r + c];
      }
    }
  }
}

template <typename T, typename C>
void prompt_task(void* data, size_t index) {
  const auto& j = *static_cast<const PromptJob<T, C>*>(data);
  const int64_t blk = static_cast<int64_t>(index) % j.blocks, bh = static_cast<int64_t>(index) / j.blocks;
  const int64_t t0 = std::max<int64_t>(0, blk * j.tokens_per_block - j.shift);
  const int64_t nt = std::min(j.t, (blk + 1) * j.tokens_per_block - j.shift) - t0;
  const int64_t rows = nt * j.g, rows_pad = round_up(rows, kMR), rvp = j.rvp(), r = j.r;
  static thread_local std::vector<float> qbuf, sbuf, obuf, mbuf, lbuf, qhat;
  static thread_local std::vector<uint16_t> q16, p16;
  const bool bf16 = j.packed16 != nullptr;
  qbuf.resize(static_cast<size_t>(rows_pad * r));
  sbuf.resize(static_cast<size_t>(rows_pad * kKeys));
  obuf.assign(static_cast<size_t>(rows_pad * rvp), 0.0f);
  mbuf.assign(static_cast<size_t>(rows_pad), -INFINITY);
  lbuf.assign(static_cast<size_t>(rows_pad * kNR), 0.0f);
  float *q = qbuf.data(), *s = sbuf.data(), *o = obuf.data();
  project_rows(j, bh, t0, nt, qhat);
  query_block(j, bh, t0, nt, qhat.data(), j.rp(), q, rows_pad);
  const int64_t r2 = j.r2();
  if (bf16) {
    q16.resize(static_cast<size_t>(rows_pad * r2));
    p16.resize(static_cast<size_t>(rows_pad * kKeys));
    std::fill(p16.begin() + rows * kKeys, p16.end(), static_cast<uint16_t>(0));  // the padding rows' P: 0
    to_bf16_rows(q, r, rows_pad, r, q16.data(), r2);
  }
  const uint16_t* packed16 = bf16 ? j.packed16 + bh * j.key_blocks * j.block_halves() : nullptr;
  const int64_t b = bh / j.heads;
  const Seen first = j.mask.at(b, t0), last = j.mask.at(b, t0 + nt - 1);
  // the keys any row sees lie in [first.lo, last.hi]; every row sees all of [last.lo, first.hi] that is not padding
  const int64_t k_begin = first.lo / kKeys * kKeys, k_end = last.hi + 1;
  const float* packed = j.packed + bh * j.key_blocks * j.block_floats();
  static thread_local std::vector<uint8_t> kept;
  const bool sparse = j.prefill.on() && choose_blocks(j, bh, t0, nt, qhat.data(), kept);
  for (int64_t s0 = k_begin; s0 < k_end; s0 += kKeys) {
    int64_t n = std::min(kKeys, k_end - s0), off = 0, width = kKeys;
    if (sparse) {  // the halves of this block of kKeys keys that sparse prefill keeps (kKeys = 2 kPrefillBlock)
      const bool lo = kept[s0 / kPrefillBlock], hi = n > kPrefillBlock && kept[s0 / kPrefillBlock + 1];
      if (!lo && !hi) continue;
      if (lo != hi) {
        off = lo ? 0 : kPrefillBlock;
        n = lo ? std::min(n, kPrefillBlock) : n - kPrefillBlock;
        width = kPrefillBlock;
      }
    }
    const int64_t k0 = s0 + off;
    if (!last.any(k0, n) && !first.any(k0, n)) {
      bool any = false;
      for (int64_t t = 1; t + 1 < nt && !any; ++t) any = j.mask.at(b, t0 + t).any(k0, n);
      if (!any) continue;
    }
    const float* kp = packed + (s0 / kKeys) * j.block_floats();
    const float* vp = kp + kKeys * r;
    const uint16_t* kb = bf16 ? packed16 + (s0 / kKeys) * j.block_halves() : nullptr;
    if (bf16) {
      gemm_bf16<false>(q16.data(), r2, kb + off * r2, r2 / 2, s, kKeys, rows_pad, width);
    } else {
      gemm<false>(q, r, kp + off * r, r, s, kKeys, rows_pad, width);
    }
    bool whole = k0 >= last.lo && k0 + n - 1 <= first.hi;  // every row sees every key of the block but padding
    for (int64_t i = k0; i < k0 + n && whole; ++i) whole = first.am[i] != 0;
    for (int64_t row = 0; row < rows && (j.softcap > 0.0f || !whole); ++row) {  // the softmax reads scores as given
      float* sr = s + row * kKeys;
      if (j.softcap > 0.0f) {
        for (int64_t i = 0; i < n; ++i) sr[i] = std::tanh(sr[i] / j.softcap) * j.softcap;
      }
      if (!whole) j.mask.at(b, t0 + row / j.g).hide(k0, n, sr);
    }
    if (bf16) {
      softmax_block<true>(s, rows, n, width, mbuf.data(), lbuf.data(), o, rvp, p16.data());
      gemm_bf16<true>(p16.data(), kKeys, kb + kKeys * r2 + off * kNR, width / 2, o, rvp, rows_pad, rvp, kKeys * kNR);
    } else {
      softmax_block<false>(s, rows, n, width, mbuf.data(), lbuf.data(), o, rvp, nullptr);
      gemm<true>(s, kKeys, vp + off * kNR, width, o, rvp, rows_pad, rvp, kKeys * kNR);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t tt = t0 + row / j.g, h = row % j.g;
    T* dst = j.out + ((bh * j.g + h) * j.t + tt) * j.rv;
    const float sum = simd::sum_panel(lbuf.data() + row * kNR);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that saw no key: zeros
    for (int64_t c = 0; c < j.rv; ++c) store(dst, c, o[row * rvp + c] * inv);
  }
}

}  // namespace

template <typename T, typename C>
void attend_prompt(Ort::KernelContext& ctx, const QueryRows<T>& q, const C* key, const C* value, const MaskRows& mask,
                   T* out, int64_t batch, int64_t rv, int64_t key_stride, int64_t value_slots, float softcap,
                   const PrefillRule& prefill, bool bf16) {
  // sparse prefill: one task per query block of kPrefillBlock slots (the first and last may hold fewer rows)
  const int64_t per = prefill.on() ? kPrefillBlock : std::max<int64_t>(1, kQueryRows / q.g);
  const int64_t shift = prefill.on() ? (mask.len - q.t) % kPrefillBlock : 0, blocks = (q.t + shift + per - 1) / per;
  const int64_t key_blocks = (mask.len + kKeys - 1) / kKeys, bh = batch * q.heads;
  std::vector<int64_t> first_pad(static_cast<size_t>(mask.rows), mask.len);
  for (int64_t b = 0; b < mask.rows && prefill.on(); ++b) {
    const int64_t* am = mask.am + b * mask.len;
    first_pad[b] = std::find(am, am + mask.len, int64_t{0}) - am;
  }
  PromptJob<T, C> job{q, key, value, mask, out, rv, key_stride, value_slots, blocks, per, softcap, nullptr,
                      key_blocks, prefill, shift, nullptr, first_pad.data(), nullptr};
  if constexpr (std::is_same_v<T, float>) {
    if (q.proj != nullptr) {  // P [Hkv][qw][r] -> panels [Hkv][rp / 16][qw][16], zeros past r
      const int64_t rp = job.rp();
      auto& panels = call_buffer<float, Buffer::kPromptProjection>(static_cast<size_t>(q.heads * q.qw * rp));
      std::vector<float> w(static_cast<size_t>(rp), 0.0f);
      for (int64_t h = 0; h < q.heads; ++h) {
        for (int64_t i = 0; i < q.qw; ++i) {
          std::copy(q.proj + (h * q.qw + i) * q.r, q.proj + (h * q.qw + i + 1) * q.r, w.begin());
          to_panels(w.data(), rp, panels.data() + h * q.qw * rp, q.qw, i);
        }
      }
      job.proj_panels = panels.data();
    }
  }
  auto& packed = call_buffer<float, Buffer::kPromptPanels>(static_cast<size_t>(bh * key_blocks * job.block_floats()));
  job.packed = packed.data();
  if (bf16 && kBf16Build) {
    auto& halves = call_buffer<uint16_t, Buffer::kPromptPanels16>(static_cast<size_t>(bh * key_blocks *
                                                                                       job.block_halves()));
    job.packed16 = halves.data();
  }
  const size_t packs = static_cast<size_t>(bh * key_blocks), tasks = static_cast<size_t>(bh * blocks);
  ctx.ParallelFor(&pack_task<T, C>, packs, 0, &job);
  ctx.ParallelFor(&prompt_task<T, C>, tasks, tasks, &job);  // a batch per task: scheduled as threads free up
}

template void attend_prompt<float, float>(Ort::KernelContext&, const QueryRows<float>&, const float*, const float*,
                                          const MaskRows&, float*, int64_t, int64_t, int64_t, int64_t, float,
                                          const PrefillRule&, bool);
template void attend_prompt<Ort::Float16_t, Ort::Float16_t>(Ort::KernelContext&, const QueryRows<Ort::Float16_t>&,
                                                            const Ort::Float16_t*, const Ort::Float16_t*,
                                                            const MaskRows&, Ort::Float16_t*, int64_t, int64_t,
                                                            int64_t, int64_t, float, const PrefillRule&, bool);
template void attend_prompt<float, Ort::Float16_t>(Ort::KernelContext&, const QueryRows<float>&,
                                                   const Ort::Float16_t*, const Ort::Float16_t*, const MaskRows&,
                                                   float*, int64_t, int64_t, int64_t, int64_t, float,
                                                   const PrefillRule&, bool);
template void attend_prompt<float, int8_t>(Ort::KernelContext&, const QueryRows<float>&, const int8_t*, const int8_t*,
                                           const MaskRows&, float*, int64_t, int64_t, int64_t, int64_t, float,
                                          const PrefillRule&, bool);

bool prompt_bf16_runs() { return simd::bf16_runs(); }

}  // namespace aqua
