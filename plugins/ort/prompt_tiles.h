// The prompt kernel's matrix products (aqua_prompt.cc): register tiles over panels of 16 columns, in float32 FMAs
// or, under prompt_bf16 on AVX512_BF16, in bfloat16 pairs with float32 sums; the packing into those panels; and the
// online softmax between the two products.

#pragma once

#include "attention_rows.h"

namespace aqua {
namespace prompt {

constexpr int64_t kNR = 16;           // columns of a panel (one AVX-512 vector, two AVX ones)
constexpr int64_t kKeys = 128;        // keys per block of the walk (and of the packed panels)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Panels a micro-kernel tile spans and its rows kMR: two panels where a panel row is one register (AVX-512: 8 x 32
// scores in 16 of its 32 registers, 2 loads of B and 8 broadcasts of A per 16 multiply-adds), one elsewhere (AVX2:
// 6 x 16 in 12 of its 16). The 6 x 16 tile used half of an AVX-512 CPU's vector width: one layer's prompt attention
// at 8,000 tokens ran at 201 GFLOP/s on 2 cores of an AMD EPYC with 512-bit FMA units, where ORT's SGEMM reaches
// ~400; 337 with a 6 x 32 tile (`python -m tools prompt`). 8 rows, not 6: vdpbf16ps takes 6 cycles and issues two a
// cycle, so 12 accumulators left its units idle about a tenth of the time (docs/design.md).
#if defined(__AVX512F__)
constexpr int kTilePanels = 2;
constexpr int kMR = 8;
#else
constexpr int kTilePanels = 1;
constexpr int kMR = 6;
#endif

// c[MR][16 NP] (+)= a[MR][kk] (rows lda apart) . b: NP panels [kk][16], pstep floats apart; c rows ldc apart.
// Each output element takes the same multiply-adds in the same order whatever NP is.
template <int MR, int NP, bool Add>
inline void micro(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t pstep, int64_t kk,
                  float* __restrict c, int64_t ldc) {
  f16v acc[MR][NP];
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) acc[i][q] = Add ? load16(c + i * ldc + q * kNR) : f16v{};
  }
  int64_t p = 0;
  do {  // kk >= 1 (gemm): a loop that may run zero times kept GCC from holding acc in registers only
    f16v bv[NP];
    for (int q = 0; q < NP; ++q) bv[q] = load16(b + q * pstep + p * kNR);
    for (int i = 0; i < MR; ++i) {
      const float x = a[i * lda + p];
      for (int q = 0; q < NP; ++q) acc[i][q] += x * bv[q];
    }
  } while (++p < kk);
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) store16(c + i * ldc + q * kNR, acc[i][q]);
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
  for (; j0 < n; j0 += kNR) {  // a last single panel (AVX-512: n an odd multiple of 16)
    const float* panel = b + (j0 / kNR) * step;
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      micro<kMR, 1, Add>(a + i0 * lda, lda, panel, step, kk, c + i0 * ldc + j0, ldc);
    }
  }
}

// bfloat16 products (prompt_bf16): q^, K^, V and the probabilities rounded to bfloat16 (nearest even, as torch's
// .to(torch.bfloat16)), summed in float32 by AVX512_BF16's vdpbf16ps: 32 multiply-adds an instruction against an
// FMA's 16, at about the FMA's rate. The operands lie in pairs along the shared dimension: A rows [m][kk2 * 2]
// (a pair broadcast as one 32-bit value), B panels [n / 16][kk2][16][2].
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

// Whether any lane of v exceeds x.
inline bool any_above(f16v v, float x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
#else
  return tree_max(v) > x;
#endif
}

