// Native ONNX Runtime CPU kernels of the com.aqua domain 
// (contract: aqua_export/contract.py; the ops: aqua_export/ops/).
//
// TopKGatherDot
//   query_hat [B, Hkv, g, T, r]   key_cache [B, Hkv, r, C] (dim-major K^)   total_length [1] (L <= C)
//     ->   scores [B, Hkv, g, T, L]
// KeyCacheUpdate / ValueCacheUpdate
//   past [B, Hkv, C, r]   new [B, Hkv, S, r]   total_length [1] (L)   ->   present [B, Hkv, max(C, L), r]
//   The new entries go to slots L-S .. L-1. A key buffer's memory is dim-major ([r, C] per head: the
//   declared shape is what onnxruntime-genai allocates, the layout is ours); a value buffer's is [C, r].
//   When present is bound to past's memory (a shared buffer), only the S new entries are written:
//   O(S) per step, not O(C). Otherwise the first L-S slots are copied over (the concat contract).
//
// ValueProduct
//   probs [B, Hkv, g, T, L]   value_cache [B, Hkv, C, r] (L <= C)   ->   out [B, Hkv, g, T, r] = probs @ V[:L]
//   Reads the L filled slots of the buffer in place (no copy of the live V, which a Slice would make).
//
// TopKGatherDot, per query row: I = the k coordinates of largest |q^| (ties -> lower index, as everywhere in the
// project), scores[s] = sum_{c in I} q^[c] * K^[c, s] for s < L. Because K^ is dim-major, coordinate c of every
// cached key is one contiguous row of S values: the kernel streams exactly k of the r rows, so it
// reads k/r of the key cache and nothing twice (the portable function body materialises a masked
// copy of q^ and multiplies all r rows).
//
// Work split (ORT's intra-op thread pool): first the selection of every query row, then tasks of
// (batch, kv head, block of 1024 positions). Within a task, query rows go in groups of up to 4: the
// union of their selected coordinates is walked once, and each selected key row segment (1024
// contiguous values) is loaded once and multiplied into all the group's L1-resident accumulators
// (weight 0 where a row did not select that coordinate). The query heads of a GQA group share K^,
// so the key cache is read once per group, restricted to the union of the group's selections.
//
// Built against the ONNX Runtime C API headers of Debian's libonnxruntime-dev (fetched at build
// time, see plugins/ort/CMakeLists.txt); the C API is versioned, so this loads in newer runtimes. Compiled once per
// instruction-set variant (CMakeLists.txt); loader.cc picks one for the CPU it runs on.

#include <mutex>

#include "aqua_ops.h"

