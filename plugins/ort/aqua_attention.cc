// AquaAttention: one layer's attention in one pass over the cache 
// (contract: aqua_export/contract.py; the ops: aqua_export/ops/).
//
//   query_hat   [B, Hkv, g, T, r]    q^ with the attention scale folded in
//   key_cache   [B, Hkv, r, C]       dim-major K^ (a view of present.key); both caches float32 or float16,
//                                    whatever the query's type, or int8 under a float32 query (contract
//                                    cache_dtype): then [B, Hkv, r + 1, C] and [B, Hkv, Cv, rv + 1], each token's
//                                    K^ column and V row ending in its scale's code (aqua_ops.h kScaleSlots)
//   value_cache [B, Hkv, Cv, rv]     present.value (rv: V's width, r unless AQUA-Memory cuts K^ and V apart)
//   total_length [1] int64           L <= C, Cv: the slots filled so far
//   attention_mask [B|1, L] int64    0 = padding; the query at position p = L - T + t sees keys j <= p that are
//                                    not padding (and j > p - sliding_window when that attribute is > 0)
//   projection  [Hkv, d, r]          optional: query_hat is then the query q [B, Hkv, g, T, d] and q^ = q P,
//                                    computed per token as its selection is (no MatMul node before this one)
//     -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]
//   attributes: k, rule (aqua_ops.h Rule: I per query row, shared by the GQA group, or the first k), softcap,
//     sliding_window;
//     token_ratio, token_budget, token_sink, token_window: token selection (aqua_tokens.cc; a prompt then attends
//     every token with all r coordinates); head_prices [Hkv] (optional): the heads share Hkv g' k coordinates per
//     token (aqua_ops.h PoolCut; pool_cut_task finds each token's cut before any task selects);
//     prefill_threshold, prefill_stride, prefill_k_ratio: sparse prefill (aqua_prompt.cc choose_blocks)
//     prompt_bf16: 1 = a prompt's two products in bfloat16 where the CPU has AVX512_BF16 (aqua_prompt.cc)
//
// A prompt of kPromptTokens or more runs as blocked matrix products (aqua_prompt.cc). Shorter calls, decode above
// all: no [B, Hkv, g, T, L] tensor exists (nor a [T, L] mask: each block's is made from attention_mask): tasks of
// (batch, kv head, tile of up to 4 query rows, split of the L positions), each walking its positions in blocks of
// kPos:
//
//   K^[union of the tile's I, block] --accumulate--> s[rows][block]    (k of r key rows read; a group-shared
//        |                                                             selection makes the union exactly k)
//   s --softcap, + mask--> online softmax: m' = max(m, max s); o *= e^(m - m'); l = l e^(m - m') + sum e^(s - m')
//   o[rows][:] += e^(s - m') V[block]                                  (each V row read once per tile)
//
// then the splits of a tile merge: out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M). Splits exist only when
// (batch, kv head, tile) tasks are too few to keep ORT's thread pool busy (decode at batch 1). A block that the
// mask hides from every row of a tile is skipped (causal prefill); a row hidden everywhere outputs zeros.
// Query rows are tiled token-major (all g heads of a token together), so at decode a tile is the GQA group.

#include "attention_rows.h"

