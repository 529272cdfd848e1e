// The device's error word (FwdParams::status): one int64 per CUDA device that the boundary check lowers to the
// first malformed index of a CUDA cu_seqlens, and that flash_kda.last_error takes (reads and resets).
//
// It lives in memory of its own (cudaMalloc here, not PyTorch's caching allocator) so that creating it never
// lands inside a memory pool that CUDA graph capture or torch.compile's CUDA graph trees own (their pools must
// hold only tracked tensors); it is created once per device, before any capture, and never freed.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/status_word.h"

namespace kda {
namespace {

// Makes `device` current for the calls in scope and restores the previous one.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    KDA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) KDA_CUDA_CHECK(cudaSetDevice(device));
  }
  ~OnDevice() { cudaSetDevice(previous_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
};

// word[1] = word[0]; word[0] = clear, in one atomic exchange: a lowering from work enqueued after the query's
// synchronisation is either seen now or left for the next query, never lost.
__global__ void take_status_kernel(unsigned long long* word) { word[1] = atomicExch(word, kStatusClear); }

}  // namespace

std::uintptr_t status_word_create(int device) {
  const OnDevice on(device);
  unsigned long long* word = nullptr;
  KDA_CUDA_CHECK(cudaMalloc(&word, 2 * sizeof(unsigned long long)));
  const unsigned long long init[2] = {kStatusClear, kStatusClear};
  KDA_CUDA_CHECK(cudaMemcpy(word, init, sizeof(init), cudaMemcpyHostToDevice));
  return reinterpret_cast<std::uintptr_t>(word);
}

uint64_t status_word_take(std::uintptr_t address, int device) {
  const OnDevice on(device);
  auto* word = reinterpret_cast<unsigned long long*>(address);
  // Every stream of the device: the query covers all work enqueued before it, wherever it was enqueued.
  KDA_CUDA_CHECK(cudaDeviceSynchronize());
  take_status_kernel<<<1, 1>>>(word);
  KDA_CHECK_LAUNCH("take_status_kernel");
  unsigned long long taken = kStatusClear;
  KDA_CUDA_CHECK(cudaMemcpy(&taken, word + 1, sizeof(taken), cudaMemcpyDeviceToHost));
  return taken;
}

}  // namespace kda
