// The device-side checks of a call's CUDA cu_seqlens, state_indices and checkpoint_indices, which the host cannot read without a
// synchronisation: each lowers the device's error word (FwdParams::status) to the first malformed index, for
// flash_kda.last_error. The kernels clamp malformed boundaries and skip slots past the pool on their own (memory
// stays safe); these only record that the call's results are unspecified. kda_checks.cu runs them in a launch of
// their own; the decode kernel runs them itself (one launch less on the shortest calls).
#pragma once

#include <cstdint>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/state_slots.cuh"
#include "kda/csrc/status_word.h"  // kStatusStateIndexBase

namespace kda {

// Check item i covers boundary i (0 <= i <= num_seqs: cu[0] must be 0, and cu must not decrease or leave
// [0, total_tokens]; cu[N] below total_tokens is allowed: the tokens past it are padding, in no sequence), state index i (i < num_seqs: below pool_slots; negative indices are
// padding rows, allowed) and, with kCheckpoints, entry i of checkpoint_indices [N, M] in row order (one thread per
// entry: a sequence's M entries in one thread measured 16 us for M = 512 on the H200, 2026-12-02). The decode
// kernel's instantiations without checkpoints leave that part out.
template <bool kCheckpoints = true>
__host__ __device__ __forceinline__ int64_t last_check_item(const FwdParams& p) {  // (the host sizes the grid)
  if constexpr (!kCheckpoints) return p.num_seqs;
  const int64_t entries = p.checkpoint_indices != nullptr ? p.num_seqs * p.checkpoint_cols : 0;
  return entries > p.num_seqs + 1 ? entries - 1 : p.num_seqs;
}

template <bool kCheckpoints = true>
__device__ __forceinline__ void check_call_inputs(const FwdParams& p, int64_t i) {
  if (p.status == nullptr) return;
  if (p.cu_seqlens != nullptr && i <= p.num_seqs) {
    const int64_t v = load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i);
    const bool bad = v < 0 || v > p.total_tokens || (i == 0 && v != 0) ||
                     (i > 0 && load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i - 1) > v);
    if (bad) atomicMin(p.status, static_cast<unsigned long long>(i));
  }
  if (p.state_indices != nullptr && i < p.num_seqs) {
    // Per-token states: the sequence's L slots, and its accepted count in [1, L].
    const int64_t width = p.state_tokens > 0 ? p.state_tokens : 1;
    bool bad = false;
    for (int64_t t = 0; t < width; ++t) {
      const int64_t index = p.state_indices_is_int64 ? static_cast<const int64_t*>(p.state_indices)[i * width + t]
                                                     : static_cast<const int32_t*>(p.state_indices)[i * width + t];
      bad = bad || index >= p.pool_slots;
    }
    if (p.state_tokens > 0 && p.num_accepted != nullptr) {
      const int64_t a = accepted_tokens(p, i);
      bad = bad || a < 1 || a > p.state_tokens;
    }
    if (bad) atomicMin(p.status, kStatusStateIndexBase + static_cast<unsigned long long>(i));
  }
  if (kCheckpoints && p.checkpoint_indices != nullptr && i < p.num_seqs * p.checkpoint_cols) {
    const int64_t index = p.checkpoint_indices_is_int64 ? static_cast<const int64_t*>(p.checkpoint_indices)[i]
                                                        : static_cast<const int32_t*>(p.checkpoint_indices)[i];
    if (index >= p.pool_slots) {  // reported as its sequence, i / M
      atomicMin(p.status, kStatusCheckpointIndexBase + static_cast<unsigned long long>(i / p.checkpoint_cols));
    }
  }
}

}  // namespace kda