namespace {

using namespace aqua;

template <typename T, typename C>
struct AttentionJob : QueryRows<T>, RowsOut<T> {
  const C* key;
  const C* value;
  MaskRows mask;
  int64_t len, key_stride, value_slots, split_len;
  float softcap;
};

template <typename T, typename C>
void attention_task(void* data, size_t task_index) {
  const auto& j = *static_cast<const AttentionJob<T, C>*>(data);
  const int64_t task = static_cast<int64_t>(task_index);
  const int64_t split = task % j.splits, tile = (task / j.splits) % j.tiles, bh = task / (j.splits * j.tiles);
  const int64_t rows = j.g * j.t;
  const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - tile * kRows));
  TileScratch& sc = tile_scratch();
  float *wbuf = sc.wbuf, *s = sc.s, *o = sc.o, *mbuf = sc.mask, *scale = sc.scale;
  int32_t* uni = sc.uni;
  const int64_t nu = tile_weights<T>(j, j.k, bh, tile, nr, wbuf, uni);

  float m[kRows], l[kRows];
  Seen seen[kRows];
  const float* mb[kRows];
  for (int rr = 0; rr < nr; ++rr) {
    m[rr] = -INFINITY, l[rr] = 0.0f;
    std::fill(o + rr * kMaxWidth, o + rr * kMaxWidth + j.rv, 0.0f);
    seen[rr] = j.mask.at(bh / j.heads, (tile * kRows + rr) / j.g);
    mb[rr] = mbuf + rr * kPos;
  }
  const int64_t p0 = split * j.split_len, p1 = std::min(j.len, p0 + j.split_len);
  constexpr int64_t extra = kScaleSlots<C>;
  const int64_t vs = j.rv + extra;  // a V row's elements: its scale's code after an int8 row
  const C* key = j.key + bh * (j.r + extra) * j.key_stride;
  const C* value = j.value + bh * j.value_slots * vs;
  for (int64_t s0 = p0; s0 < p1; s0 += kPos) {
    const int64_t n = std::min(kPos, p1 - s0);
    bool visible = false;
    for (int rr = 0; rr < nr && !visible; ++rr) visible = seen[rr].any(s0, n);
    if (!visible) continue;  // a block the mask hides from every row (a causal prompt's later keys): skipped
    for (int rr = 0; rr < nr; ++rr) seen[rr].block(s0, n, mbuf + rr * kPos);
    accumulate_rows(nr, key + s0, j.key_stride, uni, nu, wbuf, n, s, kPos);
    if constexpr (extra > 0) {  // int8: each token's key scale on its scores, its value scale on its weights
      scales_of(key + j.r * j.key_stride + s0, n, 1, scale);
      scale_rows(nr, s, kPos, n, scale);
    }
    online_softmax(nr, n, j.softcap, mb, s, m, l, o, j.rv);
    if constexpr (extra > 0) {
      scales_of(value + s0 * vs + j.rv, n, vs, scale);
      scale_rows(nr, s, kPos, n, scale);
    }
    add_values_rows(nr, s, kPos, value + s0 * vs, n, j.rv, vs, o, kMaxWidth);
  }
  finish_rows<T>(j, j, task, bh, tile, nr, o, m, l);
}

