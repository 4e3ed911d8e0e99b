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
  int64_t heads, g, t, r, rv, k, rule, len, cap;
  double ratio;
  float softcap;
};

// The g rows' scores over slots [0, hw): s[j * cap + i] (un-normalised), by tiles of up to kRows rows that
// walk the union of their selections once per block of slots.
template <typename T>
void scores(const H2OJob<T>& j, const T* key, const float* q, const int64_t* idx, int64_t hw, float* s) {
  std::vector<float> wbuf(static_cast<size_t>(kRows * j.r));
  std::vector<int32_t> uni(static_cast<size_t>(j.r));
  std::vector<char> mark(static_cast<size_t>(j.r));
  for (int64_t j0 = 0; j0 < j.g; j0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, j.g - j0));
    std::fill(wbuf.begin(), wbuf.end(), 0.0f);
    std::fill(mark.begin(), mark.end(), 0);
    for (int rr = 0; rr < nr; ++rr) {
      for (int64_t i = 0; i < j.k; ++i) {
        const int64_t c = idx[(j0 + rr) * j.k + i];
        wbuf[c * kRows + rr] = q[(j0 + rr) * j.r + c];
        mark[c] = 1;
      }
    }
    int64_t nu = 0;
    for (int64_t c = 0; c < j.r; ++c) {
      if (mark[c]) uni[nu++] = static_cast<int32_t>(c);
    }
    for (int64_t s0 = 0; s0 < hw; s0 += kBlock) {
      accumulate_rows(nr, key + s0, j.cap, uni.data(), nu, wbuf.data(), std::min(kBlock, hw - s0),
                      s + j0 * j.cap + s0, j.cap);
    }
  }
}

// s[j * cap + i] -> softmax weights over the live slots (0 elsewhere; all 0 when none is live). Free slots are
// set to -inf by a select (a stale score, whatever it holds, is dropped) and then leave exact zeros.
inline void softmax_live(float* s, const int64_t* token, int64_t g, int64_t hw, int64_t cap, float softcap) {
  for (int64_t h = 0; h < g; ++h) {
    float* x = s + h * cap;
    if (softcap > 0.0f) {
      for (int64_t i = 0; i < hw; ++i) x[i] = std::tanh(x[i] / softcap) * softcap;
    }
    float lane[kLanes];  // partial maxima: see exp_sum
    std::fill(lane, lane + kLanes, -INFINITY);
    int64_t i = 0;
    for (; i + kLanes <= hw; i += kLanes) {
      for (int e = 0; e < kLanes; ++e) {
        x[i + e] = token[i + e] < 0 ? -INFINITY : x[i + e];
        lane[e] = std::max(lane[e], x[i + e]);
      }
    }
    for (; i < hw; ++i) x[i] = token[i] < 0 ? -INFINITY : x[i], lane[0] = std::max(lane[0], x[i]);
    const float top = *std::max_element(lane, lane + kLanes);
    if (top == -INFINITY) {  // nothing live
      std::fill(x, x + hw, 0.0f);
      continue;
    }
    const float inv = 1.0f / exp_sum(x, hw, top);
    for (int64_t i = 0; i < hw; ++i) x[i] *= inv;
  }
}

