// MatMulQ4A8 (aqua_export/ops/matmul_q4a8.py): a [..., K] float32 x int4 weights in MatMulNBits' symmetric format
// (packed uint8 [N, K / block, block / 2], scales float32 [N, K / block]) -> y [..., N] float32,
// the activations rounded to int8 per block of the weights' (ops.rules.int8_groups):
//
//   s[m, j] = max |a[m, block j]| / 127     q[m, k] = clamp(round(a[m, k] / s[m, j]), +-127)  (0 where s is 0)
//   y[m, n] = sum_j s[m, j] w_scale[n, j] sum_{k in j} q[m, k] (nibble[n, k] - 8)
//
// The sums over a block are integer products: AVX-512 VNNI's vpdpbusd multiplies the unsigned nibbles (0..15) by the
// signed q four at a time, and 8 sum_k q[m, k] per block, subtracted once, makes them the signed weights' products
// (without VNNI, vpmaddubsw and vpmaddwd: 15 x 127 x 2 cannot saturate 16 bits). So a prompt's products run on the
// integer units at several times the float32 rate (tools/studies/activation_levels_study.py measures it).
//
// MatMulQ4A8Gated (the same module's GATED): the product over a gated MLP's stacked [gate; up] weights (N = 2 I), its
// output y [..., I] = silu(gate) * up, applied as each tile is stored: the packing pairs gate's panel of 16 columns
// with up's panel of the same 16 outputs, so a tile of 32 columns holds both halves of its 16 outputs.
//
// The weights are repacked once per node, as the session is made when they are initializers (else on the first
// run; again only if another buffer comes): 16 columns a panel, 8 inputs a group, each group 64 bytes where byte
// 4c + i holds column c's inputs 8u + i (low nibble) and 8u + 4 + i (high nibble), so one load and two masks give
// two vpdpbusd operands of 16 columns x 4 inputs. Columns past N are zero-scaled padding.

// GCC 12 warns that _mm512_cvtepi32_ps's own _mm512_undefined_ps() "may be used uninitialized" (its header's
// pass-through operand under an all-ones mask): a false positive in the intrinsics, not in this file's values
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
// ReduceMax, Div by 127, Div, Round half to even, Clip), and -8 times their sum.
void quantize_block(const float* a, int64_t block, int8_t* q, float* scale, int32_t* offset) {
  float amax = 0.0f;
  for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(a[i]));
  const float s = amax / 127.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < block; ++i) {
    const float v = s == 0.0f ? 0.0f : std::clamp(std::nearbyint(a[i] / s), -127.0f, 127.0f);
    q[i] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
  *scale = s;
  *offset = -8 * sum;
}

#if defined(__AVX512F__)
// The same operations 16 values at a time (division, round to nearest even, clamp: the same float32 results).
void quantize_block16(const float* a, int64_t block, int8_t* q, float* scale, int32_t* offset) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < block; i += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(a + i)));
  const float s = _mm512_reduce_max_ps(amax) / 127.0f;
  if (s == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(block));
    *scale = 0.0f;
    *offset = 0;
    return;
  }
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < block; i += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(a + i), sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(v));
    sum = _mm512_add_epi32(sum, v);
  }
  *scale = s;
  *offset = -8 * _mm512_reduce_add_epi32(sum);
}
#endif

