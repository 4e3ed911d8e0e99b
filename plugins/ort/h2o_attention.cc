// H2OAttention: one layer's AQUA-H2O attention with the eviction inside (contract: aqua_export/contract.py,
// the rule: aqua_export/attention.py h2o_keep).
//
//   query_hat    [B, Hkv, g, T, r]   q^ of the new tokens, attention scale folded in
//   key_new      [B, Hkv, T, r]      k^ of the new tokens
//   value_new    [B, Hkv, T, rv]     v of the new tokens (rv: V's width, r unless K^ and V are cut apart)
//   past_key     [B, Hkv, C, r]      slots of K^, memory dim-major [B, Hkv, r, C]
//   past_value   [B, Hkv, C, rv]
//   past_heavy   [B, Hkv, C] f32     accumulated attention of each slot (the heavy-hitter statistic)
//   past_token   [B, Hkv, C] i64     which token (0-based, padding counted) a slot holds; -1: free
//   attention_mask [B, L] i64        every token so far, the T new ones last (0 = padding)
//     -> out [B, Hkv, g, T, rv], present_key / _value / _heavy / _token of C' = max(C, need) slots
//   attributes: k, rule, softcap (as AquaAttention), ratio (share of a sequence's real tokens kept)
//
// Fixed-capacity slots updated in place: when present is bound to past's memory (a shared buffer) nothing
// is copied; a new token takes the first free slot and an evicted token frees its slot. Per (batch, kv head),
// the new tokens are taken one at a time, which is what makes a T-token prefill evict exactly as T one-token
// forwards do:
//
//   real token? write k^, v to the first free slot s; token[s] = position, heavy[s] = 0
//   scores over the live slots (selection, softcap), softmax, out = w @ V        (w: [g, live slots])
//       one pass by blocks of kBlock slots, online softmax as AquaAttention's: per block K^[union of I, block]
//       -> x (L1) -> m, l, o rescaled -> o += e^(x - m_block) V[block], e^(x - m_block) kept in s [g, slots];
//       then w = s e^(m_block - m) / l
//   real token? heavy += sum over the group of w; n += 1; budget = max(1, ceil(ratio * n))
//               live > budget: free the slot with the smallest heavy among those outside the floor(budget / 2)
//               most recent real tokens (ties: the later token goes)
//
// Live slots never exceed budget + 1, so at most one slot is freed per token and
// need = max over rows of min(n, budget(n) + 1) with n the row's real tokens (aqua_export/h2o.py slots_needed).
// A query that sees no live slot (a padding token before any real one) outputs zeros.

#include "aqua_ops.h"

namespace {

using namespace aqua;

constexpr int64_t kBlock = 256;  // positions per score block: the tile's scores stay in L1

// max(1, ceil(ratio n)) with aqua_export/h2o.py budget's slack (a float32 ratio keeps what its double does)
int64_t budget(double ratio, int64_t n) {
  const double x = static_cast<double>(n);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio * x - 1e-6 * x - 1e-9)));
}

template <typename T>
struct H2OJob {
  const T* q;
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
  int64_t heads, g, t, r, rv, k, rule, len, cap;
  double ratio;
  float softcap;
};

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

// One block of n slots for nr rows, x[rr * pitch + i] their scores -> e^(s - bm[rr]), free slots (on[i] = 0)
// exactly 0 whatever score they held (a select, not an added -inf: a stale inf stays out); the running max m
// and sum l of each row updated and its o [rv] rescaled (online softmax). The block has a live slot.
inline void block_softmax(int nr, float* x, int64_t pitch, const int32_t* on, int64_t n, float softcap, float* m,
                          float* l, float* o, int64_t rv, float* bm) {
  for (int rr = 0; rr < nr; ++rr) {
    float* xr = x + rr * pitch;
    if (softcap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) xr[i] = std::tanh(xr[i] / softcap) * softcap;
    }
    float lane[kLanes];  // partial maxima: see exp_sum
    std::fill(lane, lane + kLanes, -INFINITY);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int e = 0; e < kLanes; ++e) {
        xr[i + e] = on[i + e] ? xr[i + e] : -INFINITY;
        lane[e] = std::max(lane[e], xr[i + e]);
      }
    }
    for (; i < n; ++i) xr[i] = on[i] ? xr[i] : -INFINITY, lane[0] = std::max(lane[0], xr[i]);
    const float m_new = std::max(m[rr], *std::max_element(lane, lane + kLanes));
    const float alpha = std::exp(m[rr] - m_new);  // 0 while nothing was live (m = -inf, o and l 0)
    if (alpha != 1.0f) {
      for (int64_t c = 0; c < rv; ++c) o[rr * rv + c] *= alpha;
    }
    l[rr] = l[rr] * alpha + exp_sum(xr, n, m_new);
    m[rr] = bm[rr] = m_new;
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

