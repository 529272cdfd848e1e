// KDA forward, the overlap: the tail kernel, which prepares the chunks past the lead while the finishing pass
// runs and publishes each record with a ready flag (kda_params.h, "The overlap").
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/dependent_launch.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"

namespace kda {
namespace {

using prep::PrepScratch;
using prep::prepare_fixed_chunk;

// The overlap's tail: one CTA of kTailWarps warps per SM that the recurrence leaves free (its registers leave room
// for neither a second tail CTA nor a recurrence CTA), launched as a programmatic dependent of the
// preparation kernel; the recurrence kernel is in turn launched as its dependent, once every tail CTA has waited
// for the lead to complete. Its warps take the tail items (j, n, h) in chunk-major order, the order in which the
// recurrence needs them, kTailWarps items per CTA at a time, each warp at its own pace (a CTA barrier per round of
// items measured 10 % slower: 1.66 against 1.51 ms for T8192 H96's 49,152 records on 36 SMs), and publish each
// record with its ready flag. 12 warps of 168 registers: 16 of 128 spill 120 bytes and ran no faster, 8 of 255
// slower (measured on the H200, 2026-12-01). The softplus gate's item (its anchored products) fits 168 registers
// too once lane and warp are read per item (fresh_tid_x): T8192 H96 with a lead of 300 chunks, where the recurrence
// waits for the tail, 1.30 ms against 1.47 on 8 warps of 255 registers (H200, 2026-12-03).
constexpr int kTailWarps = 12;

// threadIdx.x read afresh where it is called: nothing derived from it is hoisted out of the tail's loop and held
// live across the next item's preparation (the softplus item then spilled 360 bytes at 168 registers, now 88).
__device__ __forceinline__ uint32_t fresh_tid_x() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

template <GateKind kGate>
__global__ void __launch_bounds__(kTailWarps * 32, 1) kda_prepare_tail_kernel(const FwdParams p) {
  grid_dependency_wait();   // the lead's records and the flags' zeroing are complete and visible
  grid_launch_dependents();  // the recurrence may launch once every tail CTA is here
  // 32-bit item arithmetic (registers): a workspace of 868 bytes per token-head that fits in memory has far
  // fewer than 2^31 records.
  const int H = p.heads;
  const int N = static_cast<int>(p.num_seqs);
  const int items = static_cast<int>(overlap_tail_items(p.seqlen, p.num_seqs, H, p.lead_chunks));
  const int per_chunk = N * H;
  uint32_t* flags = overlap_flags(p);
  for (int base = static_cast<int>(blockIdx.x) * kTailWarps; base < items;
       base += static_cast<int>(gridDim.x) * kTailWarps) {
    const int tid = static_cast<int>(fresh_tid_x());
    const int warp = tid >> 5, lane = tid & 31;
    const int item = base + warp;
    if (item < items) {
      prepare_fixed_chunk<kGate>(p, p.lead_chunks + item / per_chunk, (item / H) % N, item % H, lane, warp);
      // Release: every lane's record stores, for the async proxy (the bulk copy that reads the record) and
      // GPU-wide, before lane 0 sets the flag (run_chunks' producer warp has the acquire half).
      fence_proxy_async_global();
      __threadfence();
      __syncwarp();
      if (lane == 0) st_release_gpu(&flags[item], 1u);
    }
  }
}

}  // namespace

void launch_prepare_tail(const FwdParams& p, cudaStream_t stream) {
  with_gate(p.gate, [&](auto gate) {
    constexpr GateKind kGate = decltype(gate)::value;
    constexpr int kSmemBytes = kTailWarps * static_cast<int>(sizeof(PrepScratch));
    static_assert(kSmemBytes <= 227 * 1024, "a CTA's dynamic shared memory");
    constexpr auto kKernel = kda_prepare_tail_kernel<kGate>;
    opt_in_dynamic_smem<kKernel>(kSmemBytes);
    const dim3 grid(static_cast<unsigned>(p.tail_ctas)), block(kTailWarps * 32);
    if (p.lead_chunks > 0) {
      launch_dependent(kKernel, grid, block, kSmemBytes, stream, p);
    } else {
      kKernel<<<grid, block, kSmemBytes, stream>>>(p);  // no lead kernel to depend on
    }
  });
  KDA_CHECK_LAUNCH("kda_prepare_tail_kernel");
}

}  // namespace kda