// T: the query's and output's element type; C: the caches' (a float32 graph may cache float16: contract cache_dtype).
template <typename T, typename C>
struct AttentionKernel {
  explicit AttentionKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k_ = ki.GetAttribute<int64_t>("k");
    rule_ = int_attribute(ki, "rule", kPerHead);
    softcap_ = ki.GetAttribute<float>("softcap");
    window_ = int_attribute(ki, "sliding_window", 0);
    tokens_ = {float_attribute(ki, "token_ratio", 1.0f), int_attribute(ki, "token_budget", 0),
               int_attribute(ki, "token_sink", 0), int_attribute(ki, "token_window", 0)};
    prefill_ = {float_attribute(ki, "prefill_threshold", 1.0f), int_attribute(ki, "prefill_stride", 1), 1};
    prefill_ratio_ = float_attribute(ki, "prefill_k_ratio", 1.0f);
    const int64_t bf16 = int_attribute(ki, "prompt_bf16", 0);
    if (bf16 != 0 && bf16 != 1) ORT_CXX_API_THROW("AquaAttention: prompt_bf16 must be 0 or 1", ORT_INVALID_ARGUMENT);
    prompt_bf16_ = bf16 == 1 && prompt_bf16_runs();
    try {  // optional: a pooled node (ops/rules.py), the heads sharing the layer's k
      prices_ = ki.GetAttributes<float>("head_prices");
    } catch (const Ort::Exception&) {
      prices_.clear();
    }
    try {  // optional: the node scores K^'s rows divided by these (a weighted rule's int8 cache)
      unweight_ = ki.GetAttributes<float>("key_weights");
    } catch (const Ort::Exception&) {
      unweight_.clear();
    }
    for (float& w : unweight_) {
      if (!(w > 0.0f) || !std::isfinite(w)) {
        ORT_CXX_API_THROW("AquaAttention: key_weights must be positive and finite", ORT_INVALID_ARGUMENT);
      }
      w = 1.0f / w;
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q_in = ctx.GetInput(0), k_in = ctx.GetInput(1), v_in = ctx.GetInput(2), m_in = ctx.GetInput(4);
    const auto qs = q_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = k_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto vs = v_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ms = m_in.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t len = total_length(ctx, 3);
    if (qs.size() != 5 || ks.size() != 4 || vs.size() != 4 || ms.size() != 2) {
      ORT_CXX_API_THROW("AquaAttention: expected query_hat [B,Hkv,g,T,r], key_cache [B,Hkv,r,C], value_cache "
                        "[B,Hkv,C,rv] and attention_mask [B,L]", ORT_INVALID_ARGUMENT);
    }
    const int64_t r = ks[2] - kScaleSlots<C>, rv = vs[3] - kScaleSlots<C>;  // an int8 row's scale code aside
    const OrtValue* p_value = ctx.GetInputCount() > 5 ? static_cast<const OrtValue*>(ctx.GetInput(5)) : nullptr;
    Ort::ConstValue p_in{p_value};
    if (p_value != nullptr) {
      const auto ps = p_in.GetTensorTypeAndShapeInfo().GetShape();
      if (ps.size() != 3 || ps[0] != qs[1] || ps[1] != qs[4] || ps[2] != r || qs[4] > kMaxWidth) {
        ORT_CXX_API_THROW("AquaAttention: projection must be [Hkv, d, r] for a query [B, Hkv, g, T, d] (d <= 512) "
                          "and key_cache [B, Hkv, r, C]", ORT_INVALID_ARGUMENT);
      }
    }
    if (ks[0] != qs[0] || vs[0] != qs[0] || ks[1] != qs[1] || vs[1] != qs[1] || (p_value == nullptr && qs[4] != r)) {
      ORT_CXX_API_THROW("AquaAttention: query_hat, key_cache and value_cache disagree on B, Hkv or r",
                        ORT_INVALID_ARGUMENT);
    }
    if (len < 0 || len > ks[3] || len > vs[2] || (ms[0] != 1 && ms[0] != qs[0]) || ms[1] != len || qs[3] > len) {
      ORT_CXX_API_THROW("AquaAttention: total_length must fit both caches and the T new tokens, and attention_mask "
                        "must be [B|1,L]", ORT_INVALID_ARGUMENT);
    }
    if (window_ < 0) ORT_CXX_API_THROW("AquaAttention: sliding_window must be >= 0", ORT_INVALID_ARGUMENT);
    if (k_ < 1 || k_ > r || r > kMaxWidth || rv < 1 || rv > kMaxWidth || rule_ < kPerHead || rule_ > kStatic) {
      ORT_CXX_API_THROW("AquaAttention: k must be in [1, r], r and rv in [1, 512], rule in {0, 1, 2}",
                        ORT_INVALID_ARGUMENT);
    }
    if (!(tokens_.ratio > 0.0) || tokens_.ratio > 1.0 || tokens_.budget < 0 || tokens_.sink < 0 ||
        tokens_.window < 0) {
      ORT_CXX_API_THROW("AquaAttention: token_ratio must be in (0, 1], token_budget, token_sink and token_window "
                        ">= 0", ORT_INVALID_ARGUMENT);
    }
    if (!(prefill_.threshold > 0.0f) || prefill_.threshold > 1.0f || prefill_.stride < 1 ||
        prefill_.stride > kPrefillBlock || !(prefill_ratio_ > 0.0f) || prefill_ratio_ > 1.0f) {
      ORT_CXX_API_THROW("AquaAttention: prefill_threshold and prefill_k_ratio must be in (0, 1], prefill_stride in "
                        "[1, 64]", ORT_INVALID_ARGUMENT);
    }
    if (!prices_.empty() && static_cast<int64_t>(prices_.size()) != qs[1]) {
      ORT_CXX_API_THROW("AquaAttention: head_prices must hold one price per kv head", ORT_INVALID_ARGUMENT);
    }
    if (!unweight_.empty() && static_cast<int64_t>(unweight_.size()) != qs[1] * r) {
      ORT_CXX_API_THROW("AquaAttention: key_weights must hold Hkv * r weights", ORT_INVALID_ARGUMENT);
    }
    auto out = ctx.GetOutput(0, std::vector<int64_t>{qs[0], qs[1], qs[2], qs[3], rv});
    const int64_t bh = qs[0] * qs[1], rows = qs[2] * qs[3];
    if (bh * rows == 0) return;
    const T* p_data = p_value != nullptr ? p_in.GetTensorData<T>() : nullptr;
    // token selection: a decode step attends the chosen pages (aqua_tokens.cc), a prompt every token with all r
    const int64_t k = tokens_.on() ? r : k_;
    QueryRows<T> query{q_in.GetTensorData<T>(), p_data, qs[1], qs[2], qs[3], qs[4], r, k_, rule_};
    query.unweight = unweight_.empty() ? nullptr : unweight_.data();
    if (!prices_.empty()) {  // each token's cut of the pooled selection, before any task selects
      auto& value = call_buffer<float, Buffer::kPoolValue>(static_cast<size_t>(qs[0] * qs[3]));
      auto& index = call_buffer<int64_t, Buffer::kPoolIndex>(static_cast<size_t>(qs[0] * qs[3]));
      query.prices = prices_.data();
      if (pooled(query, k_)) {
        PoolJob<T> pool{query, k_, value.data(), index.data()};
        ctx.ParallelFor(&pool_cut_task<T>, static_cast<size_t>(qs[0] * qs[3]), 0, &pool);
        query.cut_value = value.data();
        query.cut_index = index.data();
      }
    }
    const MaskRows mask{m_in.GetTensorData<int64_t>(), ms[0], len, qs[3], window_};
    QueryRows<T> at_k = query;
    at_k.k = k;  // r for a prompt under token selection
    if (tokens_.on() && qs[3] == 1) {
      attend_pages<T, C>(ctx, query, k_in.GetTensorData<C>(), v_in.GetTensorData<C>(), mask,
                         out.GetTensorMutableData<T>(), qs[0], rv, ks[3], vs[2], softcap_, tokens_);
      return;
    }
    if (qs[3] >= kPromptTokens) {
      PrefillRule prefill = prefill_;  // the estimate's k' = clamp(floor(ratio r + 0.5), 1, r), as settings.prefill
      prefill.k = std::clamp<int64_t>(static_cast<int64_t>(std::floor(static_cast<double>(prefill_ratio_) * r + 0.5)),
                                      1, r);
      attend_prompt<T, C>(ctx, at_k, k_in.GetTensorData<C>(), v_in.GetTensorData<C>(), mask,
                          out.GetTensorMutableData<T>(), qs[0], rv, ks[3], vs[2], softcap_, prefill, prompt_bf16_);
      return;
    }
    const int64_t tiles = (rows + kRows - 1) / kRows;
    int64_t splits = 1;
    if (bh * tiles < kTasksWanted) {
      splits = std::min((kTasksWanted + bh * tiles - 1) / (bh * tiles), std::max<int64_t>(1, len / (4 * kPos)));
    }
    const int64_t split_len = ((len + splits - 1) / splits + kPos - 1) / kPos * kPos;
    const size_t n_part = splits > 1 ? static_cast<size_t>(bh * tiles * splits * kRows * (rv + 2)) : 0;
    auto& part = call_buffer<float, Buffer::kDensePartials>(n_part);
    AttentionJob<T, C> job{at_k,
                        {out.GetTensorMutableData<T>(), part.data(), rv, tiles, splits},
                        k_in.GetTensorData<C>(), v_in.GetTensorData<C>(), mask, len, ks[3], vs[2], split_len, softcap_};
    ctx.ParallelFor(&attention_task<T, C>, static_cast<size_t>(bh * tiles * splits), 0, &job);
    if (splits > 1) ctx.ParallelFor(&merge_task<T, AttentionJob<T, C>>, static_cast<size_t>(bh * tiles), 0, &job);
  }

