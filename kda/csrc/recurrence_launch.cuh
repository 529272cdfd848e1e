// Host side of the recurrence's passes: the plan's run-time choices (state dtypes, CTA size, the hi/lo state
// update) as compile-time parameters, and the launchers that the instantiation files define
// (finish_pass_<initial>_<final>.cu, single_pass_<initial>_<final>.cu).
#pragma once

#include <cuda_bf16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_types.h"

namespace kda {

// Launches kKernel (a CTA of kWarps warps and RecurrenceSmem<kWarps>) on `grid`.
template <int kWarps, auto kKernel, int kThreads = kWarps * 32>
void launch_ring_kernel(const dim3& grid, const FwdParams& p, cudaStream_t stream) {
  using Smem = RecurrenceSmem<kWarps>;
  opt_in_dynamic_smem<kKernel>(Smem::kLaunchBytes);
  kKernel<<<grid, kThreads, Smem::kLaunchBytes, stream>>>(p);
}

template <typename HiLo, typename Launch>
void with_warps_and(int v_split, HiLo hi_lo, Launch launch) {
  switch (v_split) {
    case 1: return launch(std::integral_constant<int, 8>{}, hi_lo);
    case 2: return launch(std::integral_constant<int, 4>{}, hi_lo);
    case 4: return launch(std::integral_constant<int, 2>{}, hi_lo);
    case 8: return launch(std::integral_constant<int, 1>{}, hi_lo);
    default: throw std::invalid_argument("flash_kda: v_split must be 1, 2, 4 or 8, got " + std::to_string(v_split));
  }
}

// The state update of the call's lower bound (kda_plan.h) as a compile-time flag: launch(std::bool_constant).
template <typename Launch>
void with_hi_lo(float lower_bound, Launch launch) {
  if (hi_lo_state_update(lower_bound)) return launch(std::true_type{});
  return launch(std::false_type{});
}

// CTAs of 128 / v_split rows, i.e. 8 / v_split warps, and the state update of the call's lower bound.
template <typename Launch>
void with_warps(int v_split, float lower_bound, Launch launch) {
  with_hi_lo(lower_bound, [&](auto hi_lo) { with_warps_and(v_split, hi_lo, launch); });
}

// Which CTAs run their products as wgmma: those of two warpgroups, which share an SM's tensor cores and are
// bound by their throughput (wgmma reads each B operand once per warpgroup, mma.sync once per warp). A CTA of
// one warpgroup is bound by the step's dependent chain, which is shorter with mma.sync (three wgmma round
// trips per step); docs/DESIGN.md, "The step", has the measurements.
template <int kWarps>
constexpr bool kUseWgmma = kWarps == 8;

// The finishing pass of one (initial, final) state dtype pair (finish_pass.cuh; finish_pass_<initial>_<final>.cu).
template <typename InitT, typename FinalT>
void launch_finish_pass(const FwdParams& p, cudaStream_t stream);

// The single pass of one (initial, final) state dtype pair (single_pass.cuh; single_pass_<initial>_<final>.cu).
template <typename InitT, typename FinalT>
void launch_single_pass_typed(const FwdParams& p, cudaStream_t stream);
// The stream pass of one (initial, final) state dtype pair (stream_pass.cuh; stream_pass_<initial>_bf16.cu).
template <typename InitT, typename FinalT>
void launch_stream_pass_typed(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
