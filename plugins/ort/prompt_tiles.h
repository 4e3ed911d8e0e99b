// The prompt kernel's matrix products (aqua_prompt.cc): register tiles over panels of 16 columns, in float32 FMAs
// or, under prompt_bf16 on AVX512_BF16, in bfloat16 pairs with float32 sums; the packing into those panels; and the
// online softmax between the two products.

#pragma once

#include "attention_rows.h"

namespace aqua {
namespace prompt {

constexpr int64_t kNR = simd::kPanel;  // columns of a panel (simd.h: one AVX-512 vector, two AVX ones, four SSE)
constexpr int64_t kKeys = 128;         // keys per block of the walk (and of the packed panels)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The micro-kernel's tile: kMR rows x kTilePanels panels, tuned per width in simd/ (avx512.h: 8 x 32 scores in 16 of
// 32 zmm registers; avx2.h: 6 x 16 in 12 of 16 ymm; sse4.h: 2 x 16 in 8 of 16 xmm).
constexpr int kMR = simd::kTileRows;
constexpr int kTilePanels = simd::kTilePanels;
constexpr int kPV = simd::kPanelVecs;  // vectors a panel row spans

// c[MR][16 NP] (+)= a[MR][kk] (rows lda apart) . b: NP panels [kk][16], pstep floats apart; c rows ldc apart.
// Each output element takes the same multiply-adds in the same order whatever NP is (and whatever the width).
template <int MR, int NP, bool Add>
inline void micro(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t pstep, int64_t kk,
                  float* __restrict c, int64_t ldc) {
  simd::vf acc[MR][NP * kPV];
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP * kPV; ++q) {
      acc[i][q] = Add ? simd::load(c + i * ldc + (q / kPV) * kNR + (q % kPV) * simd::kLanes) : simd::vf{};
    }
  }
  int64_t p = 0;
  do {  // kk >= 1 (gemm): a loop that may run zero times kept GCC from holding acc in registers only
    simd::vf bv[NP * kPV];
    for (int q = 0; q < NP * kPV; ++q) bv[q] = simd::load(b + (q / kPV) * pstep + p * kNR + (q % kPV) * simd::kLanes);
    for (int i = 0; i < MR; ++i) {
      const simd::vf x = simd::splat(a[i * lda + p]);
      for (int q = 0; q < NP * kPV; ++q) acc[i][q] += x * bv[q];
    }
  } while (++p < kk);
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP * kPV; ++q) simd::store(c + i * ldc + (q / kPV) * kNR + (q % kPV) * simd::kLanes, acc[i][q]);
  }
}

// C[m][n] (+)= A[m][kk] . B[kk][n], m a multiple of kMR, n of kNR (rows of A lda apart, of C ldc; B in panels
// [n / kNR][kk][kNR]).
// pstride: floats from one panel to the next (0: kk * kNR, panels packed for this kk; a sub-range of another
// block's panels passes its own).
template <bool Add>
void gemm(const float* a, int64_t lda, const float* b, int64_t kk, float* c, int64_t ldc, int64_t m, int64_t n,
          int64_t pstride = 0) {
  if (kk < 1) {  // an empty product (micro runs its loop at least once)
    for (int64_t i = 0; i < m && !Add; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  const int64_t step = pstride > 0 ? pstride : kk * kNR;
  int64_t j0 = 0;
  for (; j0 + kTilePanels * kNR <= n; j0 += kTilePanels * kNR) {
    const float* panel = b + (j0 / kNR) * step;
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      micro<kMR, kTilePanels, Add>(a + i0 * lda, lda, panel, step, kk, c + i0 * ldc + j0, ldc);
    }
  }
  for (; j0 < n; j0 += kNR) {  // a last single panel (two-panel tiles: n an odd multiple of 16)
    const float* panel = b + (j0 / kNR) * step;
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      micro<kMR, 1, Add>(a + i0 * lda, lda, panel, step, kk, c + i0 * ldc + j0, ldc);
    }
  }
}

