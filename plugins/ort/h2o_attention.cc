// H2OAttention: one layer's AQUA-H2O attention with the eviction inside (contract: aqua_export/contract.py,
// the rule: aqua_export/ops/rules.py h2o_keep).
//
//   query_hat    [B, Hkv, g, T, r]   q^ of the new tokens, attention scale folded in
//   key_new      [B, Hkv, T, r]      k^ of the new tokens
//   value_new    [B, Hkv, T, rv]     v of the new tokens (rv: V's width, r unless K^ and V are cut apart)
//   past_key     [B, Hkv, C, r]      slots of K^, memory dim-major [B, Hkv, r, C]
//   past_value   [B, Hkv, C, rv]
//   past_heavy   [B, Hkv, C] f32     accumulated attention of each slot (the heavy-hitter statistic)
//   past_token   [B, Hkv, C] i64     which token (0-based, padding counted) a slot holds; -1: free
//   attention_mask [B, L] i64        every token so far, the T new ones last (0 = padding)
//   projection  [Hkv, d, r]          optional: query_hat is then the query q [B, Hkv, g, T, d] and q^ = q P,
//                                    computed per token as its selection is (as AquaAttention's)
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
// need = max over rows of min(n, budget(n) + 1) with n the row's real tokens (aqua_export/ops/rules.py slots_needed).
// A query that sees no live slot (a padding token before any real one) outputs zeros.

#include "h2o_rows.h"

namespace {

using namespace aqua;
using namespace aqua::h2o;

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
    const int64_t b = qs[0], hkv = qs[1], g = qs[2], t = qs[3], qw = qs[4], r = kns[3], rv = vns[3], c = ks[2],
                  len = ms[1];
    const OrtValue* p_value = ctx.GetInputCount() > 8 ? static_cast<const OrtValue*>(ctx.GetInput(8)) : nullptr;
    Ort::ConstValue p_in{p_value};
    if (p_value != nullptr && (p_in.GetTensorTypeAndShapeInfo().GetShape() != std::vector<int64_t>{hkv, qw, r} ||
                               qw > kMaxWidth)) {
      ORT_CXX_API_THROW("H2OAttention: projection must be [Hkv, d, r] for a query [B, Hkv, g, T, d] (d <= 512) and "
                        "key_new [B, Hkv, T, r]", ORT_INVALID_ARGUMENT);
    }
    const std::vector<int64_t> new_shape{b, hkv, t, r}, state{b, hkv, c};
    if (kns != new_shape || vns != std::vector<int64_t>{b, hkv, t, rv} || ks != std::vector<int64_t>{b, hkv, c, r} ||
        vs != std::vector<int64_t>{b, hkv, c, rv} || rv < 1 || hs != state || ts != state || ms[0] != b || len < t ||
        (p_value == nullptr && qw != r)) {
      ORT_CXX_API_THROW("H2OAttention: the inputs disagree on B, Hkv, T, r or the slots C, or attention_mask is "
                        "shorter than the new tokens", ORT_INVALID_ARGUMENT);
    }
    if (k_ < 1 || k_ > r || r > kMaxWidth || rv > kMaxWidth || rule_ < kPerHead || rule_ > kStatic || !(ratio_ > 0.0f && ratio_ <= 1.0f)) {
      ORT_CXX_API_THROW("H2OAttention: k must be in [1, r], r and rv <= 512, rule in {0, 1, 2}, ratio in (0, 1]", ORT_INVALID_ARGUMENT);
    }
    const int64_t* mask = m_in.GetTensorData<int64_t>();
    // [b, len + 1]: visible tokens before each position
    auto& before = call_buffer<int64_t, Buffer::kH2OVisibleBefore>(static_cast<size_t>(b * (len + 1)));
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
    const int64_t blocks = (cap + kBlock - 1) / kBlock;
    // decode with fewer rows than kTasksWanted: each row's blocks split over tasks (at least one block each)
    const int64_t splits = t == 1 ? std::min(blocks, (kTasksWanted + rows - 1) / rows) : 1;
    H2OJob<T> job{q_in.GetTensorData<T>(), p_value == nullptr ? nullptr : p_in.GetTensorData<T>(), kn_in.GetTensorData<T>(), vn_in.GetTensorData<T>(), key, value, heavy,
                  token, mask, before.data(), out.GetTensorMutableData<T>(), &foreign, hkv, g, t, qw, r, rv, k_, rule_, len,
                  cap, blocks, static_cast<double>(ratio_), softcap_, splits, (blocks + splits - 1) / splits};
    if (splits == 1) {
      ctx.ParallelFor(&h2o_task<T>, static_cast<size_t>(rows), 0, &job);
    } else {
      static thread_local std::vector<Row> row_state;  // scratch of this thread's calls (no allocation per step)
      static thread_local std::vector<float> q_rows, s_rows, f_rows, part;
      static thread_local std::vector<int64_t> idx_rows;
      row_state.resize(static_cast<size_t>(rows)), q_rows.resize(static_cast<size_t>(rows * g * r));
      s_rows.resize(static_cast<size_t>(rows * g * cap)), f_rows.resize(static_cast<size_t>(rows * g * blocks));
      part.resize(static_cast<size_t>(rows * splits * g * (rv + 2))), idx_rows.resize(static_cast<size_t>(rows * g * k_));
      job.rows = row_state.data(), job.q_rows = q_rows.data(), job.s_rows = s_rows.data();
      job.f_rows = f_rows.data(), job.part = part.data(), job.idx_rows = idx_rows.data();
      ctx.ParallelFor(&split_open<T>, static_cast<size_t>(rows), 0, &job);
      ctx.ParallelFor(&split_attend<T>, static_cast<size_t>(rows * splits), 0, &job);
      ctx.ParallelFor(&split_merge<T>, static_cast<size_t>(rows), 0, &job);
    }
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
  size_t GetInputTypeCount() const { return 9; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {  // projection: optional
    return i < 8 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (i == 6 || i == 7) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
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
