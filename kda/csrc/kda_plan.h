// How a forward call is spread over the GPU, chosen on the host from shapes alone (never from the contents of
// cu_seqlens, which would need a synchronisation): the recurrence's V split.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kda/csrc/cuda_check.h"

namespace kda {

// Recurrence CTAs per (sequence, head). Each CTA owns 128 / v_split state rows (16 per warp), so the split
// changes no bit. One (sequence, head) on one SM is bound by the SM's mma.sync throughput (8 warps share 4
// sub-partitions); split over 2-8 SMs a step is bound by one warp's own chain, about half as long
// (docs/KERNEL.md). Splitting past the SM count only queues CTAs, so the split is the largest power of two
// that still fits the whole grid on the GPU at once.
inline int choose_v_split(int64_t num_seqs, int heads, int sm_count) {
  const int64_t pairs = num_seqs * heads;
  int split = 1;
  while (split < 8 && pairs * split * 2 <= sm_count) split *= 2;
  return split;
}

// Multiprocessor count of the current device, cached per device (a driver query, no synchronisation).
inline int current_sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) {
    int count = 0;
    KDA_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  }
  if (cached[device] == 0) {
    int count = 0;
    KDA_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cached[device] = count;
  }
  return cached[device];
}

}  // namespace kda
