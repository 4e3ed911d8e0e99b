// MatMulQ4A8 (aqua_export/ops/matmul_q4a8.py): a [..., K] float32 x int4 weights in MatMulNBits' symmetric format
// (packed uint8 [N, K / block, block / 2], scales float32 [N, K / block]) -> y [..., N] float32,
// the activations rounded to int8 per block of the weights' (ops.rules.int8_groups):
//
//   s[m, j] = max |a[m, block j]| / 127     q[m, k] = clamp(round(a[m, k] / s[m, j]), +-127)  (0 where s is 0)
//   y[m, n] = sum_j s[m, j] w_scale[n, j] sum_{k in j} q[m, k] (nibble[n, k] - 8)
//
// The sums over a block are integer products (simd.h: AVX-512 VNNI's vpdpbusd, else vpmaddubsw and
// vpmaddwd) of the unsigned nibbles (0..15) and the signed q, four at a time, and 8 sum_k q[m, k] per block,
// subtracted once, makes them the signed weights' products. So a prompt's products run on the integer units at
// several times the float32 rate (tools/studies/activation_levels_study.py measures it).
//
// MatMulQ4A8Gated (the same module's GATED): the product over a gated MLP's stacked [gate; up] weights (N = 2 I), its
// output y [..., I] = silu(gate) * up, applied as each tile is stored: the packing pairs gate's panel of 16 columns
// with up's panel of the same 16 outputs, so a tile of 32 columns holds both halves of its 16 outputs.
//
// The weights are repacked once per node, as the session is made when they are initializers (else on the first
// run; again only if another buffer comes): 16 columns a panel, 8 inputs a group, each group 64 bytes where byte
// 4c + i holds column c's inputs 8u + i (low nibble) and 8u + 4 + i (high nibble), so one load and two masks give
// two vpdpbusd operands of 16 columns x 4 inputs. Columns past N are zero-scaled padding.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "aqua_ops.h"

namespace {

using namespace aqua;

constexpr int64_t kPanel = 16;          // columns a packed panel holds (one 512-bit lane set of int32 sums)
constexpr int64_t kGroup = 8;           // inputs a packed group holds (two 4-input quads)
constexpr int64_t kRowsPerTask = 64;    // rows of one task: their int8 activations stay in L2 across the columns
constexpr int64_t kColsPerTask = 256;   // columns of one task: its weights stay in L2 across the rows
constexpr int64_t kMinTasks = 16;       // tasks a product is cut into at least, where its columns allow

struct Packed {
  std::vector<uint8_t> groups;  // [panels][K / 8][64]
  std::vector<float> scales;    // [panels][K / block][16]
  int64_t panels = 0;
};

// The activations of M rows as int8 blocks: q [M, K], scale [M, K / block], offset [M, K / block] = -8 sum q.
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset;
};

struct QuantJob {
  const float* a;
  Rows* rows;
  int64_t m, k, block;
};

// One block of a row: its scale and int8 values (the same float32 operations as the function body: Abs,
// ReduceMax, Div by 127, Div, Round half to even, Clip), and -8 times their sum; a vector at a time.
void quantize_block(const float* a, int64_t block, int8_t* q, float* scale, int32_t* offset) {
  using simd::kLanes;
  using simd::vf;
  typedef int8_t bytes_t __attribute__((vector_size(kLanes)));
  const simd::vu magnitude = simd::vu{} + 0x7FFFFFFFu;
  vf top{};
  int64_t i = 0;
  for (; i + kLanes <= block; i += kLanes) {
    top = simd::max(reinterpret_cast<vf>(reinterpret_cast<simd::vu>(simd::load(a + i)) & magnitude), top);
  }
  float amax = 0.0f;
  for (int l = 0; l < kLanes; ++l) amax = std::max(amax, top[l]);
  for (int64_t t = i; t < block; ++t) amax = std::max(amax, std::fabs(a[t]));
  const float s = amax / 127.0f;
  if (s == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(block));
    *scale = 0.0f;
    *offset = 0;
    return;
  }
  const vf sv = simd::splat(s), lo = simd::splat(-127.0f), hi = simd::splat(127.0f);
  simd::vi sum{};
  for (i = 0; i + kLanes <= block; i += kLanes) {
    vf r = simd::round_even(simd::load(a + i) / sv);  // |a / s| <= 127.5: round_even is nearbyint there
    r = r < lo ? lo : r;
    r = r > hi ? hi : r;
    const simd::vi v = __builtin_convertvector(r, simd::vi);
    const bytes_t b = __builtin_convertvector(v, bytes_t);
    std::memcpy(q + i, &b, sizeof b);
    sum += v;
  }
  int32_t total = 0;
  for (int l = 0; l < kLanes; ++l) total += sum[l];
  for (; i < block; ++i) {
    const float v = std::clamp(std::nearbyint(a[i] / s), -127.0f, 127.0f);
    q[i] = static_cast<int8_t>(v);
    total += static_cast<int32_t>(v);
  }
  *scale = s;
  *offset = -8 * total;
}

