// nanoattn's native CPU attention kernel, called from JAX through XLA's FFI. This file
// holds the FFI handlers, each of which checks its call's buffers against each other
// and runs a pass, their bindings, and the C exports; the passes are in the headers
// beside it.
//
// Axis legend (docs/conventions.md): B batch, T queries, S keys, N query heads,
// K key/value heads, G = N / K query heads per key/value head (contiguous
// groups), H head width. Inputs are float32 or bfloat16 (one pair of handlers each),
// row-major: q (B, T, N, H), k and v (B, S, K, H); leading axes before the last three
// are flattened into B (that is how a vmapped call arrives). bfloat16 is widened to
// float32 when packed, and the statistics, products and accumulators are float32
// for both. The output stays float32 (the caller rounds it, and the backward pass
// needs it unrounded); the gradients are rounded to the inputs' type once, at the end.
//
// Visibility, the contract of the other backends: query i (position
// p = q_offset[b] + i) sees key j when p - left <= j <= p + right (a side of -1 is
// unbounded; causality is right = 0), j < kv_lengths[b], and, with segment ids,
// q_segment_ids[b, i] == kv_segment_ids[b, j], and, with a mask_fn, where its bits say
// so. A mask_fn arrives classified (docs/conventions.md, "Masks and scores as
// functions"): one kind per (b, n, query block, key block), empty, full or partial, and
// for each partial block its BQ x BK bits, packed twice (rows of queries over keys, and
// rows of keys over queries, for the two layouts of the scores). An empty block is
// skipped; a full one is masked by the other rules only; a partial one by the bits too.
// A query that sees no key gives zeros and zero gradients; a key that no query of its
// row (and, with a mask_fn, of its key/value head's group) sees is never read, so NaN
// or inf there cannot reach any result.
//
// The headers: pack.h (the scratch, the tiles shared by a call's tasks, the packers),
// logits.h (the soft cap and the mask on a row of logits), forward.h and backward.h
// (the two passes), paged.h (the forward pass of nanoattn.paged_attention, keys read
// through a page table), quantized.h (the int8 and float8 keys and values that both
// forward passes read with their scales: one more forward handler each, float32
// queries over quantized keys), and two ops a latent layer's decoding step calls beside
// its attention: indexer.h (DeepSeek-V3.2's indexer scores, for its top-k keys) and
// absorbed.h (the per-head products with the up-projection); read_walk.h, the bench's
// yardstick of a paged decode (a walk of pages in a shuffled order); the generic pieces:
// simd.h (vectors, bfloat16), gemm.h (the block products' micro-kernels), threads.h
// (work sharing on XLA's thread pool) and visibility.h (the problem, the blocks, who sees what).

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "absorbed.h"
#include "backward.h"
#include "forward.h"
#include "indexer.h"
#include "paged.h"
#include "quantized.h"
#include "read_walk.h"
#include "visibility.h"

namespace ffi = xla::ffi;

namespace {

// A mask_fn's kinds (V, xB, xN, nQ, nK), slots (the same) and bits (V, P, kBitsBytes),
// checked against the call (B0 the call's own batch, B = V * B0) and against each other.
ffi::Error mask_fn_of(const ffi::Buffer<ffi::S8>& kind, const ffi::Buffer<ffi::S32>& slot,
                      const ffi::Buffer<ffi::U8>& bits, int64_t B0, Problem& p) {
  const auto kd = kind.dimensions(), bd = bits.dimensions();
  const size_t rank = kd.size(), bits_rank = bd.size();
  auto bad = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("nanoattn native: mask_fn's ") + what);
  };
  if (rank < 4 || bits_rank < 2 || bits_rank - 2 != rank - 4)
    return bad("kinds need (xB, xN, nQ, nK) and bits (P, bytes), after the same mapped axes");
  int64_t V = 1;
  for (size_t a = 0; a + 4 < rank; ++a) {
    if (kd[a] != bd[a]) return bad("kinds and bits have different mapped axes");
    V *= kd[a];
  }
  const int64_t xB = kd[rank - 4], xN = kd[rank - 3];
  if (V * B0 != p.B || (xB != 1 && xB != B0) || (xN != 1 && xN != p.N) ||
      kd[rank - 2] != p.n_q() || kd[rank - 1] != p.n_k())
    return bad("kinds need (1 or B, 1 or N, ceil(T / BQ), ceil(S / BK)) blocks");
  if (bd[bits_rank - 1] != kBitsBytes) return bad("bits need 2 * BQ * BK / 8 bytes a block");
  if (slot.element_count() != kind.element_count()) return bad("slots need one per block");
  const int64_t P = bd[bits_rank - 2];
  const int8_t* kinds = kind.typed_data();
  const int32_t* slots = slot.typed_data();
  for (size_t t = 0; t < kind.element_count(); ++t) {
    if (kinds[t] != kFnEmpty && kinds[t] != kFnPartial && kinds[t] != kFnFull)
      return bad("kinds must be 0 (empty), 1 (partial) or 2 (full)");
    if (kinds[t] == kFnPartial && (slots[t] < 0 || slots[t] >= P))
      return bad("partial blocks need a slot in the bits");
  }
  p.fn = MaskFn{kinds, slots, bits.typed_data(), B0, xB, xN, P};
  return ffi::Error::Success();
}

