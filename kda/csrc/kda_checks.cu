// Boundary checks of a CUDA cu_seqlens without a host synchronisation: one thread per boundary lowers the
// device's error word (FwdParams::status) to the first malformed index. cu[0] must be 0, cu[N] the number of
// tokens, and cu must not decrease or leave [0, total_tokens]. The kernels themselves clamp malformed
// boundaries (memory stays safe); this records that the call's results are unspecified, for
// flash_kda.last_error. A separate tiny launch, so that the main kernels keep their registers.
#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"

namespace kda {
namespace {

constexpr int kCheckThreads = 256;

__global__ void __launch_bounds__(kCheckThreads) kda_check_boundaries_kernel(const FwdParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCheckThreads + threadIdx.x;
  if (i > p.num_seqs) return;
  const int64_t v = load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i);
  const bool bad = v < 0 || v > p.total_tokens || (i == 0 && v != 0) || (i == p.num_seqs && v != p.total_tokens) ||
                   (i > 0 && load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i - 1) > v);
  if (bad) atomicMin(p.status, static_cast<unsigned long long>(i));
}

}  // namespace

void launch_boundary_check(const FwdParams& p, cudaStream_t stream) {
  if (p.status == nullptr || p.cu_seqlens == nullptr) return;
  const int64_t blocks = (p.num_seqs + 1 + kCheckThreads - 1) / kCheckThreads;
  kda_check_boundaries_kernel<<<static_cast<unsigned>(blocks), kCheckThreads, 0, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_check_boundaries_kernel");
}

}  // namespace kda
