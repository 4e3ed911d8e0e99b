// x86-64-v4 (AVX-512 F, BW, CD, DQ, VL): 16 float lanes in a zmm register, 32 of them. Included by simd.h only.
// AVX512-VNNI and AVX512_BF16 are not part of the level: their instructions are written with a target attribute
// or as assembly and run only where the CPU reports them (with_int8_dot, bf16_runs).
#pragma once

#include <immintrin.h>

// GCC 12 warns that _mm512_cvtepi32_ps's own _mm512_undefined_ps() "may be used uninitialized" (its header's
// pass-through operand under an all-ones mask): a false positive in the intrinsics, not in the kernels' values
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace aqua {
namespace simd {

constexpr const char* kIsa = "AVX-512";
constexpr bool kNativeWidth = true;  // a vf is one of the target's registers
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int8_t vb __attribute__((vector_size(64)));
typedef float f8 __attribute__((vector_size(32)));  // the decode kernels' 8 positions (a ymm register)

// The register tiles, for 32 zmm registers (docs/design.md, The prompt kernel's tiles):
//   prompt micro-kernel: 8 rows x 2 panels (32 columns): 16 accumulators, 2 loads of B and 8 broadcasts of A per 16
//     multiply-adds (6 x 32 reached 337 GFLOP/s at 8,000 tokens on 2 cores of an AMD EPYC with 512-bit FMA units,
//     against 201 for 6 x 16; 8 rows because vdpbf16ps takes 6 cycles and issues two a cycle);
//   softmax: 2 rows side by side (the units are not left waiting on one row's rare reduction across lanes);
//   MatMulQ4A8: 4 rows x 2 panels, a block's groups unrolled whole (each accumulator stays in its register: GCC
//     copied the loop-carried ones through others at every group); q P: 4 vectors (64 columns) per pass; the value
//     product: as AVX2's
//     (its f8 rows: kValueVectors in the decode kernels' eight-lane vectors).
constexpr int kTileRows = 8, kTilePanels = 2;
constexpr int kSoftmaxRows = 2;
constexpr int kQ4Rows = 4, kQ4Panels = 2;
constexpr int kQ4Unroll = 16;  // MatMulQ4A8's loop over a block's groups (see above)
constexpr int kProjectVecs = 4;
template <int NR>
constexpr int kValueVectors = NR == 1 ? 8 : NR == 2 ? 4 : 2;

inline bool any_gt(vf v, float x) {
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
}

// A panel (one vector here) folded: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3): the order every
// width folds in.
inline float fold_sum(const vf* p) {
  const vf v = p[0];
  const f8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  typedef float f4 __attribute__((vector_size(16)));
  const f4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float fold_max(const vf* p) {
  const vf v = p[0];
  f8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12,
                                                                                             13, 14, 15);
  a = a > b ? a : b;
  typedef float f4 __attribute__((vector_size(16)));
  f4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > d ? c : d;
  return std::max(std::max(c[0], c[2]), std::max(c[1], c[3]));
}

inline vf load_f16(const uint16_t* p) {
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
inline vf load_i8(const int8_t* p) {
  return reinterpret_cast<vf>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
inline f8 load8_f16(const uint16_t* p) {
  return reinterpret_cast<f8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline f8 load8_i8(const int8_t* p) {
  return reinterpret_cast<f8>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

// int8 products (matmul_q4a8.cc): acc's int32 lanes += the sums of 4 adjacent products u * s, u unsigned bytes up
// to 15, s signed. vpmaddubsw sums pairs into int16 (2 x 15 x 127 = 3,810: no saturation), and those stay in int16
// over kGroups groups of 8 inputs (4 x 2 x 3,810 = 30,480 < 2^15) before vpmaddwd widens them into acc: one
// widening a 32-input block, not one a product pair (the multiplier is the unit these products wait on).
struct DotMadd {
  typedef int16_t part_t __attribute__((vector_size(sizeof(vi))));
  static constexpr int kGroups = 4;
  static part_t step(part_t p, vb u, vb s) {
    return p + reinterpret_cast<part_t>(_mm512_maddubs_epi16(reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)));
  }
  static vi flush(vi acc, part_t p) {
    return acc + reinterpret_cast<vi>(_mm512_madd_epi16(reinterpret_cast<__m512i>(p), _mm512_set1_epi16(1)));
  }
};
struct DotVnni {  // AVX512-VNNI's vpdpbusd: 4 products summed into int32 in one instruction (assembly: its callers
                  // need no target of their own)
  typedef vi part_t;
  static constexpr int kGroups = 1 << 20;
  static part_t step(part_t p, vb u, vb s) {
    __m512i out = reinterpret_cast<__m512i>(p);
    __asm__("vpdpbusd %2, %1, %0" : "+v"(out) : "v"(reinterpret_cast<__m512i>(u)), "v"(reinterpret_cast<__m512i>(s)));
    return reinterpret_cast<vi>(out);
  }
  static vi flush(vi acc, part_t p) { return acc + p; }
};
// f(DotVnni{}) where the CPU has AVX512-VNNI, else f(DotMadd{}).
template <typename F>
inline void with_int8_dot(F&& f) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (vnni) return f(DotVnni{});
  f(DotMadd{});
}

// bfloat16 products (a prompt under prompt_bf16): AVX512_BF16 where the CPU reports it.
constexpr bool kBf16Build = true;
inline bool bf16_runs() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}
// acc += the products of bfloat16 pairs a . b (16 lanes of pairs each), summed in float32: vdpbf16ps, written as
// assembly so that its callers need no target of their own.
inline vf dot_bf16(vf acc, vb a, vb b) {
  __m512 out = reinterpret_cast<__m512>(acc);
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(out) : "v"(reinterpret_cast<__m512i>(a)), "v"(reinterpret_cast<__m512i>(b)));
  return reinterpret_cast<vf>(out);
}
// Two vectors x0, x1 rounded to bfloat16 (nearest even; subnormal values flushed to zero) at dst (x0's lanes, then
// x1's), and their rounded values summed into l pairwise (only l's total is read): vcvtne2ps2bf16 rounds both in one
// instruction, and vdpbf16ps against bfloat16 ones sums them exactly as P V takes them.
inline void store_bf16_pair(uint16_t* dst, vf x0, vf x1, vf& l) {
  __m512i h;
  __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(h) : "v"(reinterpret_cast<__m512>(x1)), "v"(reinterpret_cast<__m512>(x0)));
  std::memcpy(dst, &h, sizeof h);
  l = dot_bf16(l, reinterpret_cast<vb>(h), reinterpret_cast<vb>(_mm512_set1_epi16(0x3F80)));  // bfloat16 1.0
}

}  // namespace simd
}  // namespace aqua
