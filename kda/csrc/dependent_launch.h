// Launching a kernel as a programmatic dependent of the stream's previous kernel (the overlap's tail and
// recurrence kernels, docs/DESIGN.md, "The overlap"): it may start once every CTA of the previous grid has executed
// griddepcontrol.launch_dependents (sm90_async.cuh) or exited, instead of once that grid has completed.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kda/csrc/cuda_check.h"

namespace kda {

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  KDA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kda
