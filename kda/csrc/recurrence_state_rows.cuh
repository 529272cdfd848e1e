// The state rows of a recurrence warp: its 16 rows of S as fp32 mma accumulators, loaded from and stored to
// row-major [128][128] states (the caller's initial and final states in bf16 or fp32, the time split's fp32 states).
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"

namespace kda {

// This warp's 16 state rows as fp32 mma accumulators: s[nt][i] = S[v_base + gi + 8*(i/2)][8*nt + 2*ti + i%2].
using StateRows = float[kHeadDim / 8][4];

// Loads S rows v_base.. from a row-major [128][128] state of type T (the caller's initial state, or fp32
// workspace states of the time split). Lane ti holds columns 8nt + 2ti, +1 of its rows; in bf16 that is 4 bytes
// per n-tile, so lane pairs trade and each access moves 8 bytes: the even lane columns 16m + 2ti .. +3, the odd
// one 16m + 2ti + 6 .. +9, and 4 lanes fill a row's 32-byte sector (fp32 pairs already do).
template <typename T>
__device__ __forceinline__ void load_rows(StateRows& s, const T* state, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const T* row = state + (v_base + gi + 8 * half) * kHeadDim;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const bool odd = (ti & 1) != 0;
#pragma unroll
      for (int m = 0; m < kHeadDim / 16; ++m) {
        const uint2 raw = *reinterpret_cast<const uint2*>(row + 16 * m + 2 * ti + (odd ? 6 : 0));
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? raw.x : raw.y, 1);
        const uint32_t lo = odd ? got : raw.x, hi = odd ? raw.y : got;  // n-tiles 2m and 2m + 1
        const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&lo);
        const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&hi);
        s[2 * m][2 * half] = __low2float(a), s[2 * m][2 * half + 1] = __high2float(a);
        s[2 * m + 1][2 * half] = __low2float(b), s[2 * m + 1][2 * half + 1] = __high2float(b);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) {
        load_pair<T>(row + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
      }
    }
  }
}
template <typename T>
__device__ __forceinline__ void store_rows(T* state, const StateRows& s, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    T* row = state + (v_base + gi + 8 * half) * kHeadDim;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const bool odd = (ti & 1) != 0;
#pragma unroll
      for (int m = 0; m < kHeadDim / 16; ++m) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(s[2 * m][2 * half], s[2 * m][2 * half + 1]);
        const __nv_bfloat162 b = __floats2bfloat162_rn(s[2 * m + 1][2 * half], s[2 * m + 1][2 * half + 1]);
        const uint32_t lo = *reinterpret_cast<const uint32_t*>(&a), hi = *reinterpret_cast<const uint32_t*>(&b);
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
        *reinterpret_cast<uint2*>(row + 16 * m + 2 * ti + (odd ? 6 : 0)) = odd ? make_uint2(got, hi) : make_uint2(lo, got);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) store_pair(row + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
    }
  }
}
__device__ __forceinline__ void fill_rows(StateRows& s, float value) {
#pragma unroll
  for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = value;
  }
}

}  // namespace kda
