// The instruction-set layer of the native kernels: everything that depends on the vector width lives in this folder,
// one header per width, and the ops (aqua_ops.h, prompt_tiles.h, prefill_choice.h, matmul_q4a8.cc, ...) are written
// once over what it names. A variant library is the same sources compiled with one -march (CMakeLists.txt); the
// compiler's target macros pick the header here:
//
//   avx512.h    x86-64-v4: 16 lanes (zmm), AVX512-VNNI's vpdpbusd and AVX512_BF16's vdpbf16ps where the CPU has them
//   avx2.h      x86-64-v3: 8 lanes (ymm), FMA, F16C
//   sse4.h      x86-64-v2: 4 lanes (xmm), no FMA (a multiply and an add), no F16C
//   portable.h  anything else (armv8-a: NEON through GCC's vector extensions)
//
// Each width header defines, in aqua::simd:
//   kIsa, kLanes; vf / vi / vu (kLanes float / int32 / uint32 lanes), vb (4 kLanes int8: the int8 products' operand)
//   any_gt(vf, x); fold_max / fold_sum (a panel of 16 lanes in kPanelVecs vectors -> one float, in one fixed order
//   whatever the width: every variant gives the same bits); load_f16 / load_i8 (kLanes cache elements widened);
//   load8_f16 / load8_i8 (8 of them as an f8); the int8 products (DotMadd, DotVnni: 4 bytes a lane summed, partial
//   sums widened into int32 every kGroups groups) and with_int8_dot (which form this CPU runs); the bfloat16 products (kBf16Build, bf16_runs, dot_bf16, ...);
//   and the tuning of each kernel's register tiles for its register file (kTileRows, kTilePanels, kSoftmaxRows,
//   kQ4Rows, kQ4Panels, kProjectVecs, kValueVectors): a width is tuned, and measured, in one place
//   (`python -m tools prompt --variants ...`).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace aqua {
namespace simd {

// float16 bits (in the low half of each uint32 lane of VU) -> float32 lanes (VF), exactly (subnormals, infinities and
// NaN kept), without a branch: the exponent rebased by 112, infinities and NaN by 112 more, and a zero or subnormal
// rescaled by a float subtraction (2^-14 (1 + m) - 2^-14 = 2^-14 m, exact). The widths without F16C widen a float16
// cache with it (sse4.h, portable.h).
template <typename VF, typename VU>
inline VF halves_to_floats(VU h) {
  const VU em = (h & 0x7FFFu) << 13, exp = em & (0x7C00u << 13);
  VU bits = em + ((127u - 15u) << 23);
  bits = exp == (0x7C00u << 13) ? bits + ((128u - 16u) << 23) : bits;
  const VF magic = reinterpret_cast<VF>(VU{} + (113u << 23));
  const VF small = reinterpret_cast<VF>(bits + (1u << 23)) - magic;
  bits = exp == 0u ? reinterpret_cast<VU>(small) : bits;
  return reinterpret_cast<VF>(bits | ((h & 0x8000u) << 16));
}

}  // namespace simd
}  // namespace aqua

#if defined(AQUA_SIMD_PORTABLE)  // emulate.sh: the portable forms on any target
#include "portable.h"
#elif defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include "avx512.h"
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "avx2.h"
#elif defined(__x86_64__) && defined(__SSE4_1__) && defined(__SSSE3__)
#include "sse4.h"
#else
#include "portable.h"
#endif

