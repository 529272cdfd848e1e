// The recurrence's ring, shared by the finishing pass, the scan pass and the single pass: kStages stages of shared
// memory, each holding one chunk's workspace record (one bulk copy, completing on the stage's "full" mbarrier) and
// the CTA's value rows of that chunk (one cp.async per lane and warp); and the producer warp of the two-warpgroup
// finishing CTAs, which refills each stage once its consumers released it on its "empty" mbarrier. The consumers'
// side (waiting, releasing, the refills of CTAs without a producer) is in run_chunks (recurrence_step.cuh).
#pragma once

#include <cuda_bf16.h>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/sm90_async.cuh"

namespace kda {

// Chunks in flight: hides the record's trip from HBM/L2 behind ~3 steps (6 and 8 measured slower: docs/DESIGN.md,
// "The step").
constexpr int kStages = 4;

// Shared-memory ring of kRingStages stages of one CTA that owns kWarps * 16 state rows.
template <int kWarps, int kRingStages = kStages>
struct RecurrenceSmem {
  static constexpr int kRows = kWarps * 16;
  // Value rows [token c][v of this CTA], padded by 16 bytes so the 8 rows an ldmatrix phase reads sit in
  // different banks (and every row stays 16-byte aligned for the bulk copies).
  static constexpr int kValueStride = kRows * 2 + 16;
  static constexpr int kValueOffset = ChunkRecordLayout::kBytes;
  // Stages start 1024-byte aligned: wgmma's 128-byte swizzle is a function of the address bits.
  static constexpr int kStageBytes = (kValueOffset + kChunk * kValueStride + 1023) / 1024 * 1024;
  static constexpr int kBarrierOffset = kRingStages * kStageBytes;
  static constexpr int kEmptyOffset = kBarrierOffset + kRingStages * 8;  // used by CTAs with a producer warp
  static constexpr int kBytes = kEmptyOffset + kRingStages * 8;
  static constexpr int kLaunchBytes = kBytes + 1024;  // room to align the dynamic shared memory's start
  // A warp fetches its value columns of a chunk with one 16-byte cp.async per lane: token lane / 2, 8-column half
  // lane % 2. Where that piece goes in a stage, for the warp whose first row in the CTA is local_v:
  static __device__ __forceinline__ int value_fill_offset(int lane, int local_v) {
    return kValueOffset + (lane >> 1) * kValueStride + 2 * (local_v + 8 * (lane & 1));
  }
};
// And where it comes from, given the chunk's first value of the warp's first column (rows past the end of a
// sequence are zero-filled from that first value instead, which is in bounds, so that β = 0 meets finite values).
__device__ __forceinline__ const __nv_bfloat16* value_fill_source(const __nv_bfloat16* chunk_v, int lane,
                                                                  int64_t token_stride) {
  return chunk_v + (lane >> 1) * token_stride + 8 * (lane & 1);
}

// The ring's start: the dynamic shared memory rounded up to 1024 bytes.
__device__ __forceinline__ uint8_t* aligned_ring(uint8_t* dynamic_smem) {
  return dynamic_smem + ((1024u - (smem_addr(dynamic_smem) & 1023u)) & 1023u);
}

// Lane 0 brings one chunk's workspace record into `stage` with one bulk copy that completes on `full`.
__device__ __forceinline__ void fill_record(uint8_t* stage, uint64_t* full, const uint8_t* record, int lane) {
  if (lane == 0) {
    mbarrier_arrive_expect_tx(full, ChunkRecordLayout::kBytes);
    bulk_copy_g2s(stage, record, ChunkRecordLayout::kBytes, full);
  }
}

// Sets up the CTA's stage barriers (once per CTA: a CTA runs one chunk range).
template <int kWarps>
__device__ __forceinline__ uint64_t* init_ring(uint8_t* smem) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + RecurrenceSmem<kWarps>::kBarrierOffset);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + RecurrenceSmem<kWarps>::kEmptyOffset);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(&full[st], 1);
      mbarrier_init(&empty[st], kWarps * 32);  // one arrival per consumer thread (CTAs with a producer warp)
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  return full;
}

// The producer warp of a two-warpgroup finishing CTA (its lane 0): the records of chunks c0 .. c0 + count - 1
// into the ring, each stage refilled once all 8 consumer warps released it on its empty barrier.
// kOverlap (kda_params.h, "The overlap"; no time split, so c0 = 0): a record past the lead is copied only once
// its ready flag is set (the acquire half of the tail kernel's release), polled before the stage is free so that
// the flag's round trip overlaps the consumers' steps.
template <int kWarps, bool kOverlap>
__device__ __forceinline__ void produce_records(const FwdParams& p, uint8_t* smem, uint64_t* full, int64_t n, int h,
                                                const SeqBounds& bounds, int64_t c0, int64_t count) {
  using Smem = RecurrenceSmem<kWarps>;
  uint64_t* empty = full + kStages;  // RecurrenceSmem::kEmptyOffset
  const uint8_t* record = static_cast<const uint8_t*>(p.workspace) +
                          (static_cast<size_t>(first_slot(bounds.bos, n) + c0) * p.heads + h) *
                              static_cast<size_t>(ChunkRecordLayout::kBytes);
  const size_t record_stride = static_cast<size_t>(p.heads) * ChunkRecordLayout::kBytes;
  const int steps = static_cast<int>(count);
  const uint32_t* flag = nullptr;  // the overlap: the ready flag of the first tail record, then the next one
  if constexpr (kOverlap) {
    flag = overlap_flags(p) + overlap_tail_item(p.lead_chunks, n, h, p.lead_chunks, p.num_seqs, p.heads);
  }
  const int64_t flag_stride = p.num_seqs * p.heads;
  for (int c = 0; c < steps; ++c) {
    const int st = c % kStages;
    if constexpr (kOverlap) {
      if (c >= p.lead_chunks) {
        while (ld_acquire_gpu(flag) == 0u) __nanosleep(32);
        fence_proxy_async_global();  // the record's stores, seen through the flag, before the bulk copy reads it
        flag += flag_stride;
      }
    }
    if (c >= kStages) mbarrier_wait_parity(&empty[st], ((c / kStages) - 1) & 1);
    mbarrier_arrive_expect_tx(&full[st], ChunkRecordLayout::kBytes);
    bulk_copy_g2s(smem + st * Smem::kStageBytes, record, ChunkRecordLayout::kBytes, &full[st]);
    record += record_stride;
  }
}

}  // namespace kda