void quantize_task(void* data, size_t task) {
  const auto& j = *static_cast<const QuantJob*>(data);
  const int64_t nb = j.k / j.block, r0 = static_cast<int64_t>(task) * kRowsPerTask;
  for (int64_t m = r0; m < std::min(j.m, r0 + kRowsPerTask); ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = m * j.k + b * j.block;
      int8_t* q = j.rows->q.data() + at;
      float* scale = j.rows->scale.data() + m * nb + b;
      int32_t* offset = j.rows->offset.data() + m * nb + b;
#if defined(__AVX512F__)
      if (j.block % 16 == 0) {
        quantize_block16(j.a + at, j.block, q, scale, offset);
        continue;
      }
#endif
      quantize_block(j.a + at, j.block, q, scale, offset);
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

// silu(g) * u for 16 columns: g / (1 + e^-g) as e = e^-|g| (exp_lanes takes x <= 0), g e / (1 + e) below zero.
inline void gate16(const float* g, const float* u, float* y, int64_t width) {
  const f16v x = load16(g), e = exp_lanes<f16v, u16v>(f16v{} - (x < 0 ? -x : x)), one = f16v{} + 1.0f;
  const f16v sig = x < 0 ? e / (one + e) : one / (one + e);
  alignas(64) float out[kPanel];
  store16(out, x * sig * load16(u));
  std::memcpy(y, out, sizeof(float) * width);
}

#if defined(__AVX512BW__)
// R rows x 32 columns (panels p, p + 1) over all K: the int32 sums of a block start at -8 sum q and take the
// block's products; each block's sums are scaled into float32 accumulators. PB: groups a block holds when known
// at compile time (0: j.block / kGroup), so the loop over a block's groups unrolls whole and each accumulator
// stays in its register (GCC copied the loop-carried ones through others at every group).
template <int R, bool VNNI, int PB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile(const ProductJob& j, int64_t m0, int64_t p,
                                                                          float* out) {
  const int64_t nb = j.k / j.block, groups = j.k / kGroup, per_block = PB > 0 ? PB : j.block / kGroup;
  const Rows& rows = *j.rows;
  __m512 f[R][2];
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) {
    f[r][0] = f[r][1] = _mm512_setzero_ps();
    q[r] = rows.q.data() + (m0 + r) * j.k;
  }
  const __m512i low = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
  const uint8_t* w0 = j.w->groups.data() + p * groups * 64;
  const uint8_t* w1 = w0 + groups * 64;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_set1_epi32(rows.offset[(m0 + r) * nb + b]);
#pragma GCC unroll 16
    for (int64_t g = 0; g < per_block; ++g) {
      const int64_t u = b * per_block + g;
      const __m512i x0 = _mm512_loadu_si512(w0 + u * 64), x1 = _mm512_loadu_si512(w1 + u * 64);
      const __m512i l0 = _mm512_and_si512(x0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(x0, 4), low);
      const __m512i l1 = _mm512_and_si512(x1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(x1, 4), low);
      for (int r = 0; r < R; ++r) {
        int32_t lo_q, hi_q;
        std::memcpy(&lo_q, q[r] + u * kGroup, 4);
        std::memcpy(&hi_q, q[r] + u * kGroup + 4, 4);
        const __m512i a0 = _mm512_set1_epi32(lo_q), a1 = _mm512_set1_epi32(hi_q);
        if constexpr (VNNI) {
          acc[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][0], l0, a0), h0, a1);
          acc[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][1], l1, a0), h1, a1);
        } else {
          const auto dot = [&](__m512i w, __m512i a) { return _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), ones); };
          acc[r][0] = _mm512_add_epi32(acc[r][0], _mm512_add_epi32(dot(l0, a0), dot(h0, a1)));
          acc[r][1] = _mm512_add_epi32(acc[r][1], _mm512_add_epi32(dot(l1, a0), dot(h1, a1)));
        }
      }
    }
    const __m512 s0 = _mm512_loadu_ps(j.w->scales.data() + (p * nb + b) * kPanel);
    const __m512 s1 = _mm512_loadu_ps(j.w->scales.data() + ((p + 1) * nb + b) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 as = _mm512_set1_ps(rows.scale[(m0 + r) * nb + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s0, as), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(s1, as), f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * kPanel * 2, f[r][0]);
    _mm512_storeu_ps(out + r * kPanel * 2 + kPanel, f[r][1]);
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

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
// AVX2: R rows (<= 2, sixteen registers) x one panel of 16 columns, as two 8-column halves of each 64-byte group.
template <int R>
inline void tile_avx2(const ProductJob& j, int64_t m0, int64_t p, float* out) {
  const int64_t nb = j.k / j.block, groups = j.k / kGroup, per_block = j.block / kGroup;
  const Rows& rows = *j.rows;
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* w = j.w->groups.data() + p * groups * 64;
  const auto dot = [&](__m256i wv, __m256i a) { return _mm256_madd_epi16(_mm256_maddubs_epi16(wv, a), ones); };
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(rows.offset[(m0 + r) * nb + b]);
    for (int64_t u = b * per_block; u < (b + 1) * per_block; ++u) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * 64));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * 64 + 32));
      const __m256i l0 = _mm256_and_si256(x0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), low);
      const __m256i l1 = _mm256_and_si256(x1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = rows.q.data() + (m0 + r) * j.k + u * kGroup;
        int32_t lo_q, hi_q;
        std::memcpy(&lo_q, q, 4);
        std::memcpy(&hi_q, q + 4, 4);
        const __m256i a0 = _mm256_set1_epi32(lo_q), a1 = _mm256_set1_epi32(hi_q);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_add_epi32(dot(l0, a0), dot(h0, a1)));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_add_epi32(dot(l1, a0), dot(h1, a1)));
      }
    }
    const float* sc = j.w->scales.data() + (p * nb + b) * kPanel;
    const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 as = _mm256_set1_ps(rows.scale[(m0 + r) * nb + b]);
      f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, as), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, as), f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel * 2, f[r][0]);
    _mm256_storeu_ps(out + r * kPanel * 2 + 8, f[r][1]);
  }
}
#endif

