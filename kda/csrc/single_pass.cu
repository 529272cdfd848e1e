// launch_single_pass: the single pass for the call's state dtypes (the kernels are compiled by
// single_pass_<initial>_<final>.cu, one file per pair, in parallel).
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_launch.cuh"

namespace kda {

void launch_single_pass(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_state_types(p, [&](auto init, auto final) {
    launch_single_pass_typed<typename decltype(init)::type, typename decltype(final)::type>(p, stream);
  });
}

}  // namespace kda
