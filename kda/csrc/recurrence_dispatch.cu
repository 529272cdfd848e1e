// launch_recurrence, launch_single_pass and launch_stream_pass: the finishing pass, the single pass and the stream
// pass for the call's state dtypes. Their kernels are compiled by finish_pass_<initial>_<final>.cu,
// single_pass_<initial>_<final>.cu and stream_pass_<initial>_bf16.cu, one file per state dtype pair, in parallel;
// the scan pass launches from scan_pass.cu.
#include <cuda_bf16.h>

#include <stdexcept>

#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_launch.cuh"

namespace kda {

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_state_types(p, [&](auto init, auto final) {
    launch_finish_pass<typename decltype(init)::type, typename decltype(final)::type>(p, stream);
  });
}

void launch_single_pass(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_state_types(p, [&](auto init, auto final) {
    launch_single_pass_typed<typename decltype(init)::type, typename decltype(final)::type>(p, stream);
  });
}

void launch_stream_pass(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  // stream_pass_runs routes no fp32 final state here, so a bf16 final state (or none) is the only kind compiled.
  if (p.final_state != nullptr && p.final_is_fp32) {
    throw std::logic_error("flash_kda: the stream pass writes bf16 final states only (kda_plan.h, stream_pass_runs)");
  }
  // Its preparing warps take each item as one whole chunk and count the items in 32 bits.
  if (p.cu_seqlens != nullptr || p.seqlen != kChunk || p.num_seqs * p.heads > kStreamPassMaxItems) {
    throw std::logic_error("flash_kda: the stream pass takes fixed-length calls of 16 tokens below 2^31 (sequence, "
                           "head) items only (kda_plan.h, stream_pass_runs)");
  }
  if (p.initial_is_fp32) {
    launch_stream_pass_typed<float, __nv_bfloat16>(p, stream);
  } else {
    launch_stream_pass_typed<__nv_bfloat16, __nv_bfloat16>(p, stream);
  }
}

}  // namespace kda
