// SIMD and element types: GCC/Clang vector extensions as wide as the target's
// registers (16 floats with AVX-512, else 8), lane-wise helpers (splat, reduce,
// nan_max, load, store, vexp), and bfloat16 widened to and rounded from float32.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// Keeps x in a register where it is: the compiler would rather load it again from
// memory at each use (once per query vector of a register tile of products), which
// makes the products wait on loads.
inline void in_register(vf& x) { asm volatile("" : "+v"(x)); }

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

#if defined(__AVX512F__)
// The steps of hsum8 and hsum16 on AVX-512: each adds the two halves of every lane group
// of a and of b, a's sums in the low half of the result, b's in the high.
inline vf fold8(vf a, vf b) {  // [a 8 | b 8]
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
inline vf fold4(vf a, vf b) {  // [a 4 | b 4 | c 4 | d 4] from a = [a 8 | b 8], b = [c 8 | d 8]
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                 31);
}
inline vf fold2(vf a, vf b) {  // [a 2 | b 2 | ... | h 2]
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                 31);
}
inline vf fold1(vf a, vf b) {  // [a | b | ... | p]: one sum a lane
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

// The lane sums of sixteen vectors as one vector, lane k the sum of x[k]: pairs of
// vectors folded in a tree (no lane leaves a register).
inline vf hsum16(const vf (&x)[16]) {
  vf h[8], q[4];
  for (int k = 0; k < 8; ++k) h[k] = fold8(x[2 * k], x[2 * k + 1]);
  for (int k = 0; k < 4; ++k) q[k] = fold4(h[2 * k], h[2 * k + 1]);
  return fold1(fold2(q[0], q[1]), fold2(q[2], q[3]));
}
#endif

// The lane sums of eight vectors at once, sums[k] of x[k]: halves of pairs of vectors
// added in a tree (3 steps of shuffles shared by all eight, then one within a vector),
// about a third of the work of eight hsum.
inline void hsum8(const vf (&x)[8], float* sums) {
#if defined(__AVX512F__)
  vf h[4];
  for (int k = 0; k < 4; ++k) h[k] = fold8(x[2 * k], x[2 * k + 1]);
  const vf e = fold2(fold4(h[0], h[1]), fold4(h[2], h[3]));
  const v8 sum = __builtin_shufflevector(e, e, 0, 2, 4, 6, 8, 10, 12, 14) +
                 __builtin_shufflevector(e, e, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  vf h[4], q[2];
  for (int k = 0; k < 4; ++k)  // [a 4 | b 4]
    h[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)  // [a 2 | b 2 | c 2 | d 2]
    q[k] = __builtin_shufflevector(h[2 * k], h[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * k], h[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  const v8 sum = __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                 __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
  for (int k = 0; k < 8; ++k) sums[k] = sum[k];
}

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
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;

// c[0] r^(D-1) + c[1] r^(D-2) + ... + c[D-1], by Horner's rule (unrolled: D is known).
template <int D>
inline vf horner(vf r, const float (&c)[D]) {
  vf p = splat(c[0]);
  for (int i = 1; i < D; ++i) p = p * r + c[i];
  return p;
}

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
  vf p = horner(r, {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                    1.6666665459e-1f, 5.0000001201e-1f});
  p = p * r * r + r + 1.0f;
  vi bits = (ni + 127) << 23;
  vf y = p * __builtin_bit_cast(vf, bits);
  return x < lo ? vf{} : y;
}

// 2^x to about 3 ulp: x = n + r with n an integer and |r| <= 1/2, 2^r by a polynomial of
// degree 5 (fitted to the relative error on [-1/2, 1/2]: at most 2.4e-7 in float32; degree
// 6 gave 1e-7 for one more multiply-add in the forward pass's busiest loop), times 2^n.
// 0 below -126 (covers -inf; AVX-512's scalef gives the subnormals down to -150), NaN
// stays NaN. Half the instructions of vexp: the forward pass keeps its logits in units of
// log2 e (the factor folded into the queries' scale) so that no range reduction by ln 2
// is needed.
inline vf vexp2(vf x) {
  const vf lo = splat(-150.0f);
#if defined(__AVX512F__)
  // x < lo ? lo : x in one instruction (GCC emits a compare and a blend): MAXPS returns
  // its second operand where either is NaN, so NaN stays
  const vf xc = (vf)_mm512_max_ps((__m512)lo, (__m512)x);
  const vf n = (vf)_mm512_roundscale_ps((__m512)xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf xc = x < lo ? lo : x;  // NaN compares false and stays
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = xc + magic;
  const vf n = t - magic;
#endif
  const vf r = xc - n;
  const vf p = horner(r, {1.3276471e-3f, 9.6755419e-3f, 5.5507131e-2f, 2.4022120e-1f,
                          6.9314694e-1f, 1.0f});
#if defined(__AVX512F__)
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);  // p * 2^n, 0 past the subnormals
#else
  const vi bits = (__builtin_bit_cast(vi, t) - (0x4B400000 - 127)) << 23;  // 2^n
  const vf y = p * __builtin_bit_cast(vf, bits);
  return x < splat(-126.0f) ? vf{} : y;  // 2^n is a normal float from n = -126 up
#endif
}

// Whether any lane of a comparison's result is set.
inline bool any(vi mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps((__m256)mask) != 0;
#else
  for (int l = 0; l < VW; ++l)
    if (mask[l]) return true;
  return false;
#endif
}

}  // namespace
