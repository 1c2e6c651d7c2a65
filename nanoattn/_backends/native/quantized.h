// Quantized keys and values (docs/conventions.md, "Quantized keys and values"): int8 or
// float8_e4m3fn storage with one float32 scale per token and key/value head, read by the
// kernels as `widen(stored) * scale` in float32 as they pack or load each block; no float
// copy of the cache is made.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <array>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

#include "simd.h"

namespace {

// float8_e4m3fn, stored as its byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, and S.1111.111 is NaN.
enum class F8E4M3 : uint8_t {};

// The 256 values of float8_e4m3fn as float32 (exact: every one is a float32).
inline const std::array<float, 256>& f8_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float x;
      if (exponent == 15 && mantissa == 7)
        x = std::numeric_limits<float>::quiet_NaN();
      else if (exponent == 0)
        x = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m / 8 * 2^-6
      else
        x = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      v[b] = (b & 0x80) ? -x : x;
    }
    return v;
  }();
  return values;
}

inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(F8E4M3 x) { return f8_values()[static_cast<uint8_t>(x)]; }

// Whether elements of type T are stored quantized (and need their scales).
template <class T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, F8E4M3>;

// VW stored elements from p as float32, unscaled, converted in registers (the paged
// pass's loads; the dense pass's packing widens one element at a time).
inline vf load_wide(const int8_t* p) {
  // by intrinsics: GCC 12 builds __builtin_convertvector of int8 lanes one at a time
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return __builtin_bit_cast(vf, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return __builtin_bit_cast(vf, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  vf x;
  for (int i = 0; i < VW; ++i) x[i] = p[i];
  return x;
#endif
}
inline vf load_wide(const F8E4M3* p) {
  // the bytes as int32 lanes, then by bits: a normal number (exponent field e > 0)
  // is the float32 of exponent e - 7 and the same 3 leading mantissa bits; a subnormal
  // m * 2^-9 (converted, never a float32 subnormal that flushing would zero); S.1111.111
  // NaN; then the sign
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const vi x = __builtin_bit_cast(vi, _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const vi x = __builtin_bit_cast(vi, _mm256_cvtepu8_epi32(bytes));
#else
  vi x;
  for (int i = 0; i < VW; ++i) x[i] = static_cast<uint8_t>(p[i]);
#endif
  const vi magnitude = x & 0x7F;
  const vf normal = __builtin_bit_cast(vf, (magnitude << 20) + (120 << 23));
  const vf subnormal = __builtin_convertvector(magnitude, vf) * 0x1p-9f;
  vf value = magnitude < 8 ? subnormal : normal;
  value = magnitude == 0x7F ? splat(std::numeric_limits<float>::quiet_NaN()) : value;
  return __builtin_bit_cast(vf, __builtin_bit_cast(vi, value) | ((x & 0x80) << 24));
}

// f(stored) with `stored` a null pointer of the storage type of `type` (S8 or F8E4M3FN);
// false for any other type.
template <class F>
bool with_storage(xla::ffi::DataType type, F&& f) {
  if (type == xla::ffi::DataType::S8) {
    f(static_cast<const int8_t*>(nullptr));
    return true;
  }
  if (type == xla::ffi::DataType::F8E4M3FN) {
    f(static_cast<const F8E4M3*>(nullptr));
    return true;
  }
  return false;
}

}  // namespace