// The sizes, rules and per-row inputs of a call, checked against each other.
template <class QBuf, class KBuf>
ffi::Error make_problem(const QBuf& q, const KBuf& k, const KBuf& v,
                        const ffi::Buffer<ffi::S32>& q_offset,
                        const ffi::Buffer<ffi::S32>& kv_lengths,
                        const ffi::Buffer<ffi::S32>& q_seg, const ffi::Buffer<ffi::S32>& kv_seg,
                        const ffi::Buffer<ffi::S8>& fn_kind, const ffi::Buffer<ffi::S32>& fn_slot,
                        const ffi::Buffer<ffi::U8>& fn_bits, float scale, float soft_cap,
                        int64_t left, int64_t right, Problem& p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank)
    return ffi::Error::InvalidArgument("nanoattn native: q, k, v need the same rank >= 4");
  int64_t B = 1;
  for (size_t a = 0; a + 3 < rank; ++a) {
    if (qd[a] != kd[a] || qd[a] != vd[a])
      return ffi::Error::InvalidArgument("nanoattn native: q, k, v batch axes differ");
    B *= qd[a];
  }
  p.B = B;
  p.T = qd[rank - 3];
  p.N = qd[rank - 2];
  p.H = qd[rank - 1];
  p.S = kd[rank - 3];
  p.K = kd[rank - 2];
  for (size_t a = rank - 3; a < rank; ++a)
    if (kd[a] != vd[a]) return ffi::Error::InvalidArgument("nanoattn native: k and v differ");
  if (kd[rank - 1] != p.H || p.K == 0 || p.N % p.K)
    return ffi::Error::InvalidArgument("nanoattn native: bad head counts or widths");
  p.G = p.N / p.K;
  p.Hp = (p.H + VW - 1) / VW * VW;
  if (static_cast<int64_t>(q_offset.element_count()) != B ||
      static_cast<int64_t>(kv_lengths.element_count()) != B)
    return ffi::Error::InvalidArgument("nanoattn native: q_offset and kv_lengths need B values");
  const bool segments = q_seg.element_count() > 0;
  if (segments && (static_cast<int64_t>(q_seg.element_count()) != B * p.T ||
                   static_cast<int64_t>(kv_seg.element_count()) != B * p.S))
    return ffi::Error::InvalidArgument("nanoattn native: segment ids need (B, T) and (B, S)");
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.left = left;
  p.right = right;
  p.q_offset = q_offset.typed_data();
  p.kv_lengths = kv_lengths.typed_data();
  p.q_seg = segments ? q_seg.typed_data() : nullptr;
  p.kv_seg = segments ? kv_seg.typed_data() : nullptr;
  p.fn = MaskFn{};
  if (fn_kind.element_count() == 0) return ffi::Error::Success();  // empty: no mask_fn
  return mask_fn_of(fn_kind, fn_slot, fn_bits, qd[rank - 4], p);
}

// The forward pass, for inputs of type DT (F32 or BF16); out and lse are float32.
template <ffi::DataType DT>
ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                   ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_lengths,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::Buffer<ffi::S8> fn_kind, ffi::Buffer<ffi::S32> fn_slot,
                   ffi::Buffer<ffi::U8> fn_bits, float scale, float soft_cap, int64_t left,
                   int64_t right, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  using In = ffi::NativeType<DT>;
  const ForwardIn<In, In> in{q.typed_data(), k.typed_data(), v.typed_data(), nullptr, nullptr};
  forward_run(pool, p, in, ForwardOut{out->typed_data(), lse->typed_data()});
  return ffi::Error::Success();
}

