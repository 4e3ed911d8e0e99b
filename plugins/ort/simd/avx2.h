// x86-64-v3 (AVX2, FMA, F16C): 8 float lanes in a ymm register, 16 of them. Included by simd.h only.
#pragma once

#include <immintrin.h>

namespace aqua {
namespace simd {

constexpr const char* kIsa = "AVX2";
constexpr bool kNativeWidth = true;  // a vf is one of the target's registers
constexpr int kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef int8_t vb __attribute__((vector_size(32)));
typedef vf f8;  // the decode kernels' 8 positions: one vector

// The register tiles, for 16 ymm registers (docs/design.md, The prompt kernel's tiles):
//   prompt micro-kernel: 6 rows x 1 panel (16 columns): 12 accumulators, the 2 B vectors and the broadcast A value;
//   softmax: one row at a time (two rows' 16 score vectors of a block do not fit: they went to the stack);
//   MatMulQ4A8: 4 rows x 1 panel, its loop over a block's groups not unrolled (8 int16 partial sums, 4 nibble
//     vectors: 1.22x the 2 x 1 tile on a 2,000-row prompt's products; unrolled, GCC computed a block's products first
//     and spilled them, 1.2x slower);
//   q P: 8 vectors (64 columns) per pass; the value product: NR x kValueVectors accumulators, NR broadcast weights
//   and one V vector (wider tiles spilled the accumulators: a load and a store per multiply-add).
constexpr int kTileRows = 6, kTilePanels = 1;
constexpr int kSoftmaxRows = 1;
constexpr int kQ4Rows = 4, kQ4Panels = 1;
constexpr int kQ4Unroll = 1;  // MatMulQ4A8's loop over a block's groups (see above)
constexpr int kProjectVecs = 8;
template <int NR>
constexpr int kValueVectors = NR == 1 ? 8 : NR == 2 ? 4 : 2;

inline bool any_gt(vf v, float x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<__m256>(v), _mm256_set1_ps(x), _CMP_GT_OQ)) != 0;
}

// A panel (two vectors here) folded as avx512.h folds one: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3).
inline float fold_sum(const vf* p) {
  const vf a = p[0] + p[1];
  typedef float f4 __attribute__((vector_size(16)));
  const f4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float fold_max(const vf* p) {
  const vf a = p[0] > p[1] ? p[0] : p[1];
  typedef float f4 __attribute__((vector_size(16)));
  f4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > d ? c : d;
  return std::max(std::max(c[0], c[2]), std::max(c[1], c[3]));
}

inline vf load_f16(const uint16_t* p) {
  return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_i8(const int8_t* p) {
  return reinterpret_cast<vf>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
inline f8 load8_f16(const uint16_t* p) { return load_f16(p); }
inline f8 load8_i8(const int8_t* p) { return load_i8(p); }

// int8 products (matmul_q4a8.cc): acc's int32 lanes += the sums of 4 adjacent products u * s, u unsigned bytes up
// to 15, s signed. vpmaddubsw sums pairs into int16 (2 x 15 x 127 = 3,810: no saturation), and those stay in int16
// over kGroups groups of 8 inputs (4 x 2 x 3,810 = 30,480 < 2^15) before vpmaddwd widens them into acc: one
// widening a 32-input block, not one a product pair (the multiplier is the unit these products wait on).
struct DotMadd {
  typedef int16_t part_t __attribute__((vector_size(sizeof(vi))));
  static constexpr int kGroups = 4;
  static part_t step(part_t p, vb u, vb s) {
    return p + reinterpret_cast<part_t>(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
  }
  static vi flush(vi acc, part_t p) {
    return acc + reinterpret_cast<vi>(_mm256_madd_epi16(reinterpret_cast<__m256i>(p), _mm256_set1_epi16(1)));
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
