// A count, not part of the build: the state warps' work per head if the warp-specialised decode kernel ran the decode
// chunk step's arithmetic (decode_chunk.cu's step 4, a chunk of at most 8 tokens: W = S·Xᵀ, U = (V − W_k)·Tᵀ,
// O = W_q + U·Bᵀ, S ← S ⊙ D + U·Eᵀ, three m16n8k16 MMAs per split product) in that kernel's frame: a warp's 16 state
// rows from a bf16 stage into accumulator fragments, the step, the rows back into the stage. Compile and list the
// head loop:
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I. -Xptxas -v \
//        -c -o /tmp/ws_chunk_step_count.o tools/dev/ws_chunk_step_count.cu
//   python3 tools/dev/sass_loops.py /tmp/ws_chunk_step_count.o --kernel chunk_state_count
//
// 2026-12-07 (CUDA 13.0's nvcc and ptxas from the build's hermetic toolkit): 141 registers, no spills; the head loop
// 899 instructions (IMAD 155, LDS 152, F2FP 110, PRMT 106, HMMA 102, FADD 78, FMUL 64, STS 32), where
// kda_decode_ws_kernel v36.3 issues 2,040 per state warp and 4-token head, its preparing warps' share included (67.0 M
// over 32,768 on varlen 128 x 4 H32; docs/bench-h100-2026-12-07-ws-profile.md). The operands' values are whatever the
// shared memory holds: it counts instructions and computes nothing meaningful.
#include <cuda_bf16.h>
#include <cstdint>
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/sm90_async.cuh"
namespace kda {
constexpr int kChunk8 = 8, kXPitch = 136, kSmallPitch = 24, kVPitch = 132;
struct Slot {
  __nv_bfloat16 x_hi[2 * kChunk8][kXPitch], x_lo[2 * kChunk8][kXPitch];
  __nv_bfloat16 e_hi[128][kSmallPitch], e_lo[128][kSmallPitch];
  __nv_bfloat16 t_hi[kChunk8][kSmallPitch], t_lo[kChunk8][kSmallPitch], b_hi[kChunk8][kSmallPitch], b_lo[kChunk8][kSmallPitch];
  float v[kChunk8][kVPitch];
  float decay_end[128];
  uint64_t full, empty;
};
__device__ __forceinline__ uint32_t smem_u32(const __nv_bfloat16* at) { return *reinterpret_cast<const uint32_t*>(at); }
__device__ __forceinline__ void split_a_frags(uint32_t (&hi)[4], uint32_t (&lo)[4], const float (&lo_tile)[4], const float (&hi_tile)[4]) {
  acc_to_a_frag(hi, lo_tile, hi_tile);
  lo[0] = pack_lo_bf16x2(lo_tile[0], lo_tile[1], hi[0]); lo[1] = pack_lo_bf16x2(lo_tile[2], lo_tile[3], hi[1]);
  lo[2] = pack_lo_bf16x2(hi_tile[0], hi_tile[1], hi[2]); lo[3] = pack_lo_bf16x2(hi_tile[2], hi_tile[3], hi[3]);
}
// k rows 8..15 of B are zero for <= 8 tokens when `half`.
template <bool kHalf>
__device__ __forceinline__ void split_mma(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          const __nv_bfloat16* b_hi_row, const __nv_bfloat16* b_lo_row) {
  const uint32_t b_hi[2] = {smem_u32(b_hi_row), kHalf ? 0u : smem_u32(b_hi_row + 8)};
  const uint32_t b_lo[2] = {smem_u32(b_lo_row), kHalf ? 0u : smem_u32(b_lo_row + 8)};
  mma_bf16_16816(d, a_lo, b_hi); mma_bf16_16816(d, a_hi, b_lo); mma_bf16_16816(d, a_hi, b_hi);
}
__global__ void __launch_bounds__(256, 1) chunk_state_count(int heads, const int* lens, __nv_bfloat16* out, int64_t out_stride) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* stage = reinterpret_cast<__nv_bfloat16*>(smem);
  Slot& sm = *reinterpret_cast<Slot*>(smem + 2 * 32768);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q4 = lane & 3, row0 = 16 * warp;
  uint32_t parity = 0;
  for (int head = blockIdx.x; head < heads; head += gridDim.x) {
    const int len = lens[head];
    const __nv_bfloat16* src = stage + (head & 1) * 16384 + (row0 + g) * 128 + 2 * q4;
    float s[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) { load_pair(src + 8 * i, s[i][0], s[i][1]); load_pair(src + 8 * 128 + 8 * i, s[i][2], s[i][3]); }
    mbarrier_wait_parity_warp(&sm.full, parity);
    float v_in[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v_in[e] = sm.v[2 * q4 + (e & 1)][row0 + g + 8 * (e >> 1)];
    float w[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a_hi[4], a_lo[4];
      split_a_frags(a_hi, a_lo, s[2 * ks], s[2 * ks + 1]);
      const int col = 16 * ks + 2 * q4;
      split_mma<false>(w[0], a_hi, a_lo, &sm.x_hi[g][col], &sm.x_lo[g][col]);
      split_mma<false>(w[1], a_hi, a_lo, &sm.x_hi[8 + g][col], &sm.x_lo[8 + g][col]);
    }
    float r[2][4] = {}, u[2][4] = {};
#pragma unroll
    for (int e = 0; e < 4; ++e) r[0][e] = 2 * q4 + (e & 1) < len ? __fsub_rn(v_in[e], w[0][e]) : 0.f;
    uint32_t a_hi[4], a_lo[4];
    split_a_frags(a_hi, a_lo, r[0], r[1]);
    split_mma<true>(u[0], a_hi, a_lo, &sm.t_hi[g][2 * q4], &sm.t_lo[g][2 * q4]);
    split_a_frags(a_hi, a_lo, u[0], u[1]);
    split_mma<true>(w[1], a_hi, a_lo, &sm.b_hi[g][2 * q4], &sm.b_lo[g][2 * q4]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = 2 * q4 + (e & 1);
      if (t < len) out[t * out_stride + head * 128 + row0 + g + 8 * (e >> 1)] = __float2bfloat16_rn(w[1][e]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int col = 8 * i + 2 * q4;
      const float d0 = sm.decay_end[col], d1 = sm.decay_end[col + 1];
      s[i][0] = __fmul_rn(s[i][0], d0), s[i][1] = __fmul_rn(s[i][1], d1);
      s[i][2] = __fmul_rn(s[i][2], d0), s[i][3] = __fmul_rn(s[i][3], d1);
      split_mma<true>(s[i], a_hi, a_lo, &sm.e_hi[8 * i + g][2 * q4], &sm.e_lo[8 * i + g][2 * q4]);
    }
    mbarrier_arrive(&sm.empty);
    parity ^= 1u;
    __nv_bfloat16* dst = stage + (head & 1) * 16384 + (row0 + g) * 128 + 2 * q4;
#pragma unroll
    for (int i = 0; i < 16; ++i) { store_pair(dst + 8 * i, s[i][0], s[i][1]); store_pair(dst + 8 * 128 + 8 * i, s[i][2], s[i][3]); }
  }
}
}  // namespace kda