// The forward pass of float32 queries over quantized keys and values (int8 or
// float8_e4m3fn, both the same) with their scales (B, S, K); out and lse float32.
ffi::Error ForwardQuantized(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> key_scales,
                            ffi::Buffer<ffi::F32> value_scales, ffi::Buffer<ffi::S32> q_offset,
                            ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S8> fn_kind,
                            ffi::Buffer<ffi::S32> fn_slot, ffi::Buffer<ffi::U8> fn_bits,
                            float scale, float soft_cap, int64_t left, int64_t right,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  const size_t tokens = static_cast<size_t>(p.B * p.S * p.K);
  if (k.element_type() != v.element_type() || key_scales.element_count() != tokens ||
      value_scales.element_count() != tokens)
    return ffi::Error::InvalidArgument(
        "nanoattn native: quantized k and v need one type and scales (B, S, K)");
  const bool served = with_storage(k.element_type(), [&](auto stored) {
    using Kv = std::remove_const_t<std::remove_pointer_t<decltype(stored)>>;
    const ForwardIn<float, Kv> in{q.typed_data(), static_cast<const Kv*>(k.untyped_data()),
                                  static_cast<const Kv*>(v.untyped_data()),
                                  key_scales.typed_data(), value_scales.typed_data()};
    forward_run(pool, p, in, ForwardOut{out->typed_data(), lse->typed_data()});
  });
  if (!served)
    return ffi::Error::InvalidArgument("nanoattn native: quantized k and v must be int8 or float8_e4m3fn");
  return ffi::Error::Success();
}