namespace {

using namespace aqua;

constexpr const char* kDomain = "com.aqua";
constexpr const char* kOpName = "TopKGatherDot";
#ifndef AQUA_BLOCK
#define AQUA_BLOCK 2048
#endif
constexpr int64_t kBlock = AQUA_BLOCK;  // positions per task: each selected key row is read in runs of this length

// Phase 1, per (batch, kv head, token): the selected coordinates of its g query rows and their q^ values.
template <typename T>
struct SelectJob {
  const T* q;
  int64_t g, t, r, k, rule;
  int32_t* sel;  // [rows, k]
  float* qsel;   // [rows, k]
};

template <typename T>
void select_unit(void* data, size_t unit) {
  const auto& j = *static_cast<const SelectJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(unit) / j.t, t = static_cast<int64_t>(unit) % j.t;
  std::vector<float> q(static_cast<size_t>(j.g * j.r));
  std::vector<int64_t> idx(static_cast<size_t>(j.g * j.k));
  for (int64_t h = 0; h < j.g; ++h) {
    const T* row = j.q + ((bh * j.g + h) * j.t + t) * j.r;
    for (int64_t c = 0; c < j.r; ++c) q[h * j.r + c] = load(row, c);
  }
  select_group(q.data(), j.g, j.r, j.k, j.rule, idx.data());
  for (int64_t h = 0; h < j.g; ++h) {
    const int64_t row = (bh * j.g + h) * j.t + t;
    for (int64_t i = 0; i < j.k; ++i) {
      j.sel[row * j.k + i] = static_cast<int32_t>(idx[h * j.k + i]);
      j.qsel[row * j.k + i] = q[h * j.r + idx[h * j.k + i]];
    }
  }
}

// Phase 2, per (batch, kv head, block of S): every query row of the group. The group's query heads
// select different coordinates of one shared K^; walking them block by block means a key row
// segment comes from DRAM once and is reused from cache by the other heads of the group, so the
// traffic is the union of the group's selections, not g times k rows.
template <typename T>
struct ScoreJob {
  const T* kc;
  const int32_t* sel;
  const float* qsel;
  T* out;
  int64_t rows_per_kv;  // g * T
  int64_t r, s, k, blocks;
  int64_t stride;  // C: the key buffer's row length (s = L of its slots are scored)
};

template <typename T>
void score_block(void* data, size_t task) {
  const auto& j = *static_cast<const ScoreJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(task) / j.blocks;
  const int64_t s0 = (static_cast<int64_t>(task) % j.blocks) * kBlock;
  const int64_t n = std::min(kBlock, j.s - s0);
  const T* key = j.kc + bh * j.r * j.stride + s0;
  // per group of up to 4 query rows: their weights dense over r (0 where a row did not select the
  // coordinate) and the union of their selections
  std::vector<float> wbuf(static_cast<size_t>(kRows * j.r));
  std::vector<int32_t> uni(static_cast<size_t>(j.r));
  std::vector<char> mark(static_cast<size_t>(j.r));
  alignas(64) static thread_local float acc[kRows][kBlock];
  const int64_t first = bh * j.rows_per_kv, last = first + j.rows_per_kv;
  for (int64_t row0 = first; row0 < last; row0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, last - row0));
    std::fill(wbuf.begin(), wbuf.end(), 0.0f);
    std::fill(mark.begin(), mark.end(), 0);
    for (int rr = 0; rr < nr; ++rr) {
      const int32_t* idx = j.sel + (row0 + rr) * j.k;
      const float* w = j.qsel + (row0 + rr) * j.k;
      for (int64_t t = 0; t < j.k; ++t) {
        wbuf[static_cast<size_t>(idx[t]) * kRows + rr] = w[t];
        mark[static_cast<size_t>(idx[t])] = 1;
      }
    }
    const int64_t nu = union_of(mark.data(), j.r, uni.data());
    accumulate_rows(nr, key, j.stride, uni.data(), nu, wbuf.data(), n, &acc[0][0], kBlock);
    for (int rr = 0; rr < nr; ++rr) {
      T* out = j.out + (row0 + rr) * j.s + s0;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(out, acc[rr], sizeof(float) * n);
      } else {
        for (int64_t i = 0; i < n; ++i) store(out, i, acc[rr][i]);
      }
    }
  }
}

template <typename T>
struct Kernel {
  explicit Kernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k_ = ki.GetAttribute<int64_t>("k");
    rule_ = int_attribute(ki, "rule", kPerHead);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q_in = ctx.GetInput(0);
    auto k_in = ctx.GetInput(1);
    const auto qs = q_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto ks = k_in.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 5 || ks.size() != 4) {
      ORT_CXX_API_THROW("TopKGatherDot: expected query_hat [B,Hkv,g,T,r] and key_cache [B,Hkv,r,S]",
                        ORT_INVALID_ARGUMENT);
    }
    if (qs[0] != ks[0] || qs[1] != ks[1] || qs[4] != ks[2]) {
      ORT_CXX_API_THROW("TopKGatherDot: query_hat and key_cache disagree on B, Hkv or r", ORT_INVALID_ARGUMENT);
    }
    const int64_t r = qs[4];
    if (k_ < 1 || k_ > r) {
      ORT_CXX_API_THROW("TopKGatherDot: attribute k must be in [1, r]", ORT_INVALID_ARGUMENT);
    }
    const int64_t len = total_length(ctx, 2);
    if (len < 0 || len > ks[3]) {
      ORT_CXX_API_THROW("TopKGatherDot: total_length must be in [0, key_cache.shape[3]]", ORT_INVALID_ARGUMENT);
    }
    std::vector<int64_t> os{qs[0], qs[1], qs[2], qs[3], len};
    auto out = ctx.GetOutput(0, os);
    const int64_t rows = qs[0] * qs[1] * qs[2] * qs[3];
    if (rows == 0 || len == 0) return;
    std::vector<int32_t> sel(static_cast<size_t>(rows * k_));
    std::vector<float> qsel(static_cast<size_t>(rows * k_));
    SelectJob<T> sj{q_in.GetTensorData<T>(), qs[2], qs[3], r, k_, rule_, sel.data(), qsel.data()};
    ctx.ParallelFor(&select_unit<T>, static_cast<size_t>(qs[0] * qs[1] * qs[3]), 0, &sj);
    const int64_t blocks = (len + kBlock - 1) / kBlock;
    ScoreJob<T> job{k_in.GetTensorData<T>(), sel.data(), qsel.data(), out.GetTensorMutableData<T>(),
                    qs[2] * qs[3], r, len, k_, blocks, ks[3]};
    ctx.ParallelFor(&score_block<T>, static_cast<size_t>(qs[0] * qs[1] * blocks), 0, &job);
  }

  int64_t k_, rule_;
};