// The g rows of token tt over slots [0, hw): out (normalised), and in s [g][cap] / f [g][blocks] what
// accumulate_and_pick turns into the softmax weights. One pass over K^ and V by blocks of kBlock slots per tile
// of up to kRows rows (at decode, the GQA group): the block's scores are still in L1 when they meet V.
template <typename T>
void attend_token(const H2OJob<T>& j, int64_t bh, int64_t tt, const T* key, const T* value, const int64_t* token,
                  int64_t hw, const float* q, const int64_t* idx, float* s, float* f, float* o) {
  const int64_t g = j.g, cap = j.cap, rv = j.rv, blocks = (cap + kBlock - 1) / kBlock;
  alignas(64) static thread_local float wbuf[kRows * kMaxWidth];
  static thread_local int32_t uni[kMaxWidth];
  static thread_local int32_t on[kBlock];  // the block's live slots (1) and free ones (0)
  // the tile's block of scores, in L1 from the key rows to the value product (accumulated straight into s,
  // rows cap apart, the step ran 5% slower); copied to s for the heavy update
  alignas(64) static thread_local float xb[kRows * kBlock];
  std::fill(o, o + g * rv, 0.0f);
  for (int64_t h0 = 0; h0 < g; h0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, g - h0));
    const int64_t nu = tile_weights(q, idx, j.r, j.k, h0, nr, wbuf, uni);
    float m[kRows], l[kRows], bm[kRows];
    std::fill(m, m + kRows, -INFINITY), std::fill(l, l + kRows, 0.0f);
    float* ot = o + h0 * rv;
    for (int64_t blk = 0; blk * kBlock < hw; ++blk) {
      const int64_t s0 = blk * kBlock, n = std::min(kBlock, hw - s0);
      int32_t any = 0;
      for (int64_t i = 0; i < n; ++i) on[i] = token[s0 + i] >= 0, any |= on[i];
      if (!any) {  // nothing live: no K^ or V read, weights 0
        for (int rr = 0; rr < nr; ++rr) f[(h0 + rr) * blocks + blk] = -INFINITY;
        continue;
      }
      accumulate_rows(nr, key + s0, cap, uni, nu, wbuf, n, xb, kBlock);
      block_softmax(nr, xb, kBlock, on, n, j.softcap, m, l, ot, rv, bm);
      for (int rr = 0; rr < nr; ++rr) f[(h0 + rr) * blocks + blk] = bm[rr];
      add_values_rows(nr, xb, kBlock, value + s0 * rv, n, rv, ot, rv);
      for (int rr = 0; rr < nr; ++rr) std::memcpy(s + (h0 + rr) * cap + s0, xb + rr * kBlock, sizeof(float) * n);
    }
    for (int rr = 0; rr < nr; ++rr) {
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;  // 0: no live slot, the row outputs zeros
      float* fr = f + (h0 + rr) * blocks;
      for (int64_t blk = 0; blk * kBlock < hw; ++blk) fr[blk] = inv > 0.0f ? std::exp(fr[blk] - m[rr]) * inv : 0.0f;
      T* dst = j.out + ((bh * g + h0 + rr) * j.t + tt) * rv;
      for (int64_t c = 0; c < rv; ++c) store(dst, c, ot[rr * rv + c] * inv);
    }
  }
}

