// The single pass's kernels for an bf16 initial state and an bf16 final state (single_pass.cuh).
#include "kda/csrc/single_pass.cuh"

namespace kda {

template void launch_single_pass_typed<__nv_bfloat16, __nv_bfloat16>(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