// bfloat16 products (prompt_bf16): q^, K^, V and the probabilities rounded to bfloat16 (nearest even, as torch's
// .to(torch.bfloat16)), summed in float32 by simd::dot_bf16 (AVX512_BF16's vdpbf16ps: 32 multiply-adds an
// instruction against an FMA's 16, at about the FMA's rate). The operands lie in pairs along the shared dimension:
// A rows [m][kk2 * 2] (a pair broadcast as one 32-bit value), B panels [n / 16][kk2][16][2]. Built where the width
// has them (simd::kBf16Build), run where the CPU does (simd::bf16_runs).
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // finite values: no NaN to keep
}

// How far a block's scores may rise above a row's shift m before m moves (e^8 ~ 3000: P, l and O stay far inside
// float32's range, and bfloat16's, which has float32's exponent). Checking a block against m + kShiftSlack takes
// one vector compare; moving m to the block's maximum takes a reduction across lanes and a rescale of the row's O
// and l, which the sink block, walked first, makes rare.
constexpr float kShiftSlack = 8.0f;

constexpr bool kBf16Build = simd::kBf16Build;

// c[MR][16 NP] (+)= a[MR][2 kk2] (rows lda apart, bfloat16) . b: NP panels [kk2][16][2], pstep apart.
template <int MR, int NP, bool Add>
inline void micro_bf16(const uint16_t* __restrict a, int64_t lda, const uint16_t* __restrict b, int64_t pstep,
                       int64_t kk2, float* __restrict c, int64_t ldc) {
  static_assert(!kBf16Build || kPV == 1, "bfloat16 tiles: one vector a panel row (AVX-512)");
  simd::vf acc[MR][NP];
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) acc[i][q] = Add ? simd::load(c + i * ldc + q * kNR) : simd::vf{};
  }
  int64_t p = 0;
  do {  // kk2 >= 1 (gemm_bf16): a loop that may run zero times kept GCC from holding acc in registers only
    simd::vb bv[NP];
    for (int q = 0; q < NP; ++q) std::memcpy(&bv[q], b + q * pstep + p * 2 * kNR, sizeof bv[q]);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
      const simd::vb x = reinterpret_cast<simd::vb>(simd::vu{} + pair);
      for (int q = 0; q < NP; ++q) acc[i][q] = simd::dot_bf16(acc[i][q], x, bv[q]);
    }
  } while (++p < kk2);
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) simd::store(c + i * ldc + q * kNR, acc[i][q]);
  }
}

// gemm's bfloat16 form: C[m][n] (+)= A[m][2 kk2] . B (panels [n / kNR][kk2][kNR][2], pstride apart; 0: kk2 * 2kNR).
template <bool Add>
void gemm_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kk2, float* c, int64_t ldc, int64_t m,
               int64_t n, int64_t pstride = 0) {
  if constexpr (kBf16Build) {
    if (kk2 < 1) {  // an empty product (micro_bf16 runs its loop at least once)
      for (int64_t i = 0; i < m && !Add; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
      return;
    }
    const int64_t step = pstride > 0 ? pstride : kk2 * 2 * kNR;
    int64_t j0 = 0;
    for (; j0 + 2 * kNR <= n; j0 += 2 * kNR) {
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        micro_bf16<kMR, 2, Add>(a + i0 * lda, lda, b + (j0 / kNR) * step, step, kk2, c + i0 * ldc + j0, ldc);
      }
    }
    for (; j0 < n; j0 += kNR) {
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        micro_bf16<kMR, 1, Add>(a + i0 * lda, lda, b + (j0 / kNR) * step, step, kk2, c + i0 * ldc + j0, ldc);
      }
    }
  }
}

