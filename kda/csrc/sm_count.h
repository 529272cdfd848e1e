// The current device's SM count, asked of the runtime once per device: the persistent kernels size their grids by
// it and the stream pass's routing counts items against it, on every call.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "kda/csrc/cuda_check.h"

namespace kda {

inline int current_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_per_device[kMaxDevices] = {};
  int device = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&device));
  int sms = device < kMaxDevices ? sms_per_device[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    KDA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (device < kMaxDevices) sms_per_device[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

}  // namespace kda
