// Build and device facts for flash_kda.build_info() / device_info(): what this extension was compiled for
// and what the visible GPU and driver are.
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/kda_launch.h"

#ifndef KDA_CUDA_ARCHS
#define KDA_CUDA_ARCHS "unknown"
#endif

namespace kda {
namespace {

// Reports the architecture a kernel was actually built for (binaryVersion 90 = sm_90[a]).
__global__ void probe_kernel() {}

std::string version_string(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

}  // namespace

std::map<std::string, std::string> build_info() {
  return {
      {"cuda_toolkit", version_string(CUDART_VERSION)},
      {"nvcc", std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__) + "." +
                   std::to_string(__CUDACC_VER_BUILD__)},
      {"archs", KDA_CUDA_ARCHS},
      {"cudart", "static"},
  };
}

std::map<std::string, std::string> device_info(int device) {
  int count = 0;
  KDA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    throw std::invalid_argument("flash_kda: device=" + std::to_string(device) + " but " + std::to_string(count) +
                                " CUDA device(s) are visible");
  }
  cudaDeviceProp prop{};
  KDA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  KDA_CUDA_CHECK(cudaDriverGetVersion(&driver));
  KDA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  int previous = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&previous));
  KDA_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  const cudaError_t probe = cudaFuncGetAttributes(&attr, probe_kernel);
  KDA_CUDA_CHECK(cudaSetDevice(previous));
  return {
      {"name", prop.name},
      {"major", std::to_string(prop.major)},
      {"minor", std::to_string(prop.minor)},
      {"sm_count", std::to_string(prop.multiProcessorCount)},
      {"l2_bytes", std::to_string(prop.l2CacheSize)},
      {"smem_per_block_optin", std::to_string(prop.sharedMemPerBlockOptin)},
      {"global_memory_bytes", std::to_string(prop.totalGlobalMem)},
      {"driver_version", version_string(driver)},
      {"runtime_version", version_string(runtime)},
      {"kernel_binary_arch", probe == cudaSuccess ? "sm_" + std::to_string(attr.binaryVersion) : "unavailable"},
  };
}

}  // namespace kda