// Panels [n / kNR][kk][kNR] (float32) -> their bfloat16 pairs [n / kNR][kk2][kNR][2], kk2 = ceil(kk / 2) (an odd
// kk's last pair ends in zero).
inline void pair_panels(const float* src, int64_t n, int64_t kk, uint16_t* dst) {
  const int64_t kk2 = (kk + 1) / 2;
  for (int64_t j = 0; j < n / kNR; ++j) {
    const float* sp = src + j * kk * kNR;
    uint16_t* dp = dst + j * kk2 * 2 * kNR;
    for (int64_t p = 0; p < kk2 * 2; ++p) {
      for (int64_t l = 0; l < kNR; ++l) dp[(p / 2) * 2 * kNR + l * 2 + (p & 1)] = p < kk ? to_bf16(sp[p * kNR + l]) : 0;
    }
  }
}

// rows [m][width] float32 (lda apart) -> bfloat16 [m][width2] (width2 even, zeros past width).
inline void to_bf16_rows(const float* src, int64_t lda, int64_t m, int64_t width, uint16_t* dst, int64_t width2) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < width; ++c) dst[i * width2 + c] = to_bf16(src[i * lda + c]);
    std::fill(dst + i * width2 + width, dst + (i + 1) * width2, static_cast<uint16_t>(0));
  }
}

// row[0..width) (a multiple of kNR) into column `col` of panels [width / kNR][kk][kNR]: chunk j of the row is
// row `col` of panel j.
inline void to_panels(const float* row, int64_t width, float* panels, int64_t kk, int64_t col) {
  for (int64_t j = 0; j < width; j += kNR) std::memcpy(panels + j * kk + col * kNR, row + j, sizeof(float) * kNR);
}

// dst[0..n) = src[0..n) as float32, each times scale[i] when given (an int8 cache's K^ row: its tokens' scales;
// exact, powers of two), then zeros up to `width`.
template <typename C>
inline void widen_row(const C* src, int64_t n, float* dst, int64_t width, const float* scale = nullptr) {
  if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    widen(src, n, dst);
  }
  if (scale != nullptr) {
    for (int64_t i = 0; i < n; ++i) dst[i] *= scale[i];
  }
  std::fill(dst + n, dst + width, 0.0f);
}