template <typename T>
void h2o_task(void* data, size_t index) {
  const auto& j = *static_cast<const H2OJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(index), b = bh / j.heads, cap = j.cap, r = j.r, rv = j.rv, g = j.g;
  T* key = j.key + bh * r * cap;
  T* value = j.value + bh * cap * rv;
  float* heavy = j.heavy + bh * cap;
  int64_t* token = j.token + bh * cap;
  const int64_t* mask = j.mask + b * j.len;
  const int64_t* before = j.before + b * (j.len + 1);
  const int64_t first = j.len - j.t;
  int64_t n = before[first];
  // what the slot search relies on: at most budget(n) live slots, all holding tokens before the new ones
  int64_t live = 0, ahead = 0, hw = cap, free_from = 0;
  for (int64_t i = 0; i < cap; ++i) live += token[i] >= 0, ahead |= token[i] >= first;  // vectorised
  while (hw > 0 && token[hw - 1] < 0) --hw;  // one past the last live slot
  while (free_from < cap && token[free_from] >= 0) ++free_from;  // the first free slot
  if (ahead || live > std::min(n, budget(j.ratio, n))) {
    j.foreign->store(true);
    return;
  }
  static thread_local std::vector<float> q, o, s, f;  // scratch reused across tasks
  static thread_local std::vector<int64_t> idx;
  q.resize(static_cast<size_t>(g * r)), o.resize(static_cast<size_t>(g * rv)), s.resize(static_cast<size_t>(g * cap));
  f.resize(static_cast<size_t>(g * ((cap + kBlock - 1) / kBlock))), idx.resize(static_cast<size_t>(g * j.k));
  for (int64_t tt = 0; tt < j.t; ++tt) {
    const int64_t pos = first + tt;
    const bool real = mask[pos] != 0;
    if (real) {
      while (token[free_from] >= 0) ++free_from;  // the first free slot (one exists: cap >= need)
      const int64_t slot = free_from;
      const T* kn = j.key_new + (bh * j.t + tt) * r;
      const T* vn = j.value_new + (bh * j.t + tt) * rv;
      for (int64_t c = 0; c < r; ++c) key[c * cap + slot] = kn[c];
      std::copy(vn, vn + rv, value + slot * rv);
      token[slot] = pos, heavy[slot] = 0.0f, ++live, hw = std::max(hw, slot + 1);
    }
    for (int64_t h = 0; h < g; ++h) {
      const T* src = j.q + ((bh * g + h) * j.t + tt) * r;
      for (int64_t c = 0; c < r; ++c) q[h * r + c] = load(src, c);
    }
    select_group(q.data(), g, r, j.k, j.rule, idx.data());
    attend_token(j, bh, tt, key, value, token, hw, q.data(), idx.data(), s.data(), f.data(), o.data());
    if (real) {
      ++n;
      const int64_t keep = budget(j.ratio, n);
      // outside the keep / 2 most recent real tokens: positions before the first p with before[p] >= n - keep / 2
      const int64_t recent = std::lower_bound(before, before + j.len + 1, n - keep / 2) - before;
      const int64_t v = accumulate_and_pick(s.data(), f.data(), g, cap, (cap + kBlock - 1) / kBlock, heavy, token, hw,
                                            live > keep, recent);
      if (v >= 0) token[v] = -1, --live, free_from = std::min(free_from, v);
    }
  }
}

// present = past widened to cap slots (a copy unless bound to past's memory): keys dim-major, free slots
// token -1, heavy 0, K and V 0.
template <typename T>
void widen(const T* src, T* dst, int64_t rows, int64_t c, int64_t cap, int64_t width, T fill = T{}) {
  if (src == dst) return;
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(src + i * c * width, src + (i + 1) * c * width, dst + i * cap * width);
    std::fill(dst + (i * cap + c) * width, dst + (i + 1) * cap * width, fill);
  }
}

