// The finishing pass of the recurrence (kda_recurrence_kernel) and its launcher for one (initial, final) state
// dtype pair, instantiated by finish_pass_<initial>_<final>.cu.
#pragma once

#include <cuda_bf16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/csrc/checkpoint_writer.cuh"
#include "kda/csrc/cuda_check.h"
#include "kda/csrc/dependent_launch.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_launch.cuh"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/recurrence_step.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"

namespace kda {

// The finishing pass: one CTA per (segment, head, V part) runs the segment's chunks from its true start state
// and writes its outputs (and the checkpoints it passes); a sequence's last segment writes final_state. Without a time split a segment is a
// whole sequence (blockIdx.x = n) and the start state is the caller's initial state. Both states are those of the
// sequence's slot (state_slot: entry n, or its pool slot; none for a padding row).
template <int kWarps, bool kWgmma>
constexpr int kFinishThreads = (kWarps + (kWgmma ? 1 : 0)) * 32;  // the wgmma CTAs add a producer warp
// kOverlap: the records past the lead arrive from the tail kernel while this grid runs (produce_records), and the
// grid completes only after the tail grid has, so that the stream's next work waits for both.
// kCheckpoints: the call asks for checkpoints (checkpoint_writer.cuh); instantiations without them keep the
// step's machine code.
template <typename InitT, typename FinalT, int kWarps, bool kWgmma, bool kHiLo, bool kOverlap = false,
          bool kCheckpoints = false>
__global__ void __launch_bounds__(kFinishThreads<kWarps, kWgmma>, 1) kda_recurrence_kernel(const FwdParams p) {
  using Smem = RecurrenceSmem<kWarps>;
  // Longest first (kda_params.h): the grid is (head, rank), so CTAs start in the order of the sequences' lengths.
  const int h = p.longest_first ? blockIdx.x : blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = blockIdx.z * Smem::kRows + warp * 16;

  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  uint64_t* full = init_ring<kWarps>(smem);

  const int L = p.segment_chunks;
  // Sequence and segment of this CTA column (kda_params.h, pass_columns).
  int64_t n = p.longest_first ? longest_first_order(p)[blockIdx.y] : blockIdx.x, j = 0;
  if (L > 0 && p.cu_seqlens == nullptr) {
    const int64_t segments = segment_count(p.seqlen, L);
    n = blockIdx.x / segments;
    j = blockIdx.x % segments;
  } else if (L > 0) {
    n = find_sequence(p.cu_seqlens, p.cu_seqlens_is_int64, p.num_seqs, p.seqlen, p.total_tokens, blockIdx.x,
                      [L](int64_t bos, int64_t i) { return first_segment_slot(bos, i, L); });
  }
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;

  StateRows s;
  int64_t c0 = 0, count = num_chunks;
  bool last = true;
  const float* split_start = nullptr;  // the start state from the time split's composition (fp32)
  if (L > 0) {
    if (p.cu_seqlens != nullptr) j = static_cast<int64_t>(blockIdx.x) - first_segment_slot(bounds.bos, n, L);
    const int64_t segments = segment_count(len, L);
    if (j < 0 || j >= segments) return;  // an unused segment slot (CTA-uniform)
    c0 = j * L;
    count = num_chunks - c0 < L ? num_chunks - c0 : L;
    last = j + 1 == segments;
    if (segments > 1) {
      split_start = reinterpret_cast<const float*>(
          j == 0 ? window_data(p, window_of(bounds.bos, n, 0, L), h) + WindowLayout::kFirstOffset
                 : window_data(p, window_of(bounds.bos, n, j - 1, L), h) + WindowLayout::kNextOffset);
    }
  }
  if constexpr (kWgmma) {
    if (warp == kWarps) {  // the producer warp
      if (lane == 0) {
        produce_records<kWarps, kOverlap>(p, smem, full, n, h, bounds, c0, count);
        if constexpr (kOverlap) grid_dependency_wait();
      }
      return;
    }
  }
  // The sequence's state slot (state_slots.cuh; -1: start from zeros, write nothing), looked up where each state
  // is touched rather than held in registers across the chunks.
  const int64_t first_slot = split_start == nullptr && p.initial_state != nullptr ? state_slot(p, n) : -1;
  if (split_start != nullptr) {
    load_rows<float>(s, split_start, v_base, gi, ti);
  } else if (first_slot >= 0) {
    load_rows<InitT>(s, static_cast<const InitT*>(p.initial_state) + state_offset(p, first_slot, h), v_base, gi, ti);
  } else {
    fill_rows(s, 0.f);
  }

  if constexpr (kCheckpoints) {
    const CheckpointWriter<FinalT> checkpoints{p, n, h, len, c0, v_base, gi, ti};
    run_chunks<kWarps, true, true, kWgmma, kHiLo, kStages, false, CheckpointWriter<FinalT>>(
        p, smem, full, n, h, bounds, c0, count, v_base, s, checkpoints);
  } else {
    run_chunks<kWarps, true, true, kWgmma, kHiLo>(p, smem, full, n, h, bounds, c0, count, v_base, s);
  }

  const int64_t last_slot = last && p.final_state != nullptr ? state_slot(p, n) : -1;
  if (last_slot >= 0) {
    store_rows(static_cast<FinalT*>(p.final_state) + state_offset(p, last_slot, h), s, v_base, gi, ti);
  }
}

template <typename InitT, typename FinalT>
void launch_finish_pass(const FwdParams& p, cudaStream_t stream) {
  const int64_t columns = pass_columns(p).finish;
  const dim3 grid = p.longest_first ? dim3(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.num_seqs))
                                    : dim3(static_cast<unsigned>(columns), static_cast<unsigned>(p.heads),
                                           static_cast<unsigned>(p.v_split));
  const auto launch = [&](auto checkpoints) {
    constexpr bool kCheckpoints = decltype(checkpoints)::value;
    with_warps(p.v_split, p.lower_bound, [&](auto warps, auto hi_lo) {
      constexpr int kWarps = decltype(warps)::value;
      constexpr bool kHiLo = decltype(hi_lo)::value;
      constexpr bool kWgmma = kUseWgmma<kWarps>;
      if (p.lead_chunks < 0) {
        launch_ring_kernel<kWarps, kda_recurrence_kernel<InitT, FinalT, kWarps, kWgmma, kHiLo, false, kCheckpoints>,
                           kFinishThreads<kWarps, kWgmma>>(grid, p, stream);
      } else if constexpr (kWarps == 8) {
        // The overlap: a programmatic dependent of the tail kernel, which lets it launch once every tail CTA holds
        // its SM, so that these CTAs take the others (prepare_tail.cu).
        constexpr auto kKernel = kda_recurrence_kernel<InitT, FinalT, kWarps, kWgmma, kHiLo, true, kCheckpoints>;
        using Smem = RecurrenceSmem<kWarps>;
        opt_in_dynamic_smem<kKernel>(Smem::kLaunchBytes);
        launch_dependent(kKernel, grid, dim3(kFinishThreads<kWarps, kWgmma>), Smem::kLaunchBytes, stream, p);
      } else {
        throw std::invalid_argument("flash_kda: the overlap runs v_split 1, got v_split " +
                                    std::to_string(p.v_split));
      }
    });
  };
  if (p.checkpoint_chunks > 0) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
  KDA_CHECK_LAUNCH("kda_recurrence_kernel");
}

}  // namespace kda
