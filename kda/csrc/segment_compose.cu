// KDA forward, time split: the composition of segment maps into every segment's true start state.
//
// For a sequence cut into G segments, the scan pass left each scanned segment j (all but the last) its affine
// map S_end = S_start · M_j + Q_j in its window's storage (kda_params.h). One CTA per (sequence, head, 16 state
// rows) walks the chain S_{j+1} = Q_j + S_j · M_j, j = 0 .. G-2, and overwrites Q_j with S_{j+1}, where the
// finishing pass of segment j + 1 reads it. The product keeps fp32 accuracy on the bf16 tensor cores by
// splitting both factors, S = S_hi + S_lo and M = M_hi + M_lo (hi = bf16(x), lo = bf16(x - hi)):
//   S_{j+1} = Q_j + S_hi·M_hi + S_hi·M_lo + S_lo·M_hi    (one accumulator, in this order, k-steps in order)
// which is what the numerics twin re-enacts with the extension's mma helper. Rows are independent, so the 8
// row groups of a head run in parallel; inside a CTA, warp c owns output columns 16c..16c+15 and the warps
// trade their A fragments through shared memory once per link; each link's operands are loaded one link ahead.
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/state_slots.cuh"
#include "kda/csrc/window_table.cuh"

namespace kda {
namespace {

constexpr int kComposeWarps = 8;                             // warp c: output columns 16c .. 16c + 15
constexpr int kTilesPerWarp = kHeadDim / 8 / kComposeWarps;  // n-tiles of 8 columns per warp (2)
constexpr int kKSteps = kHeadDim / 16;
static_assert(kComposeWarps == kKSteps, "warp c's columns are k-step c of the next product");
constexpr int kPrefetchLinks = 4;  // links whose operands are on their way into L2

// acc[q][i]: S[r0 + g + 8*(i/2)][16c + 8q + 2t + i%2] of this warp's 16 rows and 16 columns.
using Block = float[kTilesPerWarp][4];

template <typename T>
__device__ __forceinline__ void load_block(Block& acc, const T* state, int r0, int c, int g, int t) {
#pragma unroll
  for (int q = 0; q < kTilesPerWarp; ++q) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r0 + g + 8 * half, col = 16 * c + 8 * q + 2 * t;
      load_pair<T>(state + row * kHeadDim + col, acc[q][2 * half], acc[q][2 * half + 1]);
    }
  }
}
__device__ __forceinline__ void store_block(float* state, const Block& acc, int r0, int c, int g, int t) {
#pragma unroll
  for (int q = 0; q < kTilesPerWarp; ++q) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r0 + g + 8 * half, col = 16 * c + 8 * q + 2 * t;
      *reinterpret_cast<float2*>(state + row * kHeadDim + col) = make_float2(acc[q][2 * half], acc[q][2 * half + 1]);
    }
  }
}

// One link's operands for this warp: its B fragments of M (hi and lo, k-steps 0..7 of its 2 n-tiles) and its
// block of Q. Loaded one link ahead, so their trip from L2 overlaps the previous link's products.
struct LinkOperands {
  uint2 m_hi[kTilesPerWarp][kKSteps];
  uint2 m_lo[kTilesPerWarp][kKSteps];
  Block q;
};

__device__ __forceinline__ void load_link(LinkOperands& x, const uint8_t* data, int r0, int c, int g, int t,
                                          int lane) {
  const auto* m_hi = reinterpret_cast<const uint2*>(data + WindowLayout::kMHiOffset);
  const auto* m_lo = reinterpret_cast<const uint2*>(data + WindowLayout::kMLoOffset);
#pragma unroll
  for (int q = 0; q < kTilesPerWarp; ++q) {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const int index = ((kTilesPerWarp * c + q) * kKSteps + ks) * 32 + lane;  // kda_params.h fragment order
      x.m_hi[q][ks] = m_hi[index];
      x.m_lo[q][ks] = m_lo[index];
    }
  }
  load_block<float>(x.q, reinterpret_cast<const float*>(data + WindowLayout::kNextOffset), r0, c, g, t);
}

