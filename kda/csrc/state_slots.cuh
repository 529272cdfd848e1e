// Where a sequence's state lives: entry n of the state tensors, or with pooled states (FwdParams::state_indices)
// the pool slot state_indices[n]. Every kernel that reads or writes a state finds it through state_slot.
#pragma once

#include <cstdint>

#include "kda/csrc/kda_params.h"
#include "kda/csrc/status_word.h"  // kStatusStateIndexBase

namespace kda {

// The state slot of sequence n, or -1 for "no state": start from zeros and write nothing. Negative indices are the
// caller's padding rows; indices past the pool are refused the same way (and reported by the boundary check).
__device__ __forceinline__ int64_t state_slot(const FwdParams& p, int64_t n) {
  if (p.state_indices == nullptr) return n;
  const int64_t slot = p.state_indices_is_int64 ? static_cast<const int64_t*>(p.state_indices)[n]
                                                : static_cast<const int32_t*>(p.state_indices)[n];
  return slot >= 0 && slot < p.pool_slots ? slot : -1;
}

// Element offset of head h's state in slot `slot` (>= 0) of a state tensor [slots, H, V, K].
__device__ __forceinline__ size_t state_offset(const FwdParams& p, int64_t slot, int h) {
  return (static_cast<size_t>(slot) * p.heads + h) * kHeadDim * kHeadDim;
}

}  // namespace kda