// The backward pass: q, k, v, dout and the gradients of type DT; out, lse, dlse float32.
template <ffi::DataType DT>
ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k,
                    ffi::Buffer<DT> v, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<DT> dout, ffi::Buffer<ffi::F32> dlse,
                    ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_lengths,
                    ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                    ffi::Buffer<ffi::S8> fn_kind, ffi::Buffer<ffi::S32> fn_slot,
                    ffi::Buffer<ffi::U8> fn_bits, float scale, float soft_cap, int64_t left,
                    int64_t right, ffi::ResultBuffer<DT> dq, ffi::ResultBuffer<DT> dk,
                    ffi::ResultBuffer<DT> dv) {
  using In = ffi::NativeType<DT>;
  Problem p;
  ffi::Error err = make_problem(q, k, v, q_offset, kv_lengths, q_seg, kv_seg, fn_kind, fn_slot,
                                fn_bits, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  if (out.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      static_cast<int64_t>(lse.element_count()) != p.B * p.T * p.N ||
      dlse.element_count() != lse.element_count())
    return ffi::Error::InvalidArgument(
        "nanoattn native: out, dout, lse or dlse has the wrong size");
  const BackwardIn<In> in{q.typed_data(), dout.typed_data(), k.typed_data(), v.typed_data(),
                          out.typed_data(), lse.typed_data(), dlse.typed_data()};
  // delta, the rows' terms, is backward_run's to compute
  backward_run(pool, p, in,
               BackwardOut<In>{dq->typed_data(), dk->typed_data(), dv->typed_data(), nullptr});
  return ffi::Error::Success();
}

// A paged call's sizes and run-time inputs, checked against each other, into p.
template <class QBuf, class PoolBuf>
ffi::Error paged_problem(const QBuf& q, const PoolBuf& key_pages, const PoolBuf& value_pages,
                         const ffi::Buffer<ffi::S32>& table,
                         const ffi::Buffer<ffi::S32>& kv_lengths,
                         const ffi::Buffer<ffi::S32>& starts, const ffi::Buffer<ffi::U8>& real,
                         const ffi::Buffer<ffi::S32>& offsets,
                         const ffi::Buffer<ffi::S32>& tree, float scale, float soft_cap,
                         int64_t left, int64_t right, Paged& p) {
  const auto qd = q.dimensions(), kd = key_pages.dimensions(), vd = value_pages.dimensions();
  const auto td = table.dimensions();
  auto bad = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("nanoattn native paged: ") + what);
  };
  // two pools (P, page_size, K, H) and (P, page_size, K, Hv), or one combined pool
  // (P, page_size, 2, K, H) given as both (p.combined: the caller starts the values K * H in)
  p.combined = kd.size() == 5;
  if (qd.size() != 3 || kd.size() != vd.size() || (kd.size() != 4 && !p.combined) ||
      (p.combined && kd[2] != 2) || td.size() != 2)
    return bad("q needs (Tq, N, H), the pages (P, page_size, K, H) or one (P, page_size, 2, K, H), "
               "the table (B, M)");
  for (size_t a = 0; a + 1 < kd.size(); ++a)
    if (kd[a] != vd[a]) return bad("key and value pages differ");
  p.Tq = qd[0], p.N = qd[1], p.H = qd[2], p.Hv = vd[vd.size() - 1];
  p.P = kd[0], p.page_size = kd[1], p.K = kd[kd.size() - 2];
  p.B = td[0], p.M = td[1];
  if (kd[kd.size() - 1] != p.H || p.K == 0 || p.N % p.K || p.page_size == 0)
    return bad("bad head counts, widths or page size");
  p.key_row = (p.combined ? 2 : 1) * p.K * p.H;
  p.value_row = p.combined ? p.key_row : p.K * p.Hv;
  if (static_cast<int64_t>(kv_lengths.element_count()) != p.B ||
      static_cast<int64_t>(starts.element_count()) != p.B + 1 ||
      static_cast<int64_t>(real.element_count()) != p.Tq)
    return bad("kv_lengths need (B,), starts (B + 1,) and real (Tq,)");
  const int64_t given = static_cast<int64_t>(offsets.element_count());
  if (given != 0 && given != p.B) return bad("offsets need (B,) or nothing");
  p.offsets = given ? offsets.typed_data() : nullptr;
  const auto trd = tree.dimensions();  // (Tq, 1 + W), or (0, 1)
  if (trd.size() != 2 || trd[1] < 1 || (trd[0] != 0 && trd[0] != p.Tq))
    return bad("the tree needs (Tq, 1 + W) or (0, 1)");
  p.tree = trd[0] ? tree.typed_data() : nullptr;
  p.tree_stride = trd[1];
  p.G = p.N / p.K;
  p.Hp = (p.H + VW - 1) / VW * VW;
  p.Hvp = (p.Hv + VW - 1) / VW * VW;
  p.scale = scale, p.soft_cap = soft_cap, p.left = left, p.right = right;
  p.table = table.typed_data(), p.kv_lengths = kv_lengths.typed_data();
  p.starts = starts.typed_data(), p.real = real.typed_data();
  return ffi::Error::Success();
}

// The paged forward pass (paged.h) for inputs of type DT (F32 or BF16); out and lse
// float32.
template <ffi::DataType DT>
ffi::Error PagedForward(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> key_pages,
                        ffi::Buffer<DT> value_pages, ffi::Buffer<ffi::S32> table,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> starts,
                        ffi::Buffer<ffi::U8> real, ffi::Buffer<ffi::S32> offsets,
                        ffi::Buffer<ffi::S32> tree, float scale, float soft_cap, int64_t left,
                        int64_t right,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Paged p;
  ffi::Error err = paged_problem(q, key_pages, value_pages, table, kv_lengths, starts, real,
                                 offsets, tree, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  return paged_run(pool, p, q.typed_data(), key_pages.typed_data(),
                   value_pages.typed_data() + p.values_start(), out->typed_data(),
                   lse->typed_data());
}

// The paged forward pass over quantized pools (int8 or float8_e4m3fn, both the same) with
// their scales (P, page_size, K); the queries float32, out and lse float32.
ffi::Error PagedForwardQuantized(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                 ffi::AnyBuffer key_pages, ffi::AnyBuffer value_pages,
                                 ffi::Buffer<ffi::F32> key_scales,
                                 ffi::Buffer<ffi::F32> value_scales, ffi::Buffer<ffi::S32> table,
                                 ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> starts,
                                 ffi::Buffer<ffi::U8> real, ffi::Buffer<ffi::S32> offsets,
                                 ffi::Buffer<ffi::S32> tree, float scale, float soft_cap,
                                 int64_t left, int64_t right,
                                 ffi::ResultBuffer<ffi::F32> out,
                                 ffi::ResultBuffer<ffi::F32> lse) {
  Paged p;
  ffi::Error err = paged_problem(q, key_pages, value_pages, table, kv_lengths, starts, real,
                                 offsets, tree, scale, soft_cap, left, right, p);
  if (err.failure()) return err;
  const size_t tokens = static_cast<size_t>(p.P * p.page_size * p.K);  // scales a pool
  if (key_pages.element_type() != value_pages.element_type() ||
      key_scales.element_count() != tokens || value_scales.element_count() != tokens)
    return ffi::Error::InvalidArgument(
        "nanoattn native paged: quantized pages need one type and scales (P, page_size, K)");
  p.key_scales = key_scales.typed_data(), p.value_scales = value_scales.typed_data();
  bool served = with_storage(key_pages.element_type(), [&](auto stored) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(stored)>>;
    err = paged_run(pool, p, q.typed_data(), static_cast<const In*>(key_pages.untyped_data()),
                    static_cast<const In*>(value_pages.untyped_data()) + p.values_start(),
                    out->typed_data(),
                    lse->typed_data());
  });
  if (!served)
    return ffi::Error::InvalidArgument(
        "nanoattn native paged: quantized pages must be int8 or float8_e4m3fn");
  return err;
}

}  // namespace

