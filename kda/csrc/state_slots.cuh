// Where a sequence's state lives: entry n of the state tensors, or with pooled states (FwdParams::state_indices)
// the pool slot state_indices[n]; with per-token states (state_tokens = L > 0) sequence n starts from slot
// state_indices[n, a - 1] (a = num_accepted[n], or 1) and token t's state goes to state_indices[n, t]. Every
// kernel that reads or writes a state finds it through state_slot or token_slot.
#pragma once

#include <cstdint>

#include "kda/csrc/kda_params.h"
#include "kda/csrc/status_word.h"  // kStatusStateIndexBase

namespace kda {

// A pool entry as a state slot, or -1 for "no state": start from zeros and write nothing. Negative entries are the
// caller's padding rows; entries past the pool are refused the same way (and reported by the boundary check).
__device__ __forceinline__ int64_t in_pool(const FwdParams& p, int64_t slot) {
  return slot >= 0 && slot < p.pool_slots ? slot : -1;
}
__device__ __forceinline__ int64_t pool_index(const FwdParams& p, int64_t i) {
  return in_pool(p, p.state_indices_is_int64 ? static_cast<const int64_t*>(p.state_indices)[i]
                                             : static_cast<const int32_t*>(p.state_indices)[i]);
}

// The tokens accepted before sequence n's call (per-token states: it starts from the state after that many), or an
// out-of-range value the caller passed (then the sequence starts from zeros).
__device__ __forceinline__ int64_t accepted_tokens(const FwdParams& p, int64_t n) {
  if (p.num_accepted == nullptr) return 1;
  return p.num_accepted_is_int64 ? static_cast<const int64_t*>(p.num_accepted)[n]
                                 : static_cast<const int32_t*>(p.num_accepted)[n];
}

// The slot sequence n starts from (and, without per-token states, ends in).
__device__ __forceinline__ int64_t state_slot(const FwdParams& p, int64_t n) {
  if (p.state_indices == nullptr) return n;
  if (p.state_tokens > 0) {
    const int64_t a = accepted_tokens(p, n);
    return a >= 1 && a <= p.state_tokens ? pool_index(p, n * p.state_tokens + a - 1) : -1;
  }
  return pool_index(p, n);
}

// state_slot in two halves, for a kernel that issues the index's load early and uses it late (decode.cu): the
// entry as loaded (no instruction reads the loaded register until slot_from_bits, so the warp does not wait for
// it), then the slot. With per-token states the entry's address depends on another load, and the slot is found
// at once.
struct SlotBits {
  int64_t wide;    // the int64 entry; the slot itself without indices or with per-token states
  int32_t narrow;  // the int32 entry
};
__device__ __forceinline__ SlotBits load_slot_bits(const FwdParams& p, int64_t n) {
  SlotBits bits{0, 0};
  if (p.state_indices == nullptr || p.state_tokens > 0) {
    bits.wide = state_slot(p, n);
  } else if (p.state_indices_is_int64) {
    bits.wide = static_cast<const int64_t*>(p.state_indices)[n];
  } else {
    bits.narrow = static_cast<const int32_t*>(p.state_indices)[n];
  }
  return bits;
}
__device__ __forceinline__ int64_t slot_from_bits(const FwdParams& p, const SlotBits& bits) {
  if (p.state_indices == nullptr || p.state_tokens > 0) return bits.wide;
  return in_pool(p, p.state_indices_is_int64 ? bits.wide : static_cast<int64_t>(bits.narrow));
}

// The slot of the state after token t (t >= 0, counted from the sequence's start) of sequence n, or -1.
__device__ __forceinline__ int64_t token_slot(const FwdParams& p, int64_t n, int64_t t) {
  return t < p.state_tokens ? pool_index(p, n * p.state_tokens + t) : -1;
}

// The slot of sequence n's checkpoint after `chunks` chunks (chunks >= 1; the state after chunks·16 tokens, which
// the caller has checked are within the sequence), or -1: not a checkpoint, none asked for, a negative or
// out-of-pool entry (kda_params.h), or the sequence's own final slot `final_slot` (state_slot), which keeps the
// final state: under the time split another CTA writes that, in no fixed order with this checkpoint.
__device__ __forceinline__ int64_t checkpoint_slot(const FwdParams& p, int64_t n, int64_t chunks, int64_t final_slot) {
  if (p.checkpoint_chunks <= 0 || chunks % p.checkpoint_chunks != 0) return -1;
  const int64_t m = chunks / p.checkpoint_chunks - 1;
  if (m >= p.checkpoint_cols) return -1;
  const int64_t i = n * p.checkpoint_cols + m;
  const int64_t slot = p.checkpoint_indices_is_int64 ? static_cast<const int64_t*>(p.checkpoint_indices)[i]
                                                     : static_cast<const int32_t*>(p.checkpoint_indices)[i];
  return slot >= 0 && slot < p.pool_slots && slot != final_slot ? slot : -1;
}

// Element offset of head h's state in slot `slot` (>= 0) of a state tensor [slots, H, V, K].
__device__ __forceinline__ size_t state_offset(const FwdParams& p, int64_t slot, int h) {
  return (static_cast<size_t>(slot) * p.heads + h) * kHeadDim * kHeadDim;
}

}  // namespace kda