  int64_t k_, rule_, window_;
  float softcap_;
  TokenRule tokens_;
  PrefillRule prefill_;
  float prefill_ratio_;
  bool prompt_bf16_;  // a prompt's products in bfloat16 (attend_prompt)
  std::vector<float> prices_;  // empty: each row keeps its own k
  std::vector<float> unweight_;  // [Hkv][r] 1 / key_weights: a row's selected q^ times these scores k^ / w; empty: 1
};

// inputs 1 and 2 (key_cache, value_cache) of type C, 3 and 4 (total_length, attention_mask) int64
template <typename T, typename C = T>
struct AttentionOp : CpuOp<AttentionOp<T, C>, AttentionKernel<T, C>, T, 6, 3, 99, 5, C, 0b110u, 0b11000u> {
  const char* GetName() const { return "AquaAttention"; }
};

}  // namespace

namespace aqua {

void add_attention_ops(Ort::CustomOpDomain& domain) {
  static AttentionOp<float> f32;
  static AttentionOp<Ort::Float16_t> f16;
  static AttentionOp<float, Ort::Float16_t> f32_cache16;  // a float32 graph with a float16 cache
  static AttentionOp<float, int8_t> f32_cache8;  // a float32 graph with an int8 cache
  domain.Add(&f32);
  domain.Add(&f16);
  domain.Add(&f32_cache16);
  domain.Add(&f32_cache8);
}

}  // namespace aqua
