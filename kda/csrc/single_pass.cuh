// The single pass (kda_single_pass_kernel) and its launcher for one (initial, final) state dtype pair,
// instantiated by single_pass_<initial>_<final>.cu.
#pragma once

#include <cuda_bf16.h>

#include "kda/csrc/checkpoint_writer.cuh"
#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/recurrence_launch.cuh"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/recurrence_step.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"

namespace kda {

// The single pass (plan.single_pass, no time split): one CTA of two warpgroups per (sequence, head) prepares its own
// chunks, kSinglePassStages at a time, into a ring of as many stages (warp w prepares chunk w of the block,
// prepare_chunk.cuh) while its value rows land, then runs their steps from the ring (run_chunks, kSelfFed).
// No workspace records: 1,282 instead of 3,018 bytes per token-head cross HBM. The two halves of a block take turns
// on the SM instead of sharing it (a co-resident preparation slows the steps about as much as it takes,
// docs/DESIGN.md, "The single pass"), so this pays where many (sequence, head) pairs fill the GPU, not where a few
// long ones run.
constexpr int kSinglePassWarps = 8;
constexpr int kSinglePassStages = kSinglePassWarps;  // one chunk per warp and block
struct SinglePassSmem {
  using Ring = RecurrenceSmem<kSinglePassWarps, kSinglePassStages>;
  static constexpr int kScratchOffset = (Ring::kBytes + 127) / 128 * 128;  // one preparation tile per warp
  static constexpr int kBytes = kScratchOffset + kSinglePassWarps * prep::kPrepTileBytes;
  static constexpr int kLaunchBytes = kBytes + 1024;  // room to align the ring's start
};

// kCheckpoints: as the finishing pass's (finish_pass.cuh).
template <typename InitT, typename FinalT, bool kHiLo, bool kCheckpoints>
__global__ void __launch_bounds__(kSinglePassWarps * 32, 1) kda_single_pass_kernel(const FwdParams p) {
  using Ring = SinglePassSmem::Ring;
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = warp * 16;

  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  auto* scratch =
      reinterpret_cast<__nv_bfloat16*>(smem + SinglePassSmem::kScratchOffset + warp * prep::kPrepTileBytes);

  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;
  // The sequence's state slot (state_slots.cuh; -1: start from zeros, write nothing), looked up where each state
  // is touched rather than held in registers across the chunks.
  const int64_t first_slot = p.initial_state != nullptr ? state_slot(p, n) : -1;

  StateRows s;
  if (first_slot >= 0) {
    load_rows<InitT>(s, static_cast<const InitT*>(p.initial_state) + state_offset(p, first_slot, h), v_base, gi, ti);
  } else {
    fill_rows(s, 0.f);
  }

  // This warp's value rows, laid out as run_chunks lays them out (Ring::value_fill_offset, value_fill_source).
  const int64_t token_stride = static_cast<int64_t>(p.heads) * kHeadDim;
  const int fill_token = lane >> 1;
  const __nv_bfloat16* v_head =
      static_cast<const __nv_bfloat16*>(p.v) + bounds.bos * token_stride + h * kHeadDim + v_base;
  const int fill_dst = Ring::value_fill_offset(lane, v_base);

  [[maybe_unused]] const CheckpointWriter<FinalT> checkpoints{p, n, h, len, 0, v_base, gi, ti};
  for (int64_t c0 = 0; c0 < num_chunks; c0 += kSinglePassStages) {
    const int count = static_cast<int>(min(num_chunks - c0, static_cast<int64_t>(kSinglePassStages)));
#pragma unroll
    for (int c = 0; c < kSinglePassStages; ++c) {
      if (c < count) {
        const int64_t token = (c0 + c) * kChunk;
        const __nv_bfloat16* chunk_v = v_head + token * token_stride;
        const bool valid = token + fill_token < len;
        cp_async_16(smem + c * Ring::kStageBytes + fill_dst, valid ? value_fill_source(chunk_v, lane, token_stride) : chunk_v,
                    valid ? 16 : 0);
      }
    }
    cp_async_commit();
    if (warp < count) {
      const int64_t token = (c0 + warp) * kChunk;
      const int rows = static_cast<int>(min(len - token, static_cast<int64_t>(kChunk)));
      prep::prepare_chunk<true>(p, h, bounds.bos + token, rows, smem + warp * Ring::kStageBytes, scratch, lane);
    }
    cp_async_wait<0>();
    fence_proxy_async_shared();  // the records' stores before the other warps' wgmma reads
    __syncthreads();
    if constexpr (kCheckpoints) {
      run_chunks<kSinglePassWarps, true, true, true, kHiLo, kSinglePassStages, true, CheckpointWriter<FinalT>>(
          p, smem, nullptr, n, h, bounds, c0, count, v_base, s, checkpoints);
    } else {
      run_chunks<kSinglePassWarps, true, true, true, kHiLo, kSinglePassStages, true>(p, smem, nullptr, n, h, bounds,
                                                                                    c0, count, v_base, s);
    }
    __syncthreads();  // every warp's last products have read the ring before the next block overwrites it
  }

  const int64_t last_slot = p.final_state != nullptr ? state_slot(p, n) : -1;
  if (last_slot >= 0) {
    store_rows(static_cast<FinalT*>(p.final_state) + state_offset(p, last_slot, h), s, v_base, gi, ti);
  }
}

template <auto kKernel>
void launch_single_pass_kernel(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads));
  opt_in_dynamic_smem<kKernel>(SinglePassSmem::kLaunchBytes);
  kKernel<<<grid, kSinglePassWarps * 32, SinglePassSmem::kLaunchBytes, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_single_pass_kernel");
}

template <typename InitT, typename FinalT>
void launch_single_pass_typed(const FwdParams& p, cudaStream_t stream) {
  with_hi_lo(p.lower_bound, [&](auto hi_lo) {
    if (p.checkpoint_chunks > 0) {
      launch_single_pass_kernel<kda_single_pass_kernel<InitT, FinalT, decltype(hi_lo)::value, true>>(p, stream);
    } else {
      launch_single_pass_kernel<kda_single_pass_kernel<InitT, FinalT, decltype(hi_lo)::value, false>>(p, stream);
    }
  });
}

}  // namespace kda
