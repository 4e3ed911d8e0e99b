// x86-64-v2 (SSE4.2, SSSE3, POPCNT): 4 float lanes in an xmm register, 16 of them; no FMA (a multiply, then an
// add: two instructions, each with its own rounding) and no F16C. Included by simd.h only.
#pragma once

#include <immintrin.h>

namespace aqua {
namespace simd {

constexpr const char* kIsa = "SSE4.2";
constexpr bool kNativeWidth = true;  // a vf is one of the target's registers
constexpr int kLanes = 4;
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
typedef int8_t vb __attribute__((vector_size(16)));
typedef float f8 __attribute__((vector_size(32)));  // the decode kernels' 8 positions: two vectors (GCC splits them)

// The register tiles, for 16 xmm registers (docs/design.md, The prompt kernel's tiles):
//   prompt micro-kernel: TILE_ROWS rows x 1 panel (16 columns, 4 vectors a row);
//   softmax: one row at a time; MatMulQ4A8: 2 rows x 1 panel, not unrolled (1.10x one row);
//   q P: 8 vectors (32 columns) per pass, so that the broadcast and a product's copy fit beside them.
#ifndef AQUA_SSE_TILE_ROWS
#define AQUA_SSE_TILE_ROWS 2
#endif
constexpr int kTileRows = AQUA_SSE_TILE_ROWS, kTilePanels = 1;
constexpr int kSoftmaxRows = 1;
constexpr int kQ4Rows = 2, kQ4Panels = 1;
constexpr int kQ4Unroll = 1;  // MatMulQ4A8's loop over a block's groups (see above)
constexpr int kProjectVecs = 8;
template <int NR>
constexpr int kValueVectors = NR == 1 ? 8 : NR == 2 ? 4 : 2;

inline bool any_gt(vf v, float x) {
  return _mm_movemask_ps(_mm_cmpgt_ps(reinterpret_cast<__m128>(v), _mm_set1_ps(x))) != 0;
}

// A panel (four vectors here) folded as avx512.h folds one: lanes i and i + 8, then i and i + 4, then
// (0 + 2) + (1 + 3).
inline float fold_sum(const vf* p) {
  const vf c = (p[0] + p[2]) + (p[1] + p[3]);
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float fold_max(const vf* p) {
  const vf a = p[0] > p[2] ? p[0] : p[2], b = p[1] > p[3] ? p[1] : p[3];
  const vf c = a > b ? a : b;
  return std::max(std::max(c[0], c[2]), std::max(c[1], c[3]));
}

// Two vectors as the decode kernels' f8, through memory: GCC assembled a shuffle of them into a 32-byte vector lane by
// lane (an extract and a store each), where two stores and the f8's two loads are what its own lowering does anyway.
inline f8 join8(vf lo, vf hi) {
  alignas(32) float x[8];
  std::memcpy(x, &lo, sizeof lo);
  std::memcpy(x + 4, &hi, sizeof hi);
  f8 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline vf load_f16(const uint16_t* p) {  // 4 halves in one load, widened to 32-bit lanes, converted in registers
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return halves_to_floats<vf>(reinterpret_cast<vu>(_mm_unpacklo_epi16(h, _mm_setzero_si128())));
}
inline vf load_i8(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return reinterpret_cast<vf>(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(w))));
}
inline f8 load8_f16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), z = _mm_setzero_si128();
  const vf lo = halves_to_floats<vf>(reinterpret_cast<vu>(_mm_unpacklo_epi16(h, z)));
  const vf hi = halves_to_floats<vf>(reinterpret_cast<vu>(_mm_unpackhi_epi16(h, z)));
  return join8(lo, hi);
}
inline f8 load8_i8(const int8_t* p) { return join8(load_i8(p), load_i8(p + 4)); }

// int8 products (matmul_q4a8.cc): acc's int32 lanes += the sums of 4 adjacent products u * s, u unsigned bytes up
// to 15, s signed. pmaddubsw sums pairs into int16 (2 x 15 x 127 = 3,810: no saturation), and those stay in int16
// over kGroups groups of 8 inputs (4 x 2 x 3,810 = 30,480 < 2^15) before pmaddwd widens them into acc: one
// widening a 32-input block, not one a product pair (the multiplier is the unit these products wait on).
struct DotMadd {
  typedef int16_t part_t __attribute__((vector_size(sizeof(vi))));
  static constexpr int kGroups = 4;
  static part_t step(part_t p, vb u, vb s) {
    return p + reinterpret_cast<part_t>(_mm_maddubs_epi16(reinterpret_cast<__m128i>(u), reinterpret_cast<__m128i>(s)));
  }
  static vi flush(vi acc, part_t p) {
    return acc + reinterpret_cast<vi>(_mm_madd_epi16(reinterpret_cast<__m128i>(p), _mm_set1_epi16(1)));
  }
};
template <typename F>
inline void with_int8_dot(F&& f) {
  f(DotMadd{});
}

// No bfloat16 products at this width: a prompt_bf16 node runs its products in float32 (attention_rows.h).
constexpr bool kBf16Build = false;
inline bool bf16_runs() { return false; }
inline vf dot_bf16(vf acc, vb, vb) { return acc; }
inline void store_bf16_pair(uint16_t*, vf, vf, vf&) {}

}  // namespace simd
}  // namespace aqua