// Thirty-two floats x0, x1 -> bfloat16 at dst (x0's sixteen, then x1's), as to_bf16 rounds each (nearest even), and
// their rounded values summed into l's lanes (pairwise: only l's total is read). Only on a CPU with AVX512_BF16 (the
// prompt's bfloat16 path): vcvtne2ps2bf16 rounds both vectors in one instruction, and vdpbf16ps against bfloat16
// ones sums the rounded values exactly as P V will take them, in one more; both written as assembly so the functions
// they are inlined into need no target of their own. vcvtne2ps2bf16 differs from to_bf16 only on subnormal values,
// which it flushes to zero (an e^ below 2^-126 in a sum of e^ that holds at least 1).
inline void store_bf16_pair(uint16_t* dst, f16v x0, f16v x1, f16v& l) {
#if defined(__AVX512F__)
  __m512i h;
  __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(h) : "v"(reinterpret_cast<__m512>(x1)), "v"(reinterpret_cast<__m512>(x0)));
  std::memcpy(dst, &h, sizeof h);
  const __m512i ones = _mm512_set1_epi16(0x3F80);  // bfloat16 1.0
  __m512 acc = reinterpret_cast<__m512>(l);
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(h), "v"(ones));
  l = reinterpret_cast<f16v>(acc);
#else
  typedef uint16_t h16 __attribute__((vector_size(32)));
  for (int half = 0; half < 2; ++half) {
    const u16v bits = reinterpret_cast<u16v>(half == 0 ? x0 : x1);
    const h16 h = __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, h16);
    std::memcpy(dst + 16 * half, &h, sizeof h);
    l += reinterpret_cast<f16v>(__builtin_convertvector(h, u16v) << 16);
  }
#endif
}

#if defined(__AVX512F__)
constexpr bool kBf16Build = true;

// c[MR][16 NP] (+)= a[MR][2 kk2] (rows lda apart, bfloat16) . b: NP panels [kk2][16][2], pstep apart.
template <int MR, int NP, bool Add>
__attribute__((target("avx512f,avx512bf16"))) inline void micro_bf16(const uint16_t* __restrict a, int64_t lda,
                                                                      const uint16_t* __restrict b, int64_t pstep,
                                                                      int64_t kk2, float* __restrict c, int64_t ldc) {
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) acc[i][q] = Add ? _mm512_loadu_ps(c + i * ldc + q * kNR) : _mm512_setzero_ps();
  }
  int64_t p = 0;
  do {  // kk2 >= 1 (gemm_bf16): a loop that may run zero times kept GCC from holding acc in registers only
    __m512bh bv[NP];
    for (int q = 0; q < NP; ++q) bv[q] = (__m512bh)_mm512_loadu_si512(b + q * pstep + p * 2 * kNR);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], x, bv[q]);
    }
  } while (++p < kk2);
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + i * ldc + q * kNR, acc[i][q]);
  }
}

// gemm's bfloat16 form: C[m][n] (+)= A[m][2 kk2] . B (panels [n / kNR][kk2][kNR][2], pstride apart; 0: kk2 * 2kNR).
template <bool Add>
void gemm_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kk2, float* c, int64_t ldc, int64_t m,
               int64_t n, int64_t pstride = 0) {
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
#else
constexpr bool kBf16Build = false;
template <bool Add>
void gemm_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t = 0) {}
#endif

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

