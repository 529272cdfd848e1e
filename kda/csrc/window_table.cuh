// The time split's window table (kda_params.h, "the window table"): entry w names the scanned segment (n, j) that
// starts in window w, or n = -1. The preparation writes it, the scan and the composition read it.
//
// An entry moves as one 64-bit word, and a reader accepts it only if it names a segment that really starts in its
// window: under malformed cu_seqlens (clamped, so sequences may overlap) two warps may write one entry, and a torn
// or stale pair would send the scan to records outside its sequence.
#pragma once

#include <cstdint>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"

namespace kda {

static_assert(sizeof(WindowItem) == 8, "a window entry is one 64-bit word");

__device__ __forceinline__ void store_window_item(const FwdParams& p, int64_t window, int64_t n, int64_t j) {
  const uint64_t word = (static_cast<uint64_t>(static_cast<uint32_t>(j)) << 32) | static_cast<uint32_t>(n);
  reinterpret_cast<uint64_t*>(window_table(p))[window] = word;  // 8-byte aligned: the records are 16-byte units
}

// The scanned segment that starts in `window`, or n = -1 where none does (or where the entry does not name one
// that starts there).
__device__ __forceinline__ WindowItem scanned_segment_in_window(const FwdParams& p, int64_t window) {
  const uint64_t word = reinterpret_cast<const uint64_t*>(window_table(p))[window];
  const WindowItem item{static_cast<int32_t>(static_cast<uint32_t>(word)), static_cast<int32_t>(word >> 32)};
  const WindowItem none{-1, 0};
  if (item.n < 0 || item.n >= p.num_seqs || item.j < 0) return none;
  const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, item.n, p.seqlen, p.total_tokens);
  const int L = p.segment_chunks;
  if (item.j + 1 >= segment_count(b.eos - b.bos, L) || window_of(b.bos, item.n, item.j, L) != window) return none;
  return item;
}

}  // namespace kda
