// Prefix-cache checkpoints from the chunked recurrence: after each chunk, the state of a sequence that has just
// completed a multiple of C tokens goes to its checkpoint slot (state_slots.cuh, checkpoint_slot; kda_params.h).
// The finishing pass (every plan with a finishing pass: two stages, the time split's segments, the overlap) and the
// single pass hand it to run_chunks as the step's chunk_end; the decode kernels write their own (decode.cu,
// decode_chunk.cu). None is written into the sequence's own final slot (checkpoint_slot).
#pragma once

#include <cstdint>

#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/state_slots.cuh"

namespace kda {

template <typename FinalT>
struct CheckpointWriter {
  const FwdParams& p;
  int64_t n;    // the sequence
  int h;        // the head
  int64_t len;  // the sequence's tokens: a checkpoint lies within them (a partial last chunk ends none)
  int v_base, gi, ti;
  // The chunk count of the next multiple of C after the first chunk this CTA runs (c0), or -1: the step compares
  // one register, and the division stays off its dependent chain (a 64-bit remainder per step measured +10 us of
  // 104 at T8192 H32 and +20 us of 86 at T131072 H1 on the H200, 2026-12-02, with no checkpoint written).
  mutable int64_t next;

  __device__ __forceinline__ CheckpointWriter(const FwdParams& params, int64_t seq, int head, int64_t tokens,
                                              int64_t c0, int v0, int g, int t)
      : p(params), n(seq), h(head), len(tokens), v_base(v0), gi(g), ti(t),
        next(params.checkpoint_chunks > 0 && params.final_state != nullptr
                 ? (c0 / params.checkpoint_chunks + 1) * params.checkpoint_chunks
                 : -1) {}

  // `chunks` chunks of the sequence are done and `s` is the state after them. Warp-uniform (store_rows shuffles).
  __device__ __forceinline__ void operator()(int64_t chunks, const StateRows& s) const {
    if (chunks != next) return;
    next += p.checkpoint_chunks;
    if (chunks * kChunk > len) return;
    const int64_t slot = checkpoint_slot(p, n, chunks, state_slot(p, n));
    if (slot >= 0) store_rows(static_cast<FinalT*>(p.final_state) + state_offset(p, slot, h), s, v_base, gi, ti);
  }
};

}  // namespace kda
