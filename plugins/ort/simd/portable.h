// Any other target (an armv8-a variant: NEON; an x86-64 below v2 is not built): kLanes float lanes in GCC's vector
// extensions, which the compiler maps onto the target's registers, and every other operation as plain code. Included
// by simd.h only.
//
// AQUA_PORTABLE_LANES=16 (with AQUA_PORTABLE_BF16) builds the AVX-512 variant's layout on any CPU: its 16-lane
// panels, its tiles and its bfloat16 path (vdpbf16ps's sums: each product exact in float32, the odd pair's added
// first; vcvtne2ps2bf16's rounding), slowly: plugins/ort/emulate.sh builds it so that a machine without AVX-512 runs
// the numeric tests over the AVX-512 variant's code (all of it but the few instructions avx512.h names).
#pragma once

#ifndef AQUA_PORTABLE_LANES
#define AQUA_PORTABLE_LANES 4
#endif

namespace aqua {
namespace simd {

constexpr const char* kIsa = AQUA_PORTABLE_LANES == 4 ? "portable" : "portable (AVX-512's layout)";
constexpr bool kNativeWidth = AQUA_PORTABLE_LANES == 4;  // a vf is one of the target's registers
constexpr int kLanes = AQUA_PORTABLE_LANES;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef int8_t vb __attribute__((vector_size(4 * kLanes)));
typedef float f8 __attribute__((vector_size(32)));

constexpr bool kWide = kLanes == 16;  // the AVX-512 variant's tiles (avx512.h)
constexpr int kTileRows = kWide ? 8 : 4, kTilePanels = kWide ? 2 : 1;  // 4 x 16: 16 of 32 NEON registers
constexpr int kSoftmaxRows = kWide ? 2 : 1;
constexpr int kQ4Rows = kWide ? 4 : 1, kQ4Panels = kWide ? 2 : 1;
constexpr int kQ4Unroll = 1;  // MatMulQ4A8's loop over a block's groups (see above)
constexpr int kProjectVecs = kWide ? 4 : 8;
template <int NR>
constexpr int kValueVectors = NR == 1 ? 8 : NR == 2 ? 4 : 2;

inline bool any_gt(vf v, float x) {
  bool any = false;
  for (int l = 0; l < kLanes; ++l) any |= v[l] > x;
  return any;
}

// A panel's 16 lanes folded in the order every width folds them (avx512.h): i and i + 8, i and i + 4, then
// (0 + 2) + (1 + 3).
inline float fold_sum(const vf* p) {
  float x[16];
  std::memcpy(x, p, sizeof x);
  float c[4];
  for (int i = 0; i < 4; ++i) c[i] = (x[i] + x[i + 8]) + (x[i + 4] + x[i + 12]);
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline float fold_max(const vf* p) {
  float x[16];
  std::memcpy(x, p, sizeof x);
  float c[4];
  for (int i = 0; i < 4; ++i) {
    const float a = x[i] > x[i + 8] ? x[i] : x[i + 8], b = x[i + 4] > x[i + 12] ? x[i + 4] : x[i + 12];
    c[i] = a > b ? a : b;
  }
  return std::max(std::max(c[0], c[2]), std::max(c[1], c[3]));
}

inline vf load_f16(const uint16_t* p) {
  vu h;
  for (int l = 0; l < kLanes; ++l) h[l] = p[l];
  return halves_to_floats<vf>(h);
}
inline vf load_i8(const int8_t* p) {
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline f8 load8_f16(const uint16_t* p) {
  f8 v;
  for (int l = 0; l < 8; l += kLanes) {
    const vf part = load_f16(p + l);
    for (int e = 0; e < kLanes && l + e < 8; ++e) v[l + e] = part[e];
  }
  return v;
}
inline f8 load8_i8(const int8_t* p) {
  f8 v;
  for (int l = 0; l < 8; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

// int8 products, one lane at a time: acc[l] += sum_i u[4l + i] s[4l + i] (the sums the x86 forms give).
struct DotMadd {
  typedef vi part_t;
  static constexpr int kGroups = 1 << 20;
  static part_t step(part_t acc, vb u, vb s) {
    for (int l = 0; l < kLanes; ++l) {
      int32_t sum = 0;
      for (int i = 0; i < 4; ++i) sum += static_cast<uint8_t>(u[4 * l + i]) * static_cast<int32_t>(s[4 * l + i]);
      acc[l] += sum;
    }
    return acc;
  }
  static vi flush(vi acc, part_t p) { return acc + p; }
};
template <typename F>
inline void with_int8_dot(F&& f) {
  f(DotMadd{});
}

#if defined(AQUA_PORTABLE_BF16)
constexpr bool kBf16Build = true;
inline bool bf16_runs() { return true; }
inline float bf16_at(vb v, int i) {
  uint16_t h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + 2 * i, sizeof h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline vf dot_bf16(vf acc, vb a, vb b) {
  for (int l = 0; l < kLanes; ++l) {
    acc[l] += bf16_at(a, 2 * l + 1) * bf16_at(b, 2 * l + 1);
    acc[l] += bf16_at(a, 2 * l) * bf16_at(b, 2 * l);
  }
  return acc;
}
inline uint16_t round_bf16(float x) {  // nearest even; subnormal values to zero, as vcvtne2ps2bf16
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline void store_bf16_pair(uint16_t* dst, vf x0, vf x1, vf& l) {
  vb pair, ones;  // x0's lanes, then x1's, as bfloat16: summed with ones as vdpbf16ps sums a lane's pair
  uint16_t* h = reinterpret_cast<uint16_t*>(&pair);
  for (int i = 0; i < kLanes; ++i) h[i] = round_bf16(x0[i]), h[kLanes + i] = round_bf16(x1[i]);
  std::memcpy(dst, &pair, sizeof pair);
  for (int i = 0; i < 2 * kLanes; ++i) reinterpret_cast<uint16_t*>(&ones)[i] = 0x3F80;
  l = dot_bf16(l, pair, ones);
}
#else
constexpr bool kBf16Build = false;
inline bool bf16_runs() { return false; }
inline vf dot_bf16(vf acc, vb, vb) { return acc; }
inline void store_bf16_pair(uint16_t*, vf, vf, vf&) {}
#endif

}  // namespace simd
}  // namespace aqua