// The parts the bindings share: the dense passes' per-row arguments (q_offset,
// kv_lengths, segment ids, mask_fn's kinds, slots and bits), the paged pass's (page
// table, kv_lengths, query starts, real rows), the static rules, a forward's outputs.
#define NANOATTN_ROW_ARGS                                                             \
  .Arg<ffi::Buffer<ffi::S32>>()     /* q_offset */                                    \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_lengths */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* q_segment_ids */                               \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_segment_ids */                              \
      .Arg<ffi::Buffer<ffi::S8>>()  /* mask_fn kinds */                               \
      .Arg<ffi::Buffer<ffi::S32>>() /* mask_fn slots */                               \
      .Arg<ffi::Buffer<ffi::U8>>()  /* mask_fn bits */
#define NANOATTN_PAGED_ARGS                                                           \
  .Arg<ffi::Buffer<ffi::S32>>()     /* page_table */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_lengths */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* query_starts */                                \
      .Arg<ffi::Buffer<ffi::U8>>()  /* real rows */                                   \
      .Arg<ffi::Buffer<ffi::S32>>() /* offsets (B,) or (0,) */                     \
      .Arg<ffi::Buffer<ffi::S32>>() /* tree (Tq, 1 + W) or (0, 1) */
#define NANOATTN_RULES \
  .Attr<float>("scale").Attr<float>("soft_cap").Attr<int64_t>("left").Attr<int64_t>("right")
#define NANOATTN_FORWARD_OUTPUTS \
  .Ret<ffi::Buffer<ffi::F32>>() /* out */.Ret<ffi::Buffer<ffi::F32>>() /* lse */

// One pair of handlers per element type.
#define NANOATTN_HANDLERS(FORWARD, BACKWARD, DT)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(FORWARD, Forward<DT>,                            \
                                ffi::Ffi::Bind()                                 \
                                    .Ctx<ffi::ThreadPool>()                      \
                                    .Arg<ffi::Buffer<DT>>() /* q */              \
                                    .Arg<ffi::Buffer<DT>>() /* k */              \
                                    .Arg<ffi::Buffer<DT>>() /* v */              \
                                        NANOATTN_ROW_ARGS NANOATTN_RULES         \
                                            NANOATTN_FORWARD_OUTPUTS);           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(BACKWARD, Backward<DT>,                          \
                                ffi::Ffi::Bind()                                 \
                                    .Ctx<ffi::ThreadPool>()                      \
                                    .Arg<ffi::Buffer<DT>>()       /* q */        \
                                    .Arg<ffi::Buffer<DT>>()       /* k */        \
                                    .Arg<ffi::Buffer<DT>>()       /* v */        \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* out */      \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* lse */      \
                                    .Arg<ffi::Buffer<DT>>()       /* dout */     \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* dlse */     \
                                        NANOATTN_ROW_ARGS NANOATTN_RULES         \
                                    .Ret<ffi::Buffer<DT>>()  /* dq */            \
                                    .Ret<ffi::Buffer<DT>>()  /* dk */            \
                                    .Ret<ffi::Buffer<DT>>()) /* dv */

