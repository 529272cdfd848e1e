// The single pass's kernels for an fp32 initial state and an fp32 final state (single_pass.cuh).
#include "kda/csrc/single_pass.cuh"

namespace kda {

template void launch_single_pass_typed<float, float>(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
