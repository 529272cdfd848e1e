// Work on a CUDA cu_seqlens and CUDA state_indices that the host cannot do without a synchronisation, in one
// small launch before the main kernels of the chunked plans (so that they keep their registers):
// - the boundary, state index and checkpoint index checks (input_checks.cuh): a thread per check item;
// - the longest-first order (kda_params.h): CTA 0 ranks the sequences by their (clamped) length, longest first,
//   ties by index, so the table is a permutation whatever the boundaries.
#include <algorithm>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/input_checks.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"

namespace kda {
namespace {

constexpr int kCheckThreads = 256;
constexpr int64_t kMaxCheckBlocks = 4096;

static_assert(kLongestFirstMaxSeqs <= kCheckThreads, "one CTA ranks every sequence");

__global__ void __launch_bounds__(kCheckThreads) kda_check_boundaries_kernel(const FwdParams p) {
  const int64_t last = last_check_item(p);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kCheckThreads + threadIdx.x; i <= last;
       i += static_cast<int64_t>(gridDim.x) * kCheckThreads) {
    check_call_inputs(p, i);
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
  // one thread per check item (input_checks.cuh), at most kMaxCheckBlocks CTAs striding over them
  const int64_t items = last_check_item(p) + 1;
  const int64_t blocks = std::min<int64_t>((items + kCheckThreads - 1) / kCheckThreads, kMaxCheckBlocks);
  kda_check_boundaries_kernel<<<static_cast<unsigned>(blocks), kCheckThreads, 0, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_check_boundaries_kernel");
}

}  // namespace kda
