// The finishing pass's kernels for an bf16 initial state and an fp32 final state (finish_pass.cuh).
#include "kda/csrc/finish_pass.cuh"

namespace kda {

template void launch_finish_pass<__nv_bfloat16, float>(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
