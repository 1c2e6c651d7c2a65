// Intel AMX tile products for the paged pass (paged_amx.h): tiles of 16 rows x 64
// bytes, a product C (16 x 16 float32) += A (16 x 32 bfloat16) B (32 x 16 bfloat16) in one
// instruction (TDPBF16PS: bfloat16 products, exact in float32, summed in float32).
//
// The right operand B holds pairs of its rows interleaved: tile row i holds, for each of
// its 16 columns, elements (2i, 2i + 1) of that column, 32 bits side by side. So
//   - keys, the right operand of the scores q . k, are transposed as 32-bit words
//     (amx_keys: a key's 16 word pairs of one 32-wide slice become a column);
//   - values, the right operand of p v, are interleaved two keys at a time
//     (amx_values_pack).
// Both are packed once per step of keys and serve all of a task's query vectors.
//
// Exactness: the weights p are float32; each is split into three bfloat16 pieces
// p = hi + mid + lo (amx_split: exactly, but for pieces below 2^-126, which the tiles
// flush), and p v summed over the pieces, so the outputs are the float32 products'
// within float32 rounding. Queries and pool are
// bfloat16 already: one product each. Tiles flush denormal numbers (below 2^-126) to
// zero, which no float32 softmax would show.
//
// Where: the CPU has AMX-TILE and AMX-BF16, the compiler targets them (-march=native on
// such a CPU) and Linux grants the tiles' state to the process (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once). NANOATTN_AMX=0 turns it off (the tests' and the
// bench's baseline). Elsewhere this file compiles to amx_ready() = false.
//
// Included by paged.h only (attention.cc's one translation unit, unnamed namespace).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#define NANOATTN_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define NANOATTN_AMX 0
#endif

namespace {

#if NANOATTN_AMX

constexpr int kAmxKeys = 128;   // keys a step: packed once, their softmax at once
constexpr int kAmxPieces = 3;   // bfloat16 pieces of a float32 weight

// Whether this process may use the tiles: the CPU has AMX-TILE and AMX-BF16 and Linux
// grants their state, unless NANOATTN_AMX is "0".
inline bool amx_ready() {
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  const char* off = std::getenv("NANOATTN_AMX");
  return granted && !(off && std::string(off) == "0");
}

// A tile configuration (palette 1): each tile register's rows and bytes a row. The
// configurations are constants in memory: GCC 12 does not see that LDTILECFG reads its
// operand, and dropped the stores of a local one (a fault: every tile 0 bytes wide).
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(AmxConfig) == 64, "a tile configuration is 64 bytes");

// Every tile register 16 rows of 64 bytes: the tasks of many query vectors.
const AmxConfig kAmxWhole = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                             {16, 16, 16, 16, 16, 16, 16, 16}};

// Load `config` on this thread (its tiles' state until amx_end).
inline void amx_begin(const AmxConfig& config = kAmxWhole) { _tile_loadconfig(&config); }
inline void amx_end() { _tile_release(); }

// A compiler barrier around the tile products: GCC's tile loads and stores are asm
// statements that declare no memory use, so without one the packed operands' stores
// could move after the loads that read them, and the loads of results before the
// stores that write them.
inline void amx_fence() { asm volatile("" ::: "memory"); }

// n numbers of type T from a 64-byte boundary, grown as needed (the contents are not
// kept): a tile's rows must not cross cache lines, for a tile load whose rows straddle
// two took 3x as long (a loop of loads and products, 2-core Intel Xeon, family 6
// model 207).
template <class T>
struct AmxBuffer {
  T* start = nullptr;
  size_t size = 0;
  AmxBuffer() = default;
  AmxBuffer(const AmxBuffer&) = delete;
  ~AmxBuffer() { std::free(start); }
  T* data() const { return start; }
  void fit(int64_t n) {
    if (static_cast<size_t>(n) <= size) return;
    std::free(start);
    start = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
    size = static_cast<size_t>(n);
  }
};