// The blocks of queries and keys of every pass (a mask_fn is classified at these).
extern "C" int NanoattnBlockQ() { return BQ; }
extern "C" int NanoattnBlockK() { return BK; }

// How the kernel classifies the (BQ, BK) blocks of one batch row by its positional
// rules, key length and segment ids (null for none), for tests: kinds (n_q, n_k) gets
// 0 (skipped), 1 (masked cell by cell) or 2 (full), as block_mask's kinds.
extern "C" void NanoattnClassify(int64_t T, int64_t S, int32_t q_offset, int32_t kv_length,
                                 int64_t left, int64_t right, const int32_t* q_seg,
                                 const int32_t* kv_seg, int8_t* kinds) {
  Problem p{};
  p.B = p.N = p.K = p.G = 1;
  p.T = T;
  p.S = S;
  p.left = left;
  p.right = right;
  p.q_offset = &q_offset;
  p.kv_lengths = &kv_length;
  p.q_seg = q_seg;
  p.kv_seg = q_seg ? kv_seg : nullptr;
  const Geometry g = geometry(p, 0);
  for (int64_t qb = 0; qb < p.n_q(); ++qb)
    for (int64_t kb = 0; kb < p.n_k(); ++kb) {
      const Block kind = classify(p, g, qb * BQ, std::min((qb + 1) * BQ, T), kb * BK,
                                  std::min((kb + 1) * BK, S));
      kinds[qb * p.n_k() + kb] =
          kind == Block::kSkip ? kFnEmpty : kind == Block::kFull ? kFnFull : kFnPartial;
    }
}

// The read bandwidth's yardstick of a paged decode (read_walk.h): the sum of `count`
// chunks of `chunk_floats` floats at data + order[i] *
// chunk_floats, read by `threads` threads.
extern "C" double NanoattnReadWalk(const float* data, int64_t count, int64_t chunk_floats,
                                   const int64_t* order, int threads) {
  return read_walk(data, count, chunk_floats, order, std::max(threads, 1));
}

// Whether the paged pass's tasks of many query vectors over bfloat16 pools run on AMX
// tiles in this process (paged_amx.h): built for them, the CPU has them, Linux grants
// their state and NANOATTN_AMX is not "0".
extern "C" int NanoattnAmx() { return amx_ready() ? 1 : 0; }

// The instruction set this build's vectors and tiles were chosen for.
extern "C" const char* NanoattnIsa() {
#if defined(__AVX512BF16__)
  return "AVX-512 (16 floats a vector, 6x4 register tiles; bfloat16 scores by AVX512_BF16 pairs)";
#elif defined(__AVX512F__)
  return "AVX-512 (16 floats a vector, 6x4 register tiles)";
#elif defined(__AVX2__)
  return "AVX2 (8 floats a vector, 6x2 register tiles)";
#else
  return "generic (8-float vectors in narrower registers, 6x2 register tiles)";
#endif
}

NANOATTN_HANDLERS(NanoattnForward, NanoattnBackward, ffi::F32);
NANOATTN_HANDLERS(NanoattnForwardBf16, NanoattnBackwardBf16, ffi::BF16);

// The paged forward pass (paged.h), one handler per element type; its backward pass is
// the flash kernel's (nanoattn/_backends/native/paged.py).
#define NANOATTN_PAGED_HANDLER(FORWARD, DT)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(FORWARD, PagedForward<DT>,                   \
                                ffi::Ffi::Bind()                             \
                                    .Ctx<ffi::ThreadPool>()                  \
                                    .Arg<ffi::Buffer<DT>>() /* q */          \
                                    .Arg<ffi::Buffer<DT>>() /* key_pages */  \
                                    .Arg<ffi::Buffer<DT>>() /* value_pages */\
                                        NANOATTN_PAGED_ARGS NANOATTN_RULES   \
                                            NANOATTN_FORWARD_OUTPUTS);

NANOATTN_PAGED_HANDLER(NanoattnPagedForward, ffi::F32);
NANOATTN_PAGED_HANDLER(NanoattnPagedForwardBf16, ffi::BF16);