void quantize_task(void* data, size_t task) {
  const auto& j = *static_cast<const QuantJob*>(data);
  const int64_t nb = j.k / j.block, r0 = static_cast<int64_t>(task) * kRowsPerTask;
  for (int64_t m = r0; m < std::min(j.m, r0 + kRowsPerTask); ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = m * j.k + b * j.block;
      quantize_block(j.a + at, j.block, j.rows->q.data() + at, j.rows->scale.data() + m * nb + b,
                     j.rows->offset.data() + m * nb + b);
    }
  }
}

struct ProductJob {
  const Rows* rows;
  const Packed* w;
  float* y;
  int64_t m, n, k, block, col_tasks, cols;  // cols: columns a task takes (a multiple of 32)
  bool gated;  // MatMulQ4A8Gated: y [m][n / 2], each tile's two panels gate's and up's columns of 16 outputs
};

// silu(g) * u for 16 columns: g / (1 + e^-g) as e = e^-|g| (simd::exp takes x <= 0), g e / (1 + e) below zero.
inline void gate16(const float* g, const float* u, float* y, int64_t width) {
  using simd::vf;
  alignas(64) float out[kPanel];
  for (int v = 0; v < simd::kPanelVecs; ++v) {
    const vf x = simd::load(g + v * simd::kLanes), e = simd::exp(vf{} - (x < 0 ? -x : x)), one = simd::splat(1.0f);
    const vf sig = x < 0 ? e / (one + e) : one / (one + e);
    simd::store(out + v * simd::kLanes, x * sig * simd::load(u + v * simd::kLanes));
  }
  std::memcpy(y, out, sizeof(float) * width);
}

// R rows x NP panels (16 NP columns from panel p) over all K into out [R][2 kPanel] (column 16 (p - first) on): the
// int32 sums of a block start at -8 sum q and take the block's products (Dot: simd.h's int8 product forms, partial
// sums over Dot::kGroups groups, then widened); each block's sums are scaled into float32 accumulators. A 64-byte group of a panel is kIV int vectors (kLanes columns x 4
// inputs each). PB: groups a block holds when known at compile time (0: j.block / kGroup), so the loop over a block's
// groups unrolls whole and each accumulator stays in its register (GCC copied the loop-carried ones through others at
// every group). R and NP: simd::kQ4Rows, kQ4Panels, the width's tile.
template <int R, int NP, typename Dot, int PB>
inline void tile(const ProductJob& j, int64_t m0, int64_t p, float* out) {
  using simd::vb;
  using simd::vf;
  using simd::vi;
  constexpr int kIV = simd::kPanelVecs, NQ = NP * kIV;
  const int64_t nb = j.k / j.block, groups = j.k / kGroup, per_block = PB > 0 ? PB : j.block / kGroup;
  const Rows& rows = *j.rows;
  vf f[R][NQ];
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NQ; ++c) f[r][c] = vf{};
    q[r] = rows.q.data() + (m0 + r) * j.k;
  }
  const vb low = vb{} + 0x0F;
  const uint8_t* w = j.w->groups.data() + p * groups * 64;
  for (int64_t b = 0; b < nb; ++b) {
    vi acc[R][NQ];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NQ; ++c) acc[r][c] = vi{} + rows.offset[(m0 + r) * nb + b];
    }
    for (int64_t g0 = 0; g0 < per_block; g0 += Dot::kGroups) {  // the partial sums' span (simd.h: Dot::kGroups)
      typename Dot::part_t part[R][NQ];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < NQ; ++c) part[r][c] = typename Dot::part_t{};
      }
      const int64_t g1 = std::min<int64_t>(per_block, g0 + Dot::kGroups);