template <typename T>
struct H2OKernel {
  explicit H2OKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k_ = ki.GetAttribute<int64_t>("k");
    rule_ = int_attribute(ki, "rule", kPerHead);
    softcap_ = ki.GetAttribute<float>("softcap");
    ratio_ = ki.GetAttribute<float>("ratio");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q_in = ctx.GetInput(0), kn_in = ctx.GetInput(1), vn_in = ctx.GetInput(2), k_in = ctx.GetInput(3),
         v_in = ctx.GetInput(4), h_in = ctx.GetInput(5), t_in = ctx.GetInput(6), m_in = ctx.GetInput(7);
    const auto qs = q_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto kns = kn_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto vns = vn_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = k_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto vs = v_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto hs = h_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ts = t_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ms = m_in.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 5 || kns.size() != 4 || vns.size() != 4 || ks.size() != 4 || vs.size() != 4 || hs.size() != 3 ||
        ts.size() != 3 || ms.size() != 2) {
      ORT_CXX_API_THROW("H2OAttention: expected query_hat [B,Hkv,g,T,r], key_new / value_new [B,Hkv,T,r], past "
                        "key / value [B,Hkv,C,r|rv], heavy / token [B,Hkv,C] and attention_mask [B,L]",
                        ORT_INVALID_ARGUMENT);
    }
    const int64_t b = qs[0], hkv = qs[1], g = qs[2], t = qs[3], r = qs[4], rv = vns[3], c = ks[2], len = ms[1];
    const std::vector<int64_t> new_shape{b, hkv, t, r}, state{b, hkv, c};
    if (kns != new_shape || vns != std::vector<int64_t>{b, hkv, t, rv} || ks != std::vector<int64_t>{b, hkv, c, r} ||
        vs != std::vector<int64_t>{b, hkv, c, rv} || rv < 1 || hs != state || ts != state || ms[0] != b || len < t) {
      ORT_CXX_API_THROW("H2OAttention: the inputs disagree on B, Hkv, T, r or the slots C, or attention_mask is "
                        "shorter than the new tokens", ORT_INVALID_ARGUMENT);
    }
    if (k_ < 1 || k_ > r || r > kMaxWidth || rule_ < kPerHead || rule_ > kStatic || !(ratio_ > 0.0f && ratio_ <= 1.0f)) {
      ORT_CXX_API_THROW("H2OAttention: k must be in [1, r], r <= 512, rule in {0, 1, 2}, ratio in (0, 1]", ORT_INVALID_ARGUMENT);
    }
    const int64_t* mask = m_in.GetTensorData<int64_t>();
    std::vector<int64_t> before(static_cast<size_t>(b * (len + 1)));
    int64_t need = 0;
    for (int64_t bb = 0; bb < b; ++bb) {
      int64_t* row = before.data() + bb * (len + 1);
      row[0] = 0;
      for (int64_t p = 0; p < len; ++p) row[p + 1] = row[p] + (mask[bb * len + p] != 0);
      need = std::max(need, std::min(row[len], budget(ratio_, row[len]) + 1));
    }
    const int64_t cap = std::max(c, need);
    auto out = ctx.GetOutput(0, {b, hkv, g, t, rv});
    auto k_out = ctx.GetOutput(1, {b, hkv, cap, r});
    auto v_out = ctx.GetOutput(2, {b, hkv, cap, rv});
    auto h_out = ctx.GetOutput(3, {b, hkv, cap});
    auto t_out = ctx.GetOutput(4, {b, hkv, cap});
    T* key = k_out.GetTensorMutableData<T>();
    T* value = v_out.GetTensorMutableData<T>();
    float* heavy = h_out.GetTensorMutableData<float>();
    int64_t* token = t_out.GetTensorMutableData<int64_t>();
    const int64_t rows = b * hkv;
    widen(k_in.GetTensorData<T>(), key, rows * r, c, cap, 1);
    widen(v_in.GetTensorData<T>(), value, rows, c, cap, rv);
    widen(h_in.GetTensorData<float>(), heavy, rows, c, cap, 1);
    widen(t_in.GetTensorData<int64_t>(), token, rows, c, cap, 1, int64_t{-1});
    if (rows * t == 0) return;
    std::atomic<bool> foreign{false};
    H2OJob<T> job{q_in.GetTensorData<T>(), kn_in.GetTensorData<T>(), vn_in.GetTensorData<T>(), key, value, heavy,
                  token, mask, before.data(), out.GetTensorMutableData<T>(), &foreign, hkv, g, t, r, rv, k_, rule_, len,
                  cap, static_cast<double>(ratio_), softcap_};
    ctx.ParallelFor(&h2o_task<T>, static_cast<size_t>(rows), 0, &job);
    if (foreign.load()) {
      ORT_CXX_API_THROW("H2OAttention: past_token holds more live slots than the eviction budget allows, or "
                        "tokens not yet seen: the cache is not this graph's state", ORT_INVALID_ARGUMENT);
    }
  }

  int64_t k_, rule_;
  float softcap_, ratio_;
};

template <typename T>
struct H2OOp : Ort::CustomOpBase<H2OOp<T>, H2OKernel<T>> {
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const { return new H2OKernel<T>(info); }
  const char* GetName() const { return "H2OAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (i >= 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return element_type<T>();
  }
  size_t GetOutputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    if (i == 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (i == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return element_type<T>();
  }
};

}  // namespace

namespace aqua {

void add_h2o_ops(Ort::CustomOpDomain& domain) {
  static H2OOp<float> f32;
  static H2OOp<Ort::Float16_t> f16;
  domain.Add(&f32);
  domain.Add(&f16);
}

}  // namespace aqua
