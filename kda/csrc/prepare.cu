// KDA forward, stage 1 of 2: the token-parallel preparation kernel.
//
// One warp per (chunk slot, head) item; warps never wait for each other, so many items are in flight per SM.
// Each item is one chunk's preparation (prepare_chunk.cuh: everything of a 16-token chunk that does not
// depend on the state S), written to the workspace as one record in the recurrence kernel's shared-memory
// image (kda_params.h).
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/window_table.cuh"

namespace kda {
namespace {

using prep::PrepScratch;
using prep::prepare_chunk;
using prep::prepare_fixed_chunk;

// Eight independent warps per CTA and two CTAs per SM: shared memory allows 18 warps (12 KB each), registers
// are capped at 128 to match 16. CTAs of 8 rather than 2 warps keep an SM's warps on two stretches of the
// (long, unrolled) code instead of eight, which the instruction cache rewards: 0.441 → 0.390 ms at T8192 H96.
// The softplus gate's preparation (its anchored products) needs more registers: 3 CTAs of 4 warps per SM at up to
// 168 registers; its 12 warps as 2 CTAs of 6 or 1 of 12 ran 5 % and 10 % slower (docs/PERFORMANCE.md).
template <GateKind kGate>
struct PrepShape {
  static constexpr int kWarps = kGate == GateKind::kSoftplus ? 4 : 8;
  static constexpr int kCtasPerSm = kGate == GateKind::kSoftplus ? 3 : 2;
};

// Time split of a varlen batch: the warp of a scanned segment's first chunk (head 0) enters the segment in its
// window's table entry (kda_params.h). Entries of windows where no scanned segment starts keep the all-ones
// fill (n = -1). Fixed-length batches need no table: their CTAs find their segments by arithmetic.
__device__ __forceinline__ void note_scanned_segment(const FwdParams& p, int64_t n, int64_t len, int64_t slot,
                                                     int64_t chunk) {
  const int L = p.segment_chunks;
  if (chunk % L != 0) return;
  const int64_t j = chunk / L;
  if (j + 1 >= segment_count(len, L)) return;  // a sequence's last segment needs no map
  if (threadIdx.x % 32 == 0) store_window_item(p, slot / L, n, j);
}

// Item `item` = (chunk slot, head) of the preparation, by one warp.
template <GateKind kGate>
__device__ __forceinline__ void prepare_item(const FwdParams& p, int64_t item, int lane, int warp) {
  const int H = p.heads;
  if (item >= num_chunk_slots(p.total_tokens, p.num_seqs) * H) return;  // warp-uniform; no CTA barrier below
  const int64_t slot = item / H;
  const int h = static_cast<int>(item % H);

  const int64_t n = find_sequence(p.cu_seqlens, p.cu_seqlens_is_int64, p.num_seqs, p.seqlen, p.total_tokens, slot,
                                  [](int64_t bos, int64_t i) { return first_slot(bos, i); });
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t chunk = slot - first_slot(bounds.bos, n);
  const int64_t len = bounds.eos - bounds.bos;
  if (chunk < 0 || chunk * kChunk >= len) return;  // an unused slot
  if (p.segment_chunks > 0 && p.cu_seqlens != nullptr && h == 0) note_scanned_segment(p, n, len, slot, chunk);
  const int64_t remaining = len - chunk * kChunk;
  const int rows = static_cast<int>(remaining < kChunk ? remaining : kChunk);

  extern __shared__ __align__(16) uint8_t prep_smem[];
  PrepScratch& sc = reinterpret_cast<PrepScratch*>(prep_smem)[warp];
  uint8_t* record = static_cast<uint8_t*>(p.workspace) +
                    (static_cast<size_t>(slot) * H + h) * static_cast<size_t>(ChunkRecordLayout::kBytes);
  prepare_chunk<false, kGate>(p, h, bounds.bos + chunk * kChunk, rows, record, sc.kd, lane);
}


// The overlap's lead: item = (n, j < lead_chunks, h) of a fixed-length batch.
template <GateKind kGate>
__device__ __forceinline__ void prepare_lead_item(const FwdParams& p, int64_t item, int lane, int warp) {
  const int64_t chunks = (p.seqlen + kChunk - 1) / kChunk;
  const int64_t lead = p.lead_chunks < chunks ? p.lead_chunks : chunks;
  const int H = p.heads;
  if (item >= p.num_seqs * lead * H) return;  // warp-uniform
  prepare_fixed_chunk<kGate>(p, (item / H) % lead, item / (lead * H), static_cast<int>(item % H), lane, warp);
}

// The overlap's ready flags, zeroed by the lead's threads (grid-stride; one flag per thread unless the lead is
// very short) instead of a memset before the lead: one launch less ahead of the call's first kernel. The tail
// kernel waits for this grid to complete before it sets a flag, and the recurrence, which polls them, launches
// only after that.
__device__ __forceinline__ void zero_overlap_flags(const FwdParams& p) {
  const int64_t flags = overlap_tail_items(p.seqlen, p.num_seqs, p.heads, p.lead_chunks);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < flags; i += stride) {
    overlap_flags(p)[i] = 0u;
  }
}

// kLead: the overlap's lead (prepare_lead_item); its tail kernel is launched as this grid's programmatic
// dependent, so it may start once every CTA of this one has (and waits for this grid to complete before it
// publishes anything).
template <bool kLead, GateKind kGate>
__global__ void __launch_bounds__(PrepShape<kGate>::kWarps * 32, PrepShape<kGate>::kCtasPerSm)
    kda_prepare_kernel(const FwdParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * PrepShape<kGate>::kWarps + warp;
  if constexpr (kLead) {
    zero_overlap_flags(p);
    grid_launch_dependents();
    prepare_lead_item<kGate>(p, item, lane, warp);
  } else {
    prepare_item<kGate>(p, item, lane, warp);
  }
}

}  // namespace

void launch_prepare(const FwdParams& p, cudaStream_t stream) {
  const int64_t chunks = (p.seqlen + kChunk - 1) / kChunk;
  const int64_t items = p.lead_chunks >= 0
                            ? p.num_seqs * (p.lead_chunks < chunks ? p.lead_chunks : chunks) * p.heads
                            : num_chunk_slots(p.total_tokens, p.num_seqs) * p.heads;
  if (items == 0) return;
  with_gate(p.gate, [&](auto gate) {
    constexpr GateKind kGate = decltype(gate)::value;
    constexpr int kPrepWarps = PrepShape<kGate>::kWarps;
    const int64_t blocks = (items + kPrepWarps - 1) / kPrepWarps;
    constexpr int kSmemBytes = kPrepWarps * static_cast<int>(sizeof(PrepScratch));
    // An SM's 228 KB hold its CTAs' scratch and 1 KB reserved per CTA, else fewer CTAs fit than launch_bounds says.
    static_assert(PrepShape<kGate>::kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "the CTAs per SM fit");
    if (p.lead_chunks >= 0) {
      opt_in_dynamic_smem<kda_prepare_kernel<true, kGate>>(kSmemBytes);
      kda_prepare_kernel<true, kGate><<<static_cast<unsigned>(blocks), kPrepWarps * 32, kSmemBytes, stream>>>(p);
    } else {
      opt_in_dynamic_smem<kda_prepare_kernel<false, kGate>>(kSmemBytes);
      kda_prepare_kernel<false, kGate><<<static_cast<unsigned>(blocks), kPrepWarps * 32, kSmemBytes, stream>>>(p);
    }
  });
  KDA_CHECK_LAUNCH("kda_prepare_kernel");
}

}  // namespace kda
