// The stream pass's kernels for a bf16 initial state and a bf16 final state (stream_pass.cuh).
#include "kda/csrc/stream_pass.cuh"

namespace kda {

template void launch_stream_pass_typed<__nv_bfloat16, __nv_bfloat16>(const FwdParams& p, cudaStream_t stream);

}  // namespace kda
