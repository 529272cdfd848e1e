// Error checking for CUDA runtime calls and kernel launches: failures become C++ exceptions that the
// pybind11 binding turns into Python RuntimeErrors naming the call and CUDA's message.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace kda {

inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw std::runtime_error(std::string("flash_kda: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line));
}

}  // namespace kda

#define KDA_CUDA_CHECK(call)                                                   \
  do {                                                                         \
    const cudaError_t kda_err_ = (call);                                       \
    if (kda_err_ != cudaSuccess) ::kda::throw_cuda_error(kda_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a launch: configuration errors show up here; asynchronous faults surface at the next sync.
#define KDA_CHECK_LAUNCH(kernel_name)                                          \
  do {                                                                         \
    const cudaError_t kda_err_ = cudaGetLastError();                           \
    if (kda_err_ != cudaSuccess) ::kda::throw_cuda_error(kda_err_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)
