// Work on a CUDA cu_seqlens and CUDA state_indices that the host cannot do without a synchronisation, in one
// small launch before the main kernels (so that they keep their registers):
// - boundary checks: one thread per boundary lowers the device's error word (FwdParams::status) to the first
//   malformed index. cu[0] must be 0, cu[N] the number of tokens, and cu must not decrease or leave
//   [0, total_tokens]. The kernels themselves clamp malformed boundaries (memory stays safe); this records that
//   the call's results are unspecified, for flash_kda.last_error;
// - state index checks: one thread per sequence n lowers the word to kStatusStateIndexBase + n where
//   state_indices[n] >= pool_slots (negative indices are padding rows, allowed). The kernels never touch such a
//   slot (state_slot maps it to "no state"); this records it for flash_kda.last_error;
// - the longest-first order (kda_params.h): CTA 0 ranks the sequences by their (clamped) length, longest first,
//   ties by index, so the table is a permutation whatever the boundaries.
#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/state_slots.cuh"

namespace kda {
namespace {

constexpr int kCheckThreads = 256;

static_assert(kLongestFirstMaxSeqs <= kCheckThreads, "one CTA ranks every sequence");

__global__ void __launch_bounds__(kCheckThreads) kda_check_boundaries_kernel(const FwdParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCheckThreads + threadIdx.x;
  if (p.status != nullptr && p.cu_seqlens != nullptr && i <= p.num_seqs) {
    const int64_t v = load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i);
    const bool bad = v < 0 || v > p.total_tokens || (i == 0 && v != 0) ||
                     (i == p.num_seqs && v != p.total_tokens) ||
                     (i > 0 && load_cu(p.cu_seqlens, p.cu_seqlens_is_int64, i - 1) > v);
    if (bad) atomicMin(p.status, static_cast<unsigned long long>(i));
  }
  if (p.status != nullptr && p.state_indices != nullptr && i < p.num_seqs) {
    const int64_t index = p.state_indices_is_int64 ? static_cast<const int64_t*>(p.state_indices)[i]
                                                   : static_cast<const int32_t*>(p.state_indices)[i];
    if (index >= p.pool_slots) atomicMin(p.status, kStatusStateIndexBase + static_cast<unsigned long long>(i));
  }
  if (p.longest_first && blockIdx.x == 0) {  // CTA-uniform
    __shared__ int64_t lengths[kCheckThreads];
    const int n = threadIdx.x, N = static_cast<int>(p.num_seqs);
    int64_t length = -1;
    if (n < N) {
      const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
      length = b.eos - b.bos;
    }
    lengths[n] = length;
    __syncthreads();
    if (n < N) {
      int rank = 0;
      for (int m = 0; m < N; ++m) rank += lengths[m] > length || (lengths[m] == length && m < n);
      longest_first_order(p)[rank] = n;
    }
  }
}

}  // namespace

void launch_boundary_check(const FwdParams& p, cudaStream_t stream) {
  const bool checks = p.status != nullptr && (p.cu_seqlens != nullptr || p.state_indices != nullptr);
  if (!checks && !p.longest_first) return;  // (longest first implies cu_seqlens)
  const int64_t blocks = (p.num_seqs + 1 + kCheckThreads - 1) / kCheckThreads;
  kda_check_boundaries_kernel<<<static_cast<unsigned>(blocks), kCheckThreads, 0, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_check_boundaries_kernel");
}

}  // namespace kda