// heavy[i] += sum over the g rows of w[h][i] (+ 0 on free slots), and in the same pass over the slots, when
// token is given, the live slot to free: smallest (updated) heavy among the slots outside the n_recent most
// recent real tokens, ties -> the later token; -1 if there is none (or no token given). One pass instead of
// two: at decode the per-slot state is read once per step beside K^ and V.
inline int64_t accumulate_and_pick(const float* w, int64_t g, int64_t cap, float* heavy, const int64_t* token,
                                   const int64_t* before, int64_t hw, int64_t n, int64_t n_recent) {
  int64_t best = -1;
  for (int64_t i = 0; i < hw; ++i) {
    float sum = 0.0f;
    for (int64_t h = 0; h < g; ++h) sum += w[h * cap + i];
    heavy[i] += sum;
    if (token == nullptr || token[i] < 0 || n - before[token[i]] <= n_recent) continue;
    if (best < 0 || heavy[i] < heavy[best] || (heavy[i] == heavy[best] && token[i] > token[best])) best = i;
  }
  return best;
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
  int64_t live = 0, hw = 0;
  for (int64_t i = 0; i < cap; ++i) {
    if (token[i] >= 0) ++live, hw = i + 1;
  }
  const int64_t first = j.len - j.t;
  int64_t n = before[first];
  std::vector<float> q(static_cast<size_t>(g * r)), o(static_cast<size_t>(g * rv));
  std::vector<int64_t> idx(static_cast<size_t>(g * j.k));
  static thread_local std::vector<float> s;  // [g][cap] scores: reused across tasks, entries past hw never read
  s.resize(static_cast<size_t>(g * cap));
  for (int64_t tt = 0; tt < j.t; ++tt) {
    const int64_t pos = first + tt;
    const bool real = mask[pos] != 0;
    if (real) {
      int64_t slot = 0;
      while (token[slot] >= 0) ++slot;  // a free slot exists: cap >= need
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
    scores(j, key, q.data(), idx.data(), hw, s.data());
    softmax_live(s.data(), token, g, hw, cap, j.softcap);
    // free slots weigh exactly 0 (their V rows hold zeros or an evicted token's values)
    std::fill(o.begin(), o.end(), 0.0f);
    for (int64_t h0 = 0; h0 < g; h0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, g - h0));
      for (int64_t s0 = 0; s0 < hw; s0 += kBlock) {
        add_values_rows(nr, s.data() + h0 * cap + s0, cap, value + s0 * rv, std::min(kBlock, hw - s0), rv,
                        o.data() + h0 * rv, rv);
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      T* dst = j.out + ((bh * g + h) * j.t + tt) * rv;
      for (int64_t c = 0; c < rv; ++c) store(dst, c, o[h * rv + c]);
    }
    if (real) {
      ++n;
      const int64_t keep = budget(j.ratio, n);
      const int64_t v = accumulate_and_pick(s.data(), g, cap, heavy, live > keep ? token : nullptr, before, hw, n,
                                            keep / 2);
      if (v >= 0) token[v] = -1, --live;
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
    if (k_ < 1 || k_ > r || rule_ < kPerHead || rule_ > kStatic || !(ratio_ > 0.0f && ratio_ <= 1.0f)) {
      ORT_CXX_API_THROW("H2OAttention: k must be in [1, r], rule in {0, 1, 2}, ratio in (0, 1]", ORT_INVALID_ARGUMENT);
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
    // what the slot search relies on: a row holds at most budget(n) live tokens, all before the new ones
    const int64_t first = len - t;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = before[(i / hkv) * (len + 1) + first];
      int64_t live = 0;
      for (int64_t sl = 0; sl < cap; ++sl) {
        const int64_t tk = token[i * cap + sl];
        if (tk >= first) live = cap;  // a slot claims a position not yet seen
        live += tk >= 0;
      }
      if (live > std::min(n, budget(ratio_, n))) {
        ORT_CXX_API_THROW("H2OAttention: past_token holds more live slots than the eviction budget allows, or "
                          "tokens not yet seen: the cache is not this graph's state", ORT_INVALID_ARGUMENT);
      }
    }
    if (rows * t == 0) return;
    H2OJob<T> job{q_in.GetTensorData<T>(), kn_in.GetTensorData<T>(), vn_in.GetTensorData<T>(), key, value, heavy,
                  token, mask, before.data(), out.GetTensorMutableData<T>(), hkv, g, t, r, rv, k_, rule_, len, cap,
                  static_cast<double>(ratio_), softcap_};
    ctx.ParallelFor(&h2o_task<T>, static_cast<size_t>(rows), 0, &job);
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