// N rows' online softmax over a block of n keys (n <= 16 NV, the block's width): row i's scores s[i kKeys ..)
// (masked: -inf) -> e^(s - m) with the row's shift m[i], l and the row's output o[i rvp ..) updated. m moves only
// when a score passes m + kShiftSlack (or m is -inf: nothing seen yet), to the block's maximum, with O and l
// rescaled; otherwise the e^ are up to e^kShiftSlack, which the final O / l cancels. A row that sees nothing of the
// block is left as it was, its e^ 0. l is kept per lane, l[i 16 ..): summed across lanes once, after the walk. The
// e^ go back into s in float32, or, BF16, into p16[i kKeys ..) as bfloat16 (to_bf16's rounding), their e^ by
// exp_lanes' coarse polynomial (2.9e-6 relative, under bfloat16's 2^-9), l then summing the rounded P: the weights
// P V takes, so O / l weighs V by P / sum P whatever the rounding (a row whose mass is one key's gives that key's V
// row, where a sum of the unrounded e^ left the key's own rounding in, up to 2^-9 of it: with the shift lazy, the
// largest e^ is no longer 1, which bfloat16 holds exactly). 0 past n up to the width either way. Two rows side by
// side: the units are not left waiting on one row's rare reduction.
template <int N, int NV, bool BF16>
inline void softmax_rows(float* s, int64_t n, float* m, float* l, float* o, int64_t rvp, uint16_t* p16) {
  typedef int32_t i16v __attribute__((vector_size(64)));
  const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f16v none = f16v{} - INFINITY;
  f16v x[N][NV], top[N];
  for (int i = 0; i < N; ++i) {
    top[i] = none;
    for (int v = 0; v < NV; ++v) {
      const f16v xv = load16(s + i * kKeys + 16 * v);
      x[i][v] = 16 * v + 16 > n ? (lane + 16 * v < static_cast<int32_t>(n) ? xv : none) : xv;  // past n: e^ 0
      top[i] = x[i][v] > top[i] ? x[i][v] : top[i];
    }
  }
  for (int i = 0; i < N; ++i) {
    if (any_above(top[i], m[i] + kShiftSlack)) {  // -inf + slack: any key seen moves m
      const float m_new = tree_max(top[i]);
      if (m[i] != -INFINITY) {
        const float alpha = std::exp(m[i] - m_new);
        for (int64_t c = 0; c < rvp; ++c) o[i * rvp + c] *= alpha;
        store16(l + i * 16, load16(l + i * 16) * alpha);
      }
      m[i] = m_new;
    }
    const f16v shift = f16v{} + (m[i] == -INFINITY ? 0.0f : m[i]);
    f16v acc = load16(l + i * 16);
    if constexpr (BF16) {  // l sums the P that P V takes
      static_assert(NV % 2 == 0, "bfloat16 P in pairs of vectors");
      for (int v = 0; v < NV; v += 2) {
        store_bf16_pair(p16 + i * kKeys + 16 * v, exp_lanes<f16v, u16v, true>(x[i][v] - shift),
                        exp_lanes<f16v, u16v, true>(x[i][v + 1] - shift), acc);
      }
    } else {
      for (int v = 0; v < NV; ++v) {
        const f16v e = exp_lanes<f16v, u16v>(x[i][v] - shift);
        store16(s + i * kKeys + 16 * v, e);
        acc += e;
      }
    }
    store16(l + i * 16, acc);
  }
}

// Rows [0, rows) of a block's scores (kKeys apart, width kKeys or kPrefillBlock) through softmax_rows, two at a
// time; BF16: into p16.
template <int NV, bool BF16>
inline void softmax_pairs(float* s, int64_t rows, int64_t n, float* m, float* l, float* o, int64_t rvp,
                          uint16_t* p16) {
  int64_t row = 0;
  for (; row + 2 <= rows; row += 2) {
    softmax_rows<2, NV, BF16>(s + row * kKeys, n, m + row, l + row * 16, o + row * rvp, rvp,
                              BF16 ? p16 + row * kKeys : nullptr);
  }
  if (row < rows) {
    softmax_rows<1, NV, BF16>(s + row * kKeys, n, m + row, l + row * 16, o + row * rvp, rvp,
                              BF16 ? p16 + row * kKeys : nullptr);
  }
}
template <bool BF16>
inline void softmax_block(float* s, int64_t rows, int64_t n, int64_t width, float* m, float* l, float* o,
                          int64_t rvp, uint16_t* p16) {
  if (width == kKeys) {
    softmax_pairs<kKeys / 16, BF16>(s, rows, n, m, l, o, rvp, p16);
  } else {
    softmax_pairs<kPrefillBlock / 16, BF16>(s, rows, n, m, l, o, rvp, p16);
  }
}

}  // namespace prompt
}  // namespace aqua