// Float32 queries over quantized keys and values (quantized.h), dense and paged: one
// handler each for int8 and float8_e4m3fn storage; no backward pass (gradients through
// a quantized cache are refused in Python).
XLA_FFI_DEFINE_HANDLER_SYMBOL(NanoattnForwardQuantized, ForwardQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* q */
                                  .Arg<ffi::AnyBuffer>()        /* k */
                                  .Arg<ffi::AnyBuffer>()        /* v */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* key_scales */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* value_scales */
                                      NANOATTN_ROW_ARGS NANOATTN_RULES NANOATTN_FORWARD_OUTPUTS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(NanoattnPagedForwardQuantized, PagedForwardQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* q */
                                  .Arg<ffi::AnyBuffer>()        /* key_pages */
                                  .Arg<ffi::AnyBuffer>()        /* value_pages */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* key_scales */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* value_scales */
                                      NANOATTN_PAGED_ARGS NANOATTN_RULES NANOATTN_FORWARD_OUTPUTS);

// DeepSeek-V3.2's indexer scores (indexer.h): q (..., T, Hi, d), weights (..., T, Hi),
// keys (..., S, 1, d) (one key a token, as a cache holds them), out (..., T, S), the
// leading axes flattened (as a vmapped call arrives) and equal in number of rows.
ffi::Error IndexScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> keys, float scale,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), wd = weights.dimensions(), kd = keys.dimensions();
  const size_t rank = qd.size();
  if (rank < 3 || wd.size() != rank - 1 || kd.size() != rank)
    return ffi::Error::InvalidArgument(
        "nanoattn native: index scores need q (..., T, Hi, d), weights (..., T, Hi), keys "
        "(..., S, 1, d)");
  IndexProblem p{1, qd[rank - 3], qd[rank - 2], qd[rank - 1], kd[rank - 3], scale};
  for (size_t a = 0; a + 3 < rank; ++a) {
    if (qd[a] != wd[a] || qd[a] != kd[a])
      return ffi::Error::InvalidArgument("nanoattn native: index scores' batch axes differ");
    p.G *= qd[a];
  }
  if (wd[rank - 3] != p.T || wd[rank - 2] != p.Hi || kd[rank - 2] != 1 ||
      kd[rank - 1] != p.d || static_cast<int64_t>(out->element_count()) != p.G * p.T * p.S)
    return ffi::Error::InvalidArgument("nanoattn native: index scores' shapes disagree");
  index_scores(pool, p, q.typed_data(), weights.typed_data(), keys.typed_data(),
               out->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NanoattnIndexScores, IndexScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>() /* q */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* weights */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* keys */
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()); /* out */

// Multi-head latent attention's absorbed products (absorbed.h): x (..., N, A), w (R, N, C),
// the columns [c0, c0 + width) of each head; rows: A = width, out (..., N, R); columns:
// A = R, out (..., N, width).
template <bool kColumns>
ffi::Error Absorbed(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    int64_t c0, int64_t width, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const size_t rank = xd.size();
  if (rank < 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("nanoattn native: absorbed products need x (..., N, A), "
                                       "w (R, N, C)");
  AbsorbedProblem p{1, xd[rank - 2], wd[0], wd[2], c0, width};
  for (size_t a = 0; a + 2 < rank; ++a) p.M *= xd[a];
  const int64_t takes = kColumns ? p.R : width, gives = kColumns ? width : p.R;
  if (wd[1] != p.N || c0 < 0 || width < 0 || c0 + width > p.C || xd[rank - 1] != takes ||
      static_cast<int64_t>(out->element_count()) != p.M * p.N * gives)
    return ffi::Error::InvalidArgument("nanoattn native: absorbed products' shapes disagree");
  if (kColumns)
    absorbed_columns(pool, p, x.typed_data(), w.typed_data(), out->typed_data());
  else
    absorbed_rows(pool, p, x.typed_data(), w.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

#define NANOATTN_ABSORBED_HANDLER(NAME, COLUMNS)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, Absorbed<COLUMNS>,                \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */ \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* w */ \
                                    .Attr<int64_t>("c0")                \
                                    .Attr<int64_t>("width")             \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* out */

NANOATTN_ABSORBED_HANDLER(NanoattnAbsorbedRows, false)
NANOATTN_ABSORBED_HANDLER(NanoattnAbsorbedColumns, true)
