// Opting a kernel into more than 48 KB of dynamic shared memory: once per kernel and device (a driver call,
// no synchronisation). The kernel is a template argument so that each kernel keeps its own record.
#pragma once

#include <cuda_runtime_api.h>

#include "kda/csrc/cuda_check.h"

namespace kda {

template <auto kKernel>
void opt_in_dynamic_smem(int bytes) {
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices || !opted_in[device]) {
    KDA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (device < kMaxDevices) opted_in[device] = true;
  }
}

}  // namespace kda
