// The finishing pass's kernels for an fp32 initial state and an bf16 final state (finish_pass.cuh).
#include "kda/csrc/finish_pass.cuh"

namespace kda {

template void launch_finish_pass<float, __nv_bfloat16>(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