template <typename StateT>
__global__ void __launch_bounds__(kComposeWarps * 32) kda_segment_compose_kernel(const FwdParams p) {
  int64_t n = blockIdx.x;  // fixed length: one column per sequence (kda_params.h, pass_columns)
  if (p.cu_seqlens != nullptr) {
    const WindowItem item = scanned_segment_in_window(p, blockIdx.x);
    if (item.n < 0 || item.j != 0) return;  // a chain starts in the window of its sequence's first segment
    n = item.n;
  }
  const int h = blockIdx.y;
  const int r0 = 16 * blockIdx.z;
  const int lane = threadIdx.x & 31, c = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int L = p.segment_chunks;
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t links = segment_count(bounds.eos - bounds.bos, L) - 1;
  // Consecutive segments of a sequence start in consecutive windows (a scanned segment spans a whole window).
  uint8_t* const first_window = window_data(p, window_of(bounds.bos, n, 0, L), h);
  const size_t window_stride = static_cast<size_t>(p.heads) * WindowLayout::kBytes;
  auto data_of = [&](int64_t j) { return first_window + static_cast<size_t>(j) * window_stride; };

  // The window data was written by the scan pass, whose record stream has long since evicted most of it from
  // L2: pull the links ahead into L2 with bulk prefetches (kPrefetchLinks ahead), then into registers one ahead.
  auto prefetch = [&](int64_t j) {
    if (threadIdx.x == 0 && j < links) {
      const uint8_t* data = data_of(j);
      bulk_prefetch_l2(data + WindowLayout::kMHiOffset, 2 * WindowLayout::kMBytes);  // M hi and lo
      bulk_prefetch_l2(data + WindowLayout::kNextOffset + r0 * kHeadDim * 4, 16 * kHeadDim * 4);  // our Q rows
    }
  };
  for (int64_t j = 0; j < kPrefetchLinks; ++j) prefetch(j);
  LinkOperands even, odd;  // operands of the even / odd links (two register sets, no copies between them)
  load_link(even, data_of(0), r0, c, g, t, lane);
  Block acc;
  const int64_t slot = p.initial_state != nullptr ? state_slot(p, n) : -1;  // -1: the chain starts from zeros
  if (slot >= 0) {
    load_block<StateT>(acc, static_cast<const StateT*>(p.initial_state) + state_offset(p, slot, h), r0, c, g, t);
  } else {
#pragma unroll
    for (int q = 0; q < kTilesPerWarp; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[q][i] = 0.f;
    }
  }
  store_block(reinterpret_cast<float*>(data_of(0) + WindowLayout::kFirstOffset), acc, r0, c, g, t);

  // A fragments of S (hi and lo) for every k-step, traded between the warps: [buffer][k-step][hi, lo][lane].
  __shared__ uint4 trade[2][kKSteps][2][32];
  // Link j: S_{j+1} = Q_j + S_hi·M_hi + S_hi·M_lo + S_lo·M_hi from `cur`, while link j + 1's operands load
  // into `nxt`.
  auto link = [&](int64_t j, const LinkOperands& cur, LinkOperands& nxt, uint4 (&buf)[kKSteps][2][32]) {
    // This warp's 16 columns are k-step c of the product, in acc_to_a_frag's layout (n-tile 0, then 1).
    auto lo = [](float x0, float x1) { return pack_lo_bf16x2(x0, x1, pack_bf16x2(x0, x1)); };
    buf[c][0][lane] = make_uint4(pack_bf16x2(acc[0][0], acc[0][1]), pack_bf16x2(acc[0][2], acc[0][3]),
                                 pack_bf16x2(acc[1][0], acc[1][1]), pack_bf16x2(acc[1][2], acc[1][3]));
    buf[c][1][lane] = make_uint4(lo(acc[0][0], acc[0][1]), lo(acc[0][2], acc[0][3]), lo(acc[1][0], acc[1][1]),
                                 lo(acc[1][2], acc[1][3]));
    if (j + 1 < links) load_link(nxt, data_of(j + 1), r0, c, g, t, lane);
    prefetch(j + kPrefetchLinks);
#pragma unroll
    for (int q = 0; q < kTilesPerWarp; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[q][i] = cur.q[q][i];  // Q_j starts the accumulators
    }
    __syncthreads();

#pragma unroll
    for (int product = 0; product < 3; ++product) {  // S_hi·M_hi, then S_hi·M_lo, then S_lo·M_hi
      const int part = product == 2 ? 1 : 0;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const uint4 a4 = buf[ks][part][lane];
        const uint32_t a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int q = 0; q < kTilesPerWarp; ++q) {
          const uint2 bx = product == 1 ? cur.m_lo[q][ks] : cur.m_hi[q][ks];
          const uint32_t b[2] = {bx.x, bx.y};
          mma_bf16_16816(acc[q], a, b);
        }
      }
    }
    store_block(reinterpret_cast<float*>(data_of(j) + WindowLayout::kNextOffset), acc, r0, c, g, t);  // S_{j+1}
  };
  for (int64_t j = 0; j < links; j += 2) {
    link(j, even, odd, trade[0]);
    if (j + 1 < links) link(j + 1, odd, even, trade[1]);
  }
}

}  // namespace

void launch_segment_compose(const FwdParams& p, cudaStream_t stream) {
  const int64_t columns = pass_columns(p).compose;
  if (columns == 0 || p.heads == 0) return;
  const dim3 grid(static_cast<unsigned>(columns), static_cast<unsigned>(p.heads), kHeadDim / 16);
  if (p.initial_is_fp32) {
    kda_segment_compose_kernel<float><<<grid, kComposeWarps * 32, 0, stream>>>(p);
  } else {
    kda_segment_compose_kernel<__nv_bfloat16><<<grid, kComposeWarps * 32, 0, stream>>>(p);
  }
  KDA_CHECK_LAUNCH("kda_segment_compose_kernel");
}

}  // namespace kda
