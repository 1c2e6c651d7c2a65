// GEMM micro-kernels: C[M x N] (+)= A[M x L] B[L x N], with A read at any strides (it
// is broadcast one scalar at a time), B and C row-major with N contiguous; register
// tiles sized per instruction set, and AVX512_BF16's pairs of bfloat16 where the
// target has them. M is a multiple of MR and N of VW: callers pad their blocks.
//
// Included by attention.cc only, in its one translation unit: the code sits in an
// unnamed namespace there as here, so that every function keeps internal linkage.
#pragma once

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

constexpr int MR = 4;  // callers pad M to a multiple of this

// One step of the products: F32Step multiplies a broadcast scalar of A by a vector of
// B; PairStep (AVX512_BF16) takes A's and B's elements as pairs of bfloat16 in 32
// bits and adds both products of each lane's pair (vdpbf16ps), L being counted in
// pairs: half the instructions, float32 accumulation, exact products.
struct F32Step {
  using Elem = float;
  static vf broadcast(const float* a) { return splat(*a); }
  static vf load_b(const float* b) { return load(b); }
  static vf mac(vf c, vf a, vf b) { return c + a * b; }
};
#if defined(__AVX512BF16__)
constexpr bool kPairs = true;
struct PairStep {
  using Elem = uint32_t;
  static vf broadcast(const uint32_t* a) { return (vf)_mm512_set1_epi32(static_cast<int>(*a)); }
  static vf load_b(const uint32_t* b) { return load(reinterpret_cast<const float*>(b)); }
  static vf mac(vf c, vf a, vf b) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }
};
#else
constexpr bool kPairs = false;
#endif

template <class Step, int R, int NV>
inline void micro(int L, const typename Step::Elem* A, long a_row, long a_col,
                  const typename Step::Elem* B, long ldb, float* C, long ldc, bool accumulate) {
  vf c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? load(C + r * ldc + v * VW) : vf{};
  for (int l = 0; l < L; ++l) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = Step::load_b(B + l * ldb + v * VW);
    for (int r = 0; r < R; ++r) {
      vf a = Step::broadcast(A + r * a_row + l * a_col);
      for (int v = 0; v < NV; ++v) c[r][v] = Step::mac(c[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * VW, c[r][v]);
}

// Rows [0, M) against one panel of NV vectors: R rows at a time, as many tiles as
// leave a multiple of MR rows, then MR at a time (M is a multiple of MR: callers pad),
// then one by one. (M = 32 with R = 6: 4 x 6 + 2 x 4 rows, not 5 x 6 and two single
// rows, each of which loads all of B for one row of FMAs.)
template <class Step, int R, int NV>
inline void panel(int M, int L, const typename Step::Elem* A, long a_row, long a_col,
                  const typename Step::Elem* B, long ldb, float* C, long ldc, bool accumulate) {
  int tiles = M / R;
  while (tiles > 0 && (M - tiles * R) % MR != 0) --tiles;
  int i = 0;
  for (; i < tiles * R; i += R)
    micro<Step, R, NV>(L, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, accumulate);
  if constexpr (R > MR)
    for (; i + MR <= M; i += MR)
      micro<Step, MR, NV>(L, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, accumulate);
  for (; i < M; ++i)
    micro<Step, 1, NV>(L, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, accumulate);
}

// The register tiles, sized by the register file: R rows x NV vectors keep R * NV
// accumulators, NV vectors of B and one broadcast of A in registers. AVX-512 has 32
// vector registers: 6 x 4, 12 x 2 and 12 x 1 (24 or 12 accumulators). AVX2 has 16:
// 6 x 2 (12 accumulators, 2 of B, 1 broadcast: 8 loads per 12 FMAs; the 3 x 4 tile
// before it left no register for B, so GCC read B from memory in every FMA, 15 loads
// per 12 FMAs, and the AVX2 build's products ran 1.13x-1.24x slower on a Zen 5 core
// with AVX-512 off) and 4 x 1; no 4-vector panel.
#if defined(__AVX512F__)
constexpr int kRows4 = 6, kRows2 = 12, kRows1 = 12;
#else
constexpr int kRows4 = 0, kRows2 = 6, kRows1 = MR;
#endif

template <class Step = F32Step>
void gemm(int M, int N, int L, const typename Step::Elem* A, long a_row, long a_col,
          const typename Step::Elem* B, long ldb, float* C, long ldc, bool accumulate) {
  int j = 0;
  if constexpr (kRows4 > 0)
    for (; j + 4 * VW <= N; j += 4 * VW)
      panel<Step, kRows4, 4>(M, L, A, a_row, a_col, B + j, ldb, C + j, ldc, accumulate);
  for (; j + 2 * VW <= N; j += 2 * VW)
    panel<Step, kRows2, 2>(M, L, A, a_row, a_col, B + j, ldb, C + j, ldc, accumulate);
  for (; j < N; j += VW)
    panel<Step, kRows1, 1>(M, L, A, a_row, a_col, B + j, ldb, C + j, ldc, accumulate);
}

}  // namespace