#pragma GCC unroll simd::kQ4Unroll
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t u = b * per_block + g;
        vb lo[NQ], hi[NQ];
        for (int c = 0; c < NQ; ++c) {
          vb x;
          std::memcpy(&x, w + (c / kIV) * groups * 64 + u * 64 + (c % kIV) * sizeof(vb), sizeof x);
          lo[c] = x & low;
          hi[c] = reinterpret_cast<vb>(reinterpret_cast<simd::vu>(x) >> 4) & low;  // each byte's high nibble
        }
        for (int r = 0; r < R; ++r) {
          int32_t lo_q, hi_q;
          std::memcpy(&lo_q, q[r] + u * kGroup, 4);
          std::memcpy(&hi_q, q[r] + u * kGroup + 4, 4);
          const vb a0 = reinterpret_cast<vb>(vi{} + lo_q), a1 = reinterpret_cast<vb>(vi{} + hi_q);
          for (int c = 0; c < NQ; ++c) part[r][c] = Dot::step(Dot::step(part[r][c], lo[c], a0), hi[c], a1);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < NQ; ++c) acc[r][c] = Dot::flush(acc[r][c], part[r][c]);
      }
    }
    vf sc[NQ];
    for (int c = 0; c < NQ; ++c) {
      sc[c] = simd::load(j.w->scales.data() + ((p + c / kIV) * nb + b) * kPanel + (c % kIV) * simd::kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const vf as = simd::splat(rows.scale[(m0 + r) * nb + b]);
      for (int c = 0; c < NQ; ++c) f[r][c] += __builtin_convertvector(acc[r][c], vf) * (sc[c] * as);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NQ; ++c) simd::store(out + r * kPanel * 2 + c * simd::kLanes, f[r][c]);
  }
}