// A thread's operands, kept from task to task: queries (vectors, H); a step's keys
// (kAmxKeys / 16 blocks, H / 32 slices, 16, 32) and values (kAmxKeys / 32 chunks, Hv /
// 16 tiles, 16, 32); weights of a block of 32 vectors (pieces, 32, kAmxKeys), all
// bfloat16 bits (a block's weights, 24 KiB, stay in L1 for its products); the block's
// scores (32, kAmxKeys) and the outputs (vectors, Hv) in float32.
struct AmxScratch {
  AmxBuffer<uint16_t> q, k, v, w;
  AmxBuffer<float> s, o;
  void fit(int64_t vectors, int64_t H, int64_t Hv) {
    q.fit(vectors * H), k.fit(kAmxKeys * H), v.fit(kAmxKeys * Hv);
    w.fit(kAmxPieces * 32 * kAmxKeys), s.fit(32 * kAmxKeys), o.fit(vectors * Hv);
  }
};

// 32 float32 numbers x (x0: the first 16) as three bfloat16 pieces, pieces + i * stride
// (32 of them each), whose sum is x exactly: hi is x with its low 16 bits cleared, mid
// the same of r = x - hi (exact: 16 significant bits at most), lo = r - mid (exact, 8
// significant bits at most). Each piece is a bfloat16 number already, so rounding to
// bfloat16 (one instruction for 32) keeps it; clearing bits costs less than rounding
// first (a shift and a widening per piece to subtract it): the B = 32 cascade's group
// pass 1.1x faster.
inline void amx_split(__m512 x0, __m512 x1, uint16_t* pieces, int64_t stride) {
  const __m512 top = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  for (int i = 0; i < kAmxPieces - 1; ++i) {
    const __m512 h0 = _mm512_and_ps(x0, top), h1 = _mm512_and_ps(x1, top);
    _mm512_storeu_si512(pieces + i * stride, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
    x0 = _mm512_sub_ps(x0, h0), x1 = _mm512_sub_ps(x1, h1);
  }
  _mm512_storeu_si512(pieces + (kAmxPieces - 1) * stride, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

// r[i] <- column i of the 16 x 16 matrix of 32-bit words whose rows are r.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], lane L: rows 4i .. 4i + 3 at column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 lanes of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88), t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88), t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The step's keys (rows krow[c] of H bfloat16 numbers, c < n; zeros from n to the next
// multiple of 32) as right operands: a.k's tile (block, slice) holds, row i, the pairs
// (32 slice + 2i, + 1) of keys 16 block .. 16 block + 15.
inline void amx_keys(const uint16_t* const* krow, int64_t n, int64_t H, AmxScratch& a) {
  const int64_t blocks = (n + 31) / 32 * 2;
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t h = 0; h < H; h += 32) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int64_t key = block * 16 + c;
        r[c] = key < n ? _mm512_loadu_si512(krow[key] + h) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* dst = a.k.data() + (block * (H / 32) + h / 32) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 32, r[i]);
    }
}