template <typename T>
struct Op : CpuOp<Op<T>, Kernel<T>, T, 3, 2> {
  const char* GetName() const { return kOpName; }
};

// ---------------------------------------------------------------------------------------------
// KeyCacheUpdate / ValueCacheUpdate (see the top of the file)

struct CacheJob {
  const char* past;
  const char* fresh;
  char* out;
  int64_t c, s, r, p, out_len, elem;  // elem: bytes per value
  bool in_place, dim_major;
};

void cache_head(void* data, size_t bh) {
  const auto& j = *static_cast<const CacheJob*>(data);
  const int64_t e = j.elem;
  char* o = j.out + static_cast<int64_t>(bh) * j.out_len * j.r * e;
  const char* pb = j.past + static_cast<int64_t>(bh) * j.c * j.r * e;
  const char* nb = j.fresh + static_cast<int64_t>(bh) * j.s * j.r * e;
  const int64_t l = j.p + j.s;
  if (j.dim_major) {
    for (int64_t c = 0; c < j.r; ++c) {
      char* row = o + c * j.out_len * e;
      if (!j.in_place) {
        std::memcpy(row, pb + c * j.c * e, static_cast<size_t>(j.p * e));
        std::memset(row + l * e, 0, static_cast<size_t>((j.out_len - l) * e));
      }
      for (int64_t t = 0; t < j.s; ++t) std::memcpy(row + (j.p + t) * e, nb + (t * j.r + c) * e, static_cast<size_t>(e));
    }
  } else {
    if (!j.in_place) {
      std::memcpy(o, pb, static_cast<size_t>(j.p * j.r * e));
      std::memset(o + l * j.r * e, 0, static_cast<size_t>((j.out_len - l) * j.r * e));
    }
    std::memcpy(o + j.p * j.r * e, nb, static_cast<size_t>(j.s * j.r * e));
  }
}

template <typename T, bool DimMajor>
struct CacheKernel {
  explicit CacheKernel(const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto past = ctx.GetInput(0);
    auto fresh = ctx.GetInput(1);
    const auto ps = past.GetTensorTypeAndShapeInfo().GetShape();
    const auto ns = fresh.GetTensorTypeAndShapeInfo().GetShape();
    if (ps.size() != 4 || ns.size() != 4 || ps[0] != ns[0] || ps[1] != ns[1] || ps[3] != ns[3]) {
      ORT_CXX_API_THROW("CacheUpdate: expected past [B,Hkv,C,r] and new [B,Hkv,S,r]", ORT_INVALID_ARGUMENT);
    }
    const int64_t len = total_length(ctx, 2), p = len - ns[2];
    if (p < 0 || p > ps[2]) {
      ORT_CXX_API_THROW("CacheUpdate: total_length - new tokens must be in [0, past.shape[2]]", ORT_INVALID_ARGUMENT);
    }
    const int64_t out_len = std::max(ps[2], len);
    auto out = ctx.GetOutput(0, std::vector<int64_t>{ps[0], ps[1], out_len, ps[3]});
    auto* o = static_cast<char*>(out.GetTensorMutableRawData());
    const auto* pd = static_cast<const char*>(past.GetTensorRawData());
    CacheJob job{pd, static_cast<const char*>(fresh.GetTensorRawData()), o, ps[2], ns[2], ps[3], p, out_len,
                 static_cast<int64_t>(sizeof(T)), o == pd, DimMajor};
    if (ps[0] * ps[1] == 0) return;
    ctx.ParallelFor(&cache_head, static_cast<size_t>(ps[0] * ps[1]), 0, &job);
  }
};

