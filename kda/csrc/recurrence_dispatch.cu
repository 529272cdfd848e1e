// launch_recurrence and launch_single_pass: the finishing pass and the single pass for the call's state dtypes.
// Their kernels are compiled by finish_pass_<initial>_<final>.cu and single_pass_<initial>_<final>.cu, one file
// per state dtype pair, in parallel; the scan pass launches from scan_pass.cu.
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

}  // namespace kda