// 32 numbers of a row at p as bfloat16 bits: bfloat16 as they are, int8 widened (every
// int8 number is a bfloat16 one).
inline __m512i amx_bf16x32(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i amx_bf16x32(const int8_t* p) {
  const __m128i* bytes = reinterpret_cast<const __m128i*>(p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The step's values (rows vrow[c] of Hv bfloat16 or int8 numbers, c < n; zeros from n to
// the next multiple of 32) as right operands in bfloat16: a.v's tile (chunk, d / 16)
// holds, row i, keys 32 chunk + 2i and + 1 interleaved over columns d .. d + 15.
// between(k0) runs before each pair of keys from k0 (the decode task fetches the next
// tile's lines there).
template <class In, class Between>
void amx_values_pack(const In* const* vrow, int64_t n, int64_t Hv, AmxScratch& a,
                     const Between& between) {
  alignas(64) static const uint16_t kFirst[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
      6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};  // fmt: skip
  const __m512i first = _mm512_load_si512(kFirst);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  const int64_t pairs = (n + 31) / 32 * 16;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t k0 = 2 * pair, k1 = k0 + 1;
    between(k0);
    uint16_t* dst = a.v.data() + (pair / 16) * Hv * 32 + (pair % 16) * 32;
    for (int64_t d = 0; d < Hv; d += 32) {
      const __m512i x = k0 < n ? amx_bf16x32(vrow[k0] + d) : _mm512_setzero_si512();
      const __m512i y = k1 < n ? amx_bf16x32(vrow[k1] + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d * 32, _mm512_permutex2var_epi16(x, first, y));
      _mm512_storeu_si512(dst + (d + 16) * 32, _mm512_permutex2var_epi16(x, second, y));
    }
  }
}

// a.s[v - v0, c] = q_v . k_c for the block of 32 query vectors from v0 and the step's keys
// c < n rounded up to 32 (keys past n: 0), in 2 x 2 blocks of tiles (the block's scores,
// 16 KiB, stay in L1 for its softmax).
inline void amx_scores(AmxScratch& a, int64_t v0, int64_t H, int64_t n) {
  const int64_t slices = H / 32, cols = (n + 31) / 32 * 32;
  amx_fence();
  for (int64_t c0 = 0; c0 < cols; c0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t h = 0; h < H; h += 32) {
      const uint16_t* k = a.k.data() + ((c0 / 16) * slices + h / 32) * 512;
      _tile_loadd(4, a.q.data() + v0 * H + h, H * 2);
      _tile_loadd(5, a.q.data() + (v0 + 16) * H + h, H * 2);
      _tile_loadd(6, k, 64);
      _tile_loadd(7, k + slices * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* s = a.s.data() + c0;
    _tile_stored(0, s, kAmxKeys * 4);
    _tile_stored(1, s + 16, kAmxKeys * 4);
    _tile_stored(2, s + 16 * kAmxKeys, kAmxKeys * 4);
    _tile_stored(3, s + 16 * kAmxKeys + 16, kAmxKeys * 4);
  }
  amx_fence();
}

// o[v] += sum over the step's keys c of w[v, c] v_c (the weights' three pieces) for the
// block of 32 query vectors whose outputs are o's rows (Hv wide, a multiple of 32; their
// weights a.w: (pieces, 32, kAmxKeys)), over the keys c < n rounded up to 32 (weights and
// values past n: 0).
inline void amx_values(const AmxScratch& a, int64_t Hv, int64_t n, float* o) {
  const int64_t chunks = (n + 31) / 32, piece = 32 * kAmxKeys;
  amx_fence();
  for (int64_t d = 0; d < Hv; d += 32) {
    float* out = o + d;
    _tile_loadd(0, out, Hv * 4);
    _tile_loadd(1, out + 16, Hv * 4);
    _tile_loadd(2, out + 16 * Hv, Hv * 4);
    _tile_loadd(3, out + 16 * Hv + 16, Hv * 4);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const uint16_t* v = a.v.data() + chunk * Hv * 32 + d * 32;
      _tile_loadd(6, v, 64);
      _tile_loadd(7, v + 16 * 32, 64);
      const uint16_t* w = a.w.data() + chunk * 32;
      for (int i = 0; i < kAmxPieces; ++i, w += piece) {
        _tile_loadd(4, w, kAmxKeys * 2);
        _tile_loadd(5, w + 16 * kAmxKeys, kAmxKeys * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, out, Hv * 4);
    _tile_stored(1, out + 16, Hv * 4);
    _tile_stored(2, out + 16 * Hv, Hv * 4);
    _tile_stored(3, out + 16 * Hv + 16, Hv * 4);
  }
  amx_fence();
}

#else

inline bool amx_ready() { return false; }

#endif

}  // namespace