// N rows' online softmax over a block of n keys (n <= 16 NP, the block's width of NP panels): row i's scores
// s[i kKeys ..) (masked: -inf) -> e^(s - m) with the row's shift m[i], l and the row's output o[i rvp ..) updated. m
// moves only when a score passes m + kShiftSlack (or m is -inf: nothing seen yet), to the block's maximum, with O and
// l rescaled; otherwise the e^ are up to e^kShiftSlack, which the final O / l cancels. A row that sees nothing of the
// block is left as it was, its e^ 0. l is kept per panel lane, l[i 16 ..): summed across lanes once, after the walk
// (simd::fold_sum). The e^ go back into s in float32, or, BF16, into p16[i kKeys ..) as bfloat16 (to_bf16's
// rounding), their e^ by the coarse polynomial (2.9e-6 relative, under bfloat16's 2^-9), l then summing the rounded
// P: the weights P V takes, so O / l weighs V by P / sum P whatever the rounding (a row whose mass is one key's gives
// that key's V row, where a sum of the unrounded e^ left the key's own rounding in, up to 2^-9 of it: with the shift
// lazy, the largest e^ is no longer 1, which bfloat16 holds exactly). 0 past n up to the width either way. N rows
// side by side (simd::kSoftmaxRows): where the registers hold them, the units are not left waiting on one row's rare
// reduction; the scores are read twice (the maximum, then the e^), from L1.
template <int N, int NP, bool BF16>
inline void softmax_rows(float* s, int64_t n, float* m, float* l, float* o, int64_t rvp, uint16_t* p16) {
  using simd::kLanes;
  using simd::vf;
  constexpr int NV = NP * kPV;  // vectors a row of the block spans
  typedef int32_t lanes_t __attribute__((vector_size(sizeof(vf))));
  lanes_t lane;
  for (int e = 0; e < kLanes; ++e) lane[e] = e;
  const vf none = simd::splat(-INFINITY);
  // row i's vector v, -inf past n (e^ 0)
  const auto score = [&](int i, int v) {
    const vf x = simd::load(s + i * kKeys + kLanes * v);
    return kLanes * v + kLanes > n ? (lane + kLanes * v < static_cast<int32_t>(n) ? x : none) : x;
  };
  vf top[N][kPV];
  for (int i = 0; i < N; ++i) {
    for (int u = 0; u < kPV; ++u) top[i][u] = none;
    for (int v = 0; v < NV; ++v) top[i][v % kPV] = simd::max(score(i, v), top[i][v % kPV]);
  }
  for (int i = 0; i < N; ++i) {
    if (simd::any_gt_panel(top[i], m[i] + kShiftSlack)) {  // -inf + slack: any key seen moves m
      const float m_new = simd::fold_max(top[i]);
      if (m[i] != -INFINITY) {
        const float alpha = std::exp(m[i] - m_new);
        for (int64_t c = 0; c < rvp; ++c) o[i * rvp + c] *= alpha;
        for (int64_t c = 0; c < kNR; ++c) l[i * kNR + c] *= alpha;
      }
      m[i] = m_new;
    }
    const vf shift = simd::splat(m[i] == -INFINITY ? 0.0f : m[i]);
    vf acc[kPV];
    for (int u = 0; u < kPV; ++u) acc[u] = simd::load(l + i * kNR + u * kLanes);
    if constexpr (BF16) {  // l sums the P that P V takes
      static_assert(!kBf16Build || (kPV == 1 && NV % 2 == 0), "bfloat16 P in pairs of vectors");
      for (int v = 0; v < NV; v += 2) {
        simd::store_bf16_pair(p16 + i * kKeys + kLanes * v, simd::exp<true>(score(i, v) - shift),
                              simd::exp<true>(score(i, v + 1) - shift), acc[0]);
      }
    } else {
      for (int v = 0; v < NV; ++v) {
        const vf e = simd::exp(score(i, v) - shift);
        simd::store(s + i * kKeys + kLanes * v, e);
        acc[v % kPV] += e;
      }
    }
    for (int u = 0; u < kPV; ++u) simd::store(l + i * kNR + u * kLanes, acc[u]);
  }
}

// Rows [0, rows) of a block's scores (kKeys apart, width kKeys or kPrefillBlock) through softmax_rows,
// simd::kSoftmaxRows at a time; BF16: into p16.
template <int NP, bool BF16>
inline void softmax_group(float* s, int64_t rows, int64_t n, float* m, float* l, float* o, int64_t rvp,
                          uint16_t* p16) {
  constexpr int N = simd::kSoftmaxRows;
  int64_t row = 0;
  for (; row + N <= rows; row += N) {
    softmax_rows<N, NP, BF16>(s + row * kKeys, n, m + row, l + row * kNR, o + row * rvp, rvp,
                              BF16 ? p16 + row * kKeys : nullptr);
  }
  for (; row < rows; ++row) {
    softmax_rows<1, NP, BF16>(s + row * kKeys, n, m + row, l + row * kNR, o + row * rvp, rvp,
                              BF16 ? p16 + row * kKeys : nullptr);
  }
}
template <bool BF16>
inline void softmax_block(float* s, int64_t rows, int64_t n, int64_t width, float* m, float* l, float* o,
                          int64_t rvp, uint16_t* p16) {
  if constexpr (BF16 && !kBf16Build) {
    return;  // never called: a prompt_bf16 node runs float32 products where the width has no bfloat16 ones
  } else if (width == kKeys) {
    softmax_group<kKeys / kNR, BF16>(s, rows, n, m, l, o, rvp, p16);
  } else {
    softmax_group<kPrefillBlock / kNR, BF16>(s, rows, n, m, l, o, rvp, p16);
  }
}

}  // namespace prompt
}  // namespace aqua