// f(std::integral_constant<int, PB>) with PB the groups of a weight block of `block` inputs (16, 32, 64, 128:
// the ones quantize.BLOCKS makes), or 0 for any other: tile's loop over a block's groups then unrolls whole.
template <typename F>
inline void by_block(int64_t block, F&& f) {
  switch (block / kGroup) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// R rows x 32 columns (panels p, p + 1) into out [R][32], as the width's tiles (kQ4Rows x kQ4Panels) cover them.
template <int R, typename Dot, int PB>
void tile_rows(const ProductJob& j, int64_t m0, int64_t p, float* out) {
  constexpr int R0 = R < simd::kQ4Rows ? R : simd::kQ4Rows;
  for (int64_t pp = 0; pp < 2; pp += simd::kQ4Panels) {
    tile<R0, simd::kQ4Panels, Dot, PB>(j, m0, p + pp, out + pp * kPanel);
  }
  if constexpr (R > R0) tile_rows<R - R0, Dot, PB>(j, m0 + R0, p, out + R0 * 2 * kPanel);
}

template <int R>
void run_tile(const ProductJob& j, int64_t m0, int64_t p, float* out) {
  simd::with_int8_dot([&](auto dot) {
    by_block(j.block, [&](auto pb) { tile_rows<R, decltype(dot), decltype(pb)::value>(j, m0, p, out); });
  });
}

void product_task(void* data, size_t task) {
  const auto& j = *static_cast<const ProductJob*>(data);
  const int64_t rt = static_cast<int64_t>(task) / j.col_tasks, ct = static_cast<int64_t>(task) % j.col_tasks;
  const int64_t r0 = rt * kRowsPerTask, r1 = std::min(j.m, r0 + kRowsPerTask);
  const int64_t p_end = std::min(j.w->panels, (ct + 1) * (j.cols / kPanel));
  alignas(64) float out[4 * 2 * kPanel];
  const int64_t out_n = j.gated ? j.n / 2 : j.n;
  for (int64_t p = ct * (j.cols / kPanel); p < p_end; p += 2) {
    const int64_t c0 = (j.gated ? p / 2 : p) * kPanel;
    const int64_t width = std::min<int64_t>(j.gated ? kPanel : 2 * kPanel, out_n - c0);
    for (int64_t m = r0; m < r1; m += 4) {
      const int64_t rows = std::min<int64_t>(4, r1 - m);
      switch (rows) {
        case 4: run_tile<4>(j, m, p, out); break;
        case 3: run_tile<3>(j, m, p, out); break;
        case 2: run_tile<2>(j, m, p, out); break;
        default: run_tile<1>(j, m, p, out); break;
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* y = j.y + (m + r) * out_n + c0;
        if (j.gated) {
          gate16(out + r * 2 * kPanel, out + r * 2 * kPanel + kPanel, y, width);
        } else {
          std::memcpy(y, out + r * 2 * kPanel, sizeof(float) * width);
        }
      }
    }
  }
}

struct Q4A8Kernel {
  Q4A8Kernel(const OrtKernelInfo* info, bool gated) : gated_(gated) {
    Ort::ConstKernelInfo ki(info);
    k_ = ki.GetAttribute<int64_t>("K");
    n_ = ki.GetAttribute<int64_t>("N");
    block_ = ki.GetAttribute<int64_t>("block_size");
    if (k_ < 1 || n_ < 1 || block_ < kGroup || block_ % kGroup != 0 || k_ % block_ != 0) {
      ORT_CXX_API_THROW("MatMulQ4A8: K and N must be >= 1, block_size a multiple of 8 dividing K",
                        ORT_INVALID_ARGUMENT);
    }
    if (gated_ && n_ % 2 != 0) {
      ORT_CXX_API_THROW("MatMulQ4A8Gated: N must be even (gate's columns, then up's)", ORT_INVALID_ARGUMENT);
    }
    prepack(ki);
  }

  // Weights that are initializers are packed here, as the session is made (where ORT packs MatMulNBits' and
  // OpenVINO compiles): the first prompt then does not wait on it (~0.1 s of an 8k first token on the embedded
  // model). Compute finds the same buffers and keeps the copy; weights fed as inputs are packed on their first run.
  void prepack(const Ort::ConstKernelInfo& ki) {
    int b_const = 0, s_const = 0;
    Ort::ConstValue b{nullptr}, s{nullptr};
    try {
      b = ki.GetTensorConstantInput(1, &b_const);
      s = ki.GetTensorConstantInput(2, &s_const);
    } catch (const Ort::Exception&) {
      return;  // a runtime that cannot say: packed on the first run, as before
    }
    if (b_const && s_const && fits(b.GetTensorTypeAndShapeInfo().GetShape(),
                                   s.GetTensorTypeAndShapeInfo().GetElementCount())) {  // else Compute refuses them
      packed(b.GetTensorData<uint8_t>(), s.GetTensorData<float>());
    }
  }

  // Whether b's shape and the scales' count are MatMulNBits' blocks of this node's K, N and block size.
  bool fits(const std::vector<int64_t>& b_shape, size_t scales) const {
    return b_shape == std::vector<int64_t>{n_, k_ / block_, block_ / 2} &&
           scales == static_cast<size_t>(n_ * (k_ / block_));
  }

  // The weight row (column of the product) packed at (panel, col), or -1 for padding: 16 columns a panel in order,
  // or, gated, panel 2i gate's outputs 16i.. and panel 2i + 1 up's of the same outputs.
  int64_t source(int64_t panel, int64_t col) const {
    if (!gated_) return panel * kPanel + col < n_ ? panel * kPanel + col : -1;
    const int64_t out = (panel / 2) * kPanel + col, half = n_ / 2;
    return out < half ? out + (panel % 2) * half : -1;
  }

  // MatMulNBits' blocks [N, K / block, block / 2] and scales [N, K / block] -> panels of 16 columns (Packed).
  std::shared_ptr<const Packed> pack(const uint8_t* b, const float* scales) const {
    auto out = std::make_shared<Packed>();
    Packed& w = *out;
    const int64_t nb = k_ / block_, groups = k_ / kGroup;
    const int64_t outs = gated_ ? n_ / 2 : n_, per_pair = gated_ ? kPanel : 2 * kPanel;
    w.panels = 2 * ((outs + per_pair - 1) / per_pair);  // whole pairs: a tile reads two panels
    w.groups.assign(w.panels * groups * 64, 0x88);     // padding columns: nibble 8, weight 0
    w.scales.assign(w.panels * nb * kPanel, 0.0f);
    for (int64_t at = 0; at < w.panels * kPanel; ++at) {
      const int64_t panel = at / kPanel, col = at % kPanel, n = source(panel, col);
      if (n < 0) continue;
      const uint8_t* row = b + n * (k_ / 2);
      const auto nibble = [&](int64_t k) { return (k & 1) ? row[k / 2] >> 4 : row[k / 2] & 0x0F; };
      for (int64_t u = 0; u < groups; ++u) {
        for (int i = 0; i < 4; ++i) {
          w.groups[(panel * groups + u) * 64 + col * 4 + i] =
              static_cast<uint8_t>(nibble(8 * u + i) | (nibble(8 * u + 4 + i) << 4));
        }
      }
      for (int64_t j = 0; j < nb; ++j) w.scales[(panel * nb + j) * kPanel + col] = scales[n * nb + j];
    }
    return out;
  }

  // The packed weights of these inputs: packed once (prepack, or the first run) and again only when another buffer
  // comes (a model feeding its weights as inputs).
  std::shared_ptr<const Packed> packed(const uint8_t* b, const float* scales) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!packed_ || b != packed_b_ || scales != packed_scales_) {
      packed_ = pack(b, scales);
      packed_b_ = b;
      packed_scales_ = scales;
    }
    return packed_;
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0), b = ctx.GetInput(1), scales = ctx.GetInput(2);
    auto shape = a.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t nb = k_ / block_;
    if (shape.empty() || shape.back() != k_ ||
        !fits(b.GetTensorTypeAndShapeInfo().GetShape(), scales.GetTensorTypeAndShapeInfo().GetElementCount())) {
      ORT_CXX_API_THROW("MatMulQ4A8: expected a [..., K], b [N, K / block_size, block_size / 2] uint8 and scales "
                        "[N, K / block_size]", ORT_INVALID_ARGUMENT);
    }
    const std::shared_ptr<const Packed> w = packed(b.GetTensorData<uint8_t>(), scales.GetTensorData<float>());
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    shape.back() = gated_ ? n_ / 2 : n_;
    auto y = ctx.GetOutput(0, shape);
    if (m == 0) return;
    Rows rows;
    rows.q.resize(m * k_);
    rows.scale.resize(m * nb);
    rows.offset.resize(m * nb);
    const size_t row_tasks = static_cast<size_t>((m + kRowsPerTask - 1) / kRowsPerTask);
    QuantJob qj{a.GetTensorData<float>(), &rows, m, k_, block_};
    if (row_tasks == 1) {
      quantize_task(&qj, 0);  // a decode step's few rows: not worth a dispatch to the pool
    } else {
      ctx.ParallelFor(&quantize_task, row_tasks, 0, &qj);
    }
    // columns per task: kColsPerTask, narrower when there are few row tasks (a decode step: one), so that the
    // pool's threads still get about kMinTasks tasks to share
    const int64_t padded = w->panels * kPanel, per = (kMinTasks + static_cast<int64_t>(row_tasks) - 1) /
                                                      static_cast<int64_t>(row_tasks);
    const int64_t cols = std::clamp<int64_t>((padded / per + 2 * kPanel - 1) / (2 * kPanel) * 2 * kPanel,
                                             2 * kPanel, kColsPerTask);
    const int64_t col_tasks = (padded + cols - 1) / cols;
    ProductJob pj{&rows, w.get(), y.GetTensorMutableData<float>(), m, n_, k_, block_, col_tasks, cols, gated_};
    ctx.ParallelFor(&product_task, row_tasks * static_cast<size_t>(col_tasks), 0, &pj);
  }

 private:
  bool gated_;
  int64_t k_ = 0, n_ = 0, block_ = 0;
  std::mutex mutex_;
  std::shared_ptr<const Packed> packed_;
  const uint8_t* packed_b_ = nullptr;
  const float* packed_scales_ = nullptr;
};

struct Q4A8Op : Ort::CustomOpBase<Q4A8Op, Q4A8Kernel> {
  explicit Q4A8Op(bool gated) : gated_(gated) {}
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new Q4A8Kernel(info, gated_); }
  const char* GetName() const { return gated_ ? "MatMulQ4A8Gated" : "MatMulQ4A8"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  bool gated_;
};

}  // namespace

namespace aqua {

void add_matmul_q4a8_ops(Ort::CustomOpDomain& domain) {
  static Q4A8Op op(false), gated(true);
  domain.Add(&op);
  domain.Add(&gated);
}

}  // namespace aqua