// ---------------------------------------------------------------------------------------------
// ValueProduct: tasks of (batch, kv head, 32 columns of r); within a task, query rows in tiles of 4
// accumulate over the L slots, so each 128-byte segment of V (two cache lines, what the adjacent-line
// prefetcher fetches anyway) is loaded once per row tile.

constexpr int kRowTile = 4, kColTile = 32;

template <typename T>
struct ValueJob {
  const T* p;
  const T* v;
  T* out;
  int64_t rows, len, cap, r, chunks;
};

// acc[NR][32] += probs[rr, l] * V[l, c0 .. c0+32) over l < len; NR and the tile width are compile-time
// constants so the accumulators stay in vector registers.
template <int NR, bool Full, typename T>
void value_rows(const T* __restrict probs, int64_t len, const T* __restrict vals, int64_t r, int64_t nc,
                float (&acc)[kRowTile][kColTile]) {
  for (int rr = 0; rr < NR; ++rr) {
    for (int c = 0; c < kColTile; ++c) acc[rr][c] = 0.0f;
  }
  for (int64_t l = 0; l < len; ++l) {
    const T* vr = vals + l * r;
    float vv[kColTile];
    if constexpr (Full) {
      for (int c = 0; c < kColTile; ++c) vv[c] = load(vr, c);
    } else {
      for (int c = 0; c < kColTile; ++c) vv[c] = c < nc ? load(vr, c) : 0.0f;
    }
    for (int rr = 0; rr < NR; ++rr) {
      const float w = load(probs + rr * len, l);
      for (int c = 0; c < kColTile; ++c) acc[rr][c] += w * vv[c];
    }
  }
}

template <bool Full, typename T>
void value_tile(int nr, const T* probs, int64_t len, const T* vals, int64_t r, int64_t nc, float (&acc)[kRowTile][kColTile]) {
  switch (nr) {
    case 1: value_rows<1, Full>(probs, len, vals, r, nc, acc); break;
    case 2: value_rows<2, Full>(probs, len, vals, r, nc, acc); break;
    case 3: value_rows<3, Full>(probs, len, vals, r, nc, acc); break;
    default: value_rows<4, Full>(probs, len, vals, r, nc, acc); break;
  }
}

template <typename T>
void value_task(void* data, size_t task) {
  const auto& j = *static_cast<const ValueJob<T>*>(data);
  const int64_t bh = static_cast<int64_t>(task) / j.chunks;
  const int64_t c0 = (static_cast<int64_t>(task) % j.chunks) * kColTile;
  const int64_t nc = std::min<int64_t>(kColTile, j.r - c0);
  const T* probs = j.p + bh * j.rows * j.len;
  const T* vals = j.v + bh * j.cap * j.r + c0;
  T* out = j.out + bh * j.rows * j.r + c0;
  alignas(64) float acc[kRowTile][kColTile];
  for (int64_t row0 = 0; row0 < j.rows; row0 += kRowTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowTile, j.rows - row0));
    if (nc == kColTile) {
      value_tile<true>(nr, probs + row0 * j.len, j.len, vals, j.r, nc, acc);
    } else {
      value_tile<false>(nr, probs + row0 * j.len, j.len, vals, j.r, nc, acc);
    }
    for (int rr = 0; rr < nr; ++rr) {
      for (int64_t c = 0; c < nc; ++c) store(out + (row0 + rr) * j.r, c, acc[rr][c]);
    }
  }
}

