// SIMD and element types: GCC/Clang vector extensions as wide as the target's
// registers (16 floats with AVX-512, else 8), lane-wise helpers (splat, reduce,
// nan_max, load, store, vexp), and bfloat16 widened to and rounded from float32.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <cstdint>
#include <limits>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));

// x in every lane. `x - 0` is x for every float (-0 and NaN too), so it compiles to one
// broadcast (from memory inside the products), where `vf{} + x` costs an add first.
inline vf splat(float x) { return x - vf{}; }
inline vi splat_int(int32_t x) { return x - vi{}; }

// One lane from all: op folded over halves (16 -> 8 -> 4 -> 2 -> 1 lanes), log2(VW)
// vector steps instead of VW scalar ones.
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
template <class Op>
inline float reduce(vf x, Op op) {
#if defined(__AVX512F__)
  v8 h = op(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
            __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  v8 h = x;
#endif
  v4 f = op(__builtin_shufflevector(h, h, 0, 1, 2, 3), __builtin_shufflevector(h, h, 4, 5, 6, 7));
  f = op(f, __builtin_shufflevector(f, f, 2, 3, 0, 1));
  f = op(f, __builtin_shufflevector(f, f, 1, 0, 3, 2));
  return f[0];
}

// Lane-wise max that keeps NaN (a NaN in either argument wins).
template <class V>
inline V nan_max(V a, V b) {
  return (a > b) | (a != a) ? a : b;
}
inline float nan_max(float a, float b) {
  if (a != a) return a;
  return b > a || b != b ? b : a;
}
inline float hmax(vf x) { return reduce(x, [](auto a, auto b) { return nan_max(a, b); }); }
inline float hsum(vf x) { return reduce(x, [](auto a, auto b) { return a + b; }); }

// ---------------------------------------------------------------------------
// Element types: float32, or bfloat16 (uint16_t, the FFI's storage for it: the high
// half of a float32). Inputs are widened to float32 when packed; outputs are rounded
// to nearest, ties to even, a NaN staying a (quiet) NaN.

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return __builtin_bit_cast(float, uint32_t{x} << 16); }

template <class Out>
inline Out narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline uint16_t narrow<uint16_t>(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  if (x != x) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }

constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(x) to about 1 ulp (Cephes' polynomial on x - n ln 2); 0 below -87.3, which
// covers -inf. Inputs here are logits minus a running maximum: never above 0 by
// more than rounding.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f), hi = splat(88.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = xc * 1.44269504088896341f + magic;
  vf n = t - magic;
  vi ni = __builtin_bit_cast(vi, t) - 0x4B400000;
  vf r = xc - n * 0.693359375f - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (ni + 127) << 23;
  vf y = p * __builtin_bit_cast(vf, bits);
  return x < lo ? vf{} : y;
}

}  // namespace