#if defined(__SSSE3__) && !defined(__AVX2__)
// SSSE3 (x86-64-v2): one row x one panel of 16 columns, as four 4-column quarters of each 64-byte group.
inline void tile_ssse3(const ProductJob& j, int64_t m, int64_t p, float* out) {
  const int64_t nb = j.k / j.block, groups = j.k / kGroup, per_block = j.block / kGroup;
  const Rows& rows = *j.rows;
  __m128 f[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  const __m128i low = _mm_set1_epi8(0x0F), ones = _mm_set1_epi16(1);
  const uint8_t* w = j.w->groups.data() + p * groups * 64;
  for (int64_t b = 0; b < nb; ++b) {
    __m128i acc[4];
    for (auto& x : acc) x = _mm_set1_epi32(rows.offset[m * nb + b]);
    for (int64_t u = b * per_block; u < (b + 1) * per_block; ++u) {
      const int8_t* q = rows.q.data() + m * j.k + u * kGroup;
      int32_t lo_q, hi_q;
      std::memcpy(&lo_q, q, 4);
      std::memcpy(&hi_q, q + 4, 4);
      const __m128i a0 = _mm_set1_epi32(lo_q), a1 = _mm_set1_epi32(hi_q);
      for (int c = 0; c < 4; ++c) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + u * 64 + c * 16));
        const __m128i l = _mm_and_si128(x, low), h = _mm_and_si128(_mm_srli_epi16(x, 4), low);
        acc[c] = _mm_add_epi32(acc[c], _mm_add_epi32(_mm_madd_epi16(_mm_maddubs_epi16(l, a0), ones),
                                                     _mm_madd_epi16(_mm_maddubs_epi16(h, a1), ones)));
      }
    }
    const float* sc = j.w->scales.data() + (p * nb + b) * kPanel;
    const __m128 as = _mm_set1_ps(rows.scale[m * nb + b]);
    for (int c = 0; c < 4; ++c) {
      f[c] = _mm_add_ps(f[c], _mm_mul_ps(_mm_cvtepi32_ps(acc[c]), _mm_mul_ps(_mm_loadu_ps(sc + 4 * c), as)));
    }
  }
  for (int c = 0; c < 4; ++c) _mm_storeu_ps(out + 4 * c, f[c]);
}
#endif

// The portable tile: the same integer sums and float32 scaling, one column at a time.
template <int R>
void tile_portable(const ProductJob& j, int64_t m0, int64_t p, float* out) {
  const int64_t nb = j.k / j.block, groups = j.k / kGroup;
  const Rows& rows = *j.rows;
  for (int64_t c = 0; c < 2 * kPanel; ++c) {
    const int64_t panel = p + c / kPanel, col = c % kPanel;
    const uint8_t* w = j.w->groups.data() + panel * groups * 64 + col * 4;
    for (int r = 0; r < R; ++r) {
      float f = 0.0f;
      const int8_t* q = rows.q.data() + (m0 + r) * j.k;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t acc = rows.offset[(m0 + r) * nb + b];
        for (int64_t u = b * (j.block / kGroup); u < (b + 1) * (j.block / kGroup); ++u) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[u * 64 + i];
            acc += (byte & 0x0F) * q[u * kGroup + i] + (byte >> 4) * q[u * kGroup + 4 + i];
          }
        }
        f += static_cast<float>(acc) * (j.w->scales[(panel * nb + b) * kPanel + col] * rows.scale[(m0 + r) * nb + b]);
      }
      out[r * kPanel * 2 + c] = f;
    }
  }
}

// R rows x 32 columns (panels p, p + 1) into out [R][32], by the widest tile this build has.
template <int R>
void run_tile(const ProductJob& j, int64_t m0, int64_t p, float* out) {
#if defined(__AVX512BW__)
  if (has_vnni()) return by_block(j.block, [&](auto pb) { tile<R, true, decltype(pb)::value>(j, m0, p, out); });
  by_block(j.block, [&](auto pb) { tile<R, false, decltype(pb)::value>(j, m0, p, out); });
#elif defined(__AVX2__)
  float half[2 * 2 * kPanel];
  for (int r = 0; r < R; r += 2) {
    for (int64_t panel = 0; panel < 2; ++panel) {
      if (R - r >= 2) {
        tile_avx2<2>(j, m0 + r, p + panel, half);
      } else {
        tile_avx2<1>(j, m0 + r, p + panel, half);
      }
      for (int i = 0; i < std::min(2, R - r); ++i) {
        std::memcpy(out + (r + i) * 2 * kPanel + panel * kPanel, half + i * 2 * kPanel, sizeof(float) * kPanel);
      }
    }
  }
#elif defined(__SSSE3__)
  for (int r = 0; r < R; ++r) {
    for (int64_t panel = 0; panel < 2; ++panel) tile_ssse3(j, m0 + r, p + panel, out + r * 2 * kPanel + panel * kPanel);
  }
#else
  tile_portable<R>(j, m0, p, out);
#endif
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