namespace aqua {
namespace simd {

constexpr int kPanel = 16;                     // columns of a packed panel: the unit the tiles and folds work in
constexpr int kPanelVecs = kPanel / kLanes;    // native vectors a panel spans
static_assert(kPanel % kLanes == 0, "a panel is a whole number of vectors");

// x in every lane (x - 0 is x exactly, so this is one broadcast; 0 + x would turn -0 into +0: an add first)
inline vf splat(float x) { return x - vf{}; }
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf max(vf a, vf b) { return a > b ? a : b; }

// e^x of kLanes floats x <= 8 (the softmax's scores less their row's shift, which may sit up to kShiftSlack = 8
// below the row's maximum: prompt_tiles.h) in float32, within 2 ulp of expf down to -87 and 0 below it (a masked
// score), NaN kept: x = n ln2 + f with |f| <= ln2 / 2, e^f by a degree-6 polynomial (relative error 1.7e-8:
// Lawson's minimax of the relative error, constant term 1, coefficients rounded to float), 2^n written into the
// exponent bits (t = 1.5 2^23 + n holds n in its low bits; any n up to 127 is a normal float). No clamp (x < -87
// takes 0 from the last select whatever the arithmetic gave, and x <= 8 leaves nothing to clamp above); the
// polynomial in Estrin's form: a Horner chain of dependent multiply-adds kept too few vectors in flight.
// Coarse: e^f by a degree-4 polynomial (the same fit, relative error 2.9e-6) for values rounded to bfloat16 next, or
// summed only to compare shares (sparse prefill's estimate): three operations fewer a vector.
template <bool Coarse = false>
inline vf exp(vf x) {
  constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound - kRound rounds x to an integer
  const vf zero{}, lo = zero - 87.0f;
  const vf t = x * kLog2e + kRound;
  const vf n = t - kRound;
  const vf f = (x - n * kLn2Hi) - n * kLn2Lo;
  const vf f2 = f * f;
  vf p;
  if constexpr (Coarse) {
    p = (f * 0.99996686f + 1.0f) + f2 * (f2 * 0.041513849f + (f * 0.16787474f + 0.50003016f));
  } else {
    const vf f4 = f2 * f2;
    p = (f2 * (f * 0.16666432f + 0.49999994f) + (f + 1.0f)) +
        f4 * (f2 * 0.0013843636f + (f * 0.008374154f + 0.041668f));
  }
  const vf scale = reinterpret_cast<vf>((reinterpret_cast<vu>(t) + 127u) << 23);
  return x < lo ? zero : p * scale;
}

// Whether any of a panel's 16 lanes exceeds x.
inline bool any_gt_panel(const vf* p, float x) {
  vf top = p[0];
  for (int v = 1; v < kPanelVecs; ++v) top = max(p[v], top);
  return any_gt(top, x);
}

// The 16 floats at p folded as fold_sum folds a panel.
inline float sum_panel(const float* p) {
  vf v[kPanelVecs];
  for (int u = 0; u < kPanelVecs; ++u) v[u] = load(p + u * kLanes);
  return fold_sum(v);
}

// Rounded to the nearest integer, ties to even, as std::nearbyint in the default rounding mode, for |x| < 2^22
// (int8 quantization's a / s, at most 127.5 in size): adding and taking away 1.5 2^23 leaves the rounded value.
inline vf round_even(vf x) {
  constexpr float kRound = 12582912.0f;
  return (x + kRound) - kRound;
}

// `rounds` x 12 multiply-adds on twelve independent vectors held in registers: x = x * b + c (one FMA where the
// width has it; a multiply and an add where not, as the compiler writes them for the width). peak_gflops' loop;
// twelve named vectors, not an array, which GCC kept in memory around the asm that stops it folding the rounds.
__attribute__((noinline)) inline float multiply_adds(int64_t rounds, float seed) {
  vf x0 = splat(seed), x1 = x0 + 0.001f, x2 = x0 + 0.002f, x3 = x0 + 0.003f, x4 = x0 + 0.004f, x5 = x0 + 0.005f;
  vf x6 = x0 + 0.006f, x7 = x0 + 0.007f, x8 = x0 + 0.008f, x9 = x0 + 0.009f, x10 = x0 + 0.01f, x11 = x0 + 0.011f;
  const vf b = splat(0.9999999f), c = splat(1e-7f);
  for (int64_t n = 0; n < rounds; ++n) {
    x0 = x0 * b + c, x1 = x1 * b + c, x2 = x2 * b + c, x3 = x3 * b + c, x4 = x4 * b + c, x5 = x5 * b + c;
    x6 = x6 * b + c, x7 = x7 * b + c, x8 = x8 * b + c, x9 = x9 * b + c, x10 = x10 * b + c, x11 = x11 * b + c;
    if constexpr (kNativeWidth) {
      __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3), "+x"(x4), "+x"(x5), "+x"(x6), "+x"(x7), "+x"(x8),
                       "+x"(x9), "+x"(x10), "+x"(x11));
    } else {  // emulate.sh's 16 lanes on a narrower target: no register holds one
      __asm__ volatile("" : "+m"(x0), "+m"(x1), "+m"(x2), "+m"(x3), "+m"(x4), "+m"(x5), "+m"(x6), "+m"(x7), "+m"(x8),
                       "+m"(x9), "+m"(x10), "+m"(x11));
    }
  }
  const vf sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) + ((x8 + x9) + (x10 + x11));
  return sum[0];
}

// GFLOP/s one thread reaches on this width's multiply-adds over about `seconds`: the rate the register tiles are
// measured against (`python -m tools prompt`).
inline double peak_gflops(double seconds) {
  const auto start = std::chrono::steady_clock::now();
  int64_t rounds = 0;
  double elapsed = 0.0;
  float sink = 0.0f;
  do {
    sink += multiply_adds(1 << 16, 1.0f);
    rounds += 1 << 16;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  __asm__ volatile("" : : "x"(sink));
  return static_cast<double>(rounds) * 12 * kLanes * 2 / elapsed / 1e9;
}

}  // namespace simd
}  // namespace aqua