template <typename T>
struct ValueKernel {
  explicit ValueKernel(const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto p = ctx.GetInput(0);
    auto v = ctx.GetInput(1);
    const auto ps = p.GetTensorTypeAndShapeInfo().GetShape();
    const auto vs = v.GetTensorTypeAndShapeInfo().GetShape();
    if (ps.size() != 5 || vs.size() != 4 || ps[0] != vs[0] || ps[1] != vs[1] || ps[4] > vs[2]) {
      ORT_CXX_API_THROW("ValueProduct: expected probs [B,Hkv,g,T,L] and value_cache [B,Hkv,C,r] with L <= C",
                        ORT_INVALID_ARGUMENT);
    }
    auto out = ctx.GetOutput(0, std::vector<int64_t>{ps[0], ps[1], ps[2], ps[3], vs[3]});
    const int64_t chunks = (vs[3] + kColTile - 1) / kColTile;
    if (ps[0] * ps[1] * ps[2] * ps[3] == 0 || vs[3] == 0) return;
    ValueJob<T> job{p.GetTensorData<T>(), v.GetTensorData<T>(), out.GetTensorMutableData<T>(), ps[2] * ps[3], ps[4],
                    vs[2], vs[3], chunks};
    ctx.ParallelFor(&value_task<T>, static_cast<size_t>(ps[0] * ps[1] * chunks), 0, &job);
  }
};

template <typename T>
struct ValueOp : CpuOp<ValueOp<T>, ValueKernel<T>, T, 2, 99> {
  const char* GetName() const { return "ValueProduct"; }
};

template <typename T, bool DimMajor>
struct CacheOp : CpuOp<CacheOp<T, DimMajor>, CacheKernel<T, DimMajor>, T, 3, 2> {
  const char* GetName() const { return DimMajor ? "KeyCacheUpdate" : "ValueCacheUpdate"; }
};

std::mutex g_mutex;
std::vector<Ort::CustomOpDomain> g_domains;  // must outlive every session they were added to

}  // namespace

// a variant library is built with -fvisibility=hidden and a version script: only this symbol is exported
#define AQUA_EXPORT __attribute__((visibility("default")))

extern "C" {

// The variant's entry point, called by the loader's RegisterCustomOps (loader.cc) once it chose this variant for
// the CPU: the domain's kernels, compiled for this variant's instruction set, added to the session options.
AQUA_EXPORT OrtStatus* ORT_API_CALL AquaRegisterOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static Op<float> op_f32;
  static Op<Ort::Float16_t> op_f16;
  static CacheOp<float, true> key_f32;
  static CacheOp<Ort::Float16_t, true> key_f16;
  static CacheOp<float, false> value_f32;
  static CacheOp<Ort::Float16_t, false> value_f16;
  static CacheOp<int8_t, true> key_i8;  // an int8 cache's rows (ops.spec): bytes like any other
  static CacheOp<int8_t, false> value_i8;
  static ValueOp<float> product_f32;
  static ValueOp<Ort::Float16_t> product_f16;
  try {
    Ort::CustomOpDomain domain{kDomain};
    domain.Add(&op_f32);
    domain.Add(&op_f16);
    domain.Add(&key_f32);
    domain.Add(&key_f16);
    domain.Add(&value_f32);
    domain.Add(&value_f16);
    domain.Add(&key_i8);
    domain.Add(&value_i8);
    domain.Add(&product_f32);
    domain.Add(&product_f16);
    add_attention_ops(domain);
    add_h2o_ops(domain);
    add_logit_rows_ops(domain);
    add_quantize_rows_ops(domain);
    add_matmul_q4a8_ops(domain);
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}

// Whether this variant runs a prompt_bf16 node's products in bfloat16 on this CPU (simd.h: the width has them and the
// CPU reports them): what runtime.session.prompt_bf16_runs asks through the loader, so Python repeats no CPU test.
AQUA_EXPORT int AquaPromptBf16() { return aqua::simd::bf16_runs() ? 1 : 0; }

// One thread's multiply-add rate on this variant's vectors, measured for about `seconds` (simd.h peak_gflops).
AQUA_EXPORT double AquaPeakGflops(double seconds) { return aqua::simd::peak_gflops(seconds); }

}  // extern "C"
