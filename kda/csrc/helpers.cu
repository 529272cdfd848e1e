// Numerics helpers exposed to Python: the exact approximate instructions and tensor-core products the KDA
// kernels use, so the numerics twin (flash_kda/numerics.py) re-enacts the kernels bit for bit.
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/kda_launch.h"

namespace kda {
namespace {

constexpr int kElementwiseThreads = 256;
constexpr int kMmaWarpsPerBlock = 4;

__global__ void elementwise_kernel(Elementwise op, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    switch (op) {
      case Elementwise::kEx2Approx: y[i] = ex2_approx(v); break;
      case Elementwise::kTanhApprox: y[i] = tanh_approx(v); break;
      case Elementwise::kSigmoidApprox: y[i] = sigmoid_approx(v); break;
      case Elementwise::kSoftplusLog2: y[i] = softplus_log2(v); break;
      case Elementwise::kRcpSqrtRn: y[i] = rcp_sqrt_rn(v); break;
    }
  }
}

// One thread per leaf: 32 leaves per row of 128 channels (kHeadDim).
__global__ void lane_leaves_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ leaves,
                                   int64_t groups, int64_t rows) {
  const int64_t n = groups * rows * 32;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / 32, g = row / rows;
    const int l = static_cast<int>(i % 32);
    float x[4], y[4];
    for (int c = 0; c < 4; ++c) x[c] = a[row * kHeadDim + 4 * l + c], y[c] = b[g * kHeadDim + 4 * l + c];
    leaves[i] = lane_leaf4(x, y);
  }
}

__global__ void row_fma_kernel(const float* __restrict__ u, const float* __restrict__ k, const float* __restrict__ s,
                               float* __restrict__ s_out, int64_t groups, int64_t rows) {
  const int64_t n = groups * rows * kHeadDim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / kHeadDim, g = row / rows;
    s_out[i] = __fmaf_rn(u[row], k[g * kHeadDim + i % kHeadDim], s[i]);
  }
}

unsigned elementwise_grid(int64_t n) {
  const int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

__device__ __forceinline__ uint32_t pack_raw_bf16x2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
}

// One warp per 16x8 output tile; fragments gathered straight from row-major global memory.
__global__ void mma_bf16_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                const float* __restrict__ c, float* __restrict__ d, int64_t batches, int m, int n,
                                int k) {
  const int lane = threadIdx.x & 31;
  const int n_tile = blockIdx.x * kMmaWarpsPerBlock + (threadIdx.x >> 5);
  if (n_tile * 8 >= n) return;
  const int row0 = blockIdx.y * 16, col0 = n_tile * 8;
  const int gi = lane >> 2, ti = lane & 3;
  for (int64_t batch = blockIdx.z; batch < batches; batch += gridDim.z) {
    const __nv_bfloat16* a_b = a + batch * m * k;
    const __nv_bfloat16* b_b = b + batch * k * n;

    float acc[4];
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + gi + 8 * (i >> 1), col = col0 + 2 * ti + (i & 1);
      acc[i] = c != nullptr ? c[batch * m * n + static_cast<int64_t>(row) * n + col] : 0.f;
    }
    for (int k0 = 0; k0 < k; k0 += 16) {
      uint32_t af[4], bf[2];
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + gi + 8 * (i & 1), col = k0 + 2 * ti + 8 * (i >> 1);
        af[i] = pack_raw_bf16x2(a_b[static_cast<int64_t>(row) * k + col], a_b[static_cast<int64_t>(row) * k + col + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        const int kk = k0 + 2 * ti + 8 * i, col = col0 + gi;
        bf[i] = pack_raw_bf16x2(b_b[static_cast<int64_t>(kk) * n + col], b_b[static_cast<int64_t>(kk + 1) * n + col]);
      }
      mma_bf16_16816(acc, af, bf);
    }
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + gi + 8 * (i >> 1), col = col0 + 2 * ti + (i & 1);
      d[batch * m * n + static_cast<int64_t>(row) * n + col] = acc[i];
    }
  }
}

}  // namespace

void launch_elementwise(Elementwise op, const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  elementwise_kernel<<<elementwise_grid(n), kElementwiseThreads, 0, stream>>>(op, x, y, n);
  KDA_CHECK_LAUNCH("elementwise_kernel");
}

void launch_lane_leaves(const float* a, const float* b, float* leaves, int64_t groups, int64_t rows,
                        cudaStream_t stream) {
  const int64_t n = groups * rows * 32;
  if (n == 0) return;
  lane_leaves_kernel<<<elementwise_grid(n), kElementwiseThreads, 0, stream>>>(a, b, leaves, groups, rows);
  KDA_CHECK_LAUNCH("lane_leaves_kernel");
}

void launch_row_fma(const float* u, const float* k, const float* s, float* s_out, int64_t groups, int64_t rows,
                    cudaStream_t stream) {
  const int64_t n = groups * rows * kHeadDim;
  if (n == 0) return;
  row_fma_kernel<<<elementwise_grid(n), kElementwiseThreads, 0, stream>>>(u, k, s, s_out, groups, rows);
  KDA_CHECK_LAUNCH("row_fma_kernel");
}

void launch_mma_bf16(const void* a, const void* b, const float* c, float* d, int64_t batch, int m, int n, int k,
                     cudaStream_t stream) {
  if (m % 16 != 0 || n % 8 != 0 || k % 16 != 0) {
    throw std::invalid_argument("flash_kda: mma_bf16 needs m % 16 == 0, n % 8 == 0, k % 16 == 0; got m=" +
                                std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
  }
  if (batch == 0 || m == 0 || n == 0) return;
  const dim3 grid((n / 8 + kMmaWarpsPerBlock - 1) / kMmaWarpsPerBlock, m / 16,
                  static_cast<unsigned>(batch < 65535 ? batch : 65535));
  mma_bf16_kernel<<<grid, kMmaWarpsPerBlock * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(a),
                                                                static_cast<const __nv_bfloat16*>(b), c, d, batch, m, n, k);
  KDA_CHECK_LAUNCH("mma_bf16_kernel");
}

}  // namespace kda
