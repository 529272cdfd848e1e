// Hopper warpgroup matrix products (wgmma) with the A operand in registers and B in shared memory, as the
// recurrence step uses them. A warpgroup is 4 consecutive warps; warp w of it owns rows 16w..16w+15 of the
// 64-row A and D, with exactly the register layouts of mma.sync.m16n8k16 (A fragment per 16 k, accumulator
// per 8 columns), so code around the products reads the same either way.
#pragma once

#include <cstdint>

#include "kda/csrc/sm90_async.cuh"

namespace kda {

// Shared-memory matrix descriptor of a K-major bf16 B operand (N rows of K, K contiguous).
enum class SmemSwizzle : uint64_t { k128B = 1, k32B = 3 };
// sbo: bytes between consecutive 8-row groups; lbo: bytes between K pieces of one swizzle atom width (unused
// by the swizzled K-major layouts here, whose K slice fits in one atom). A 128-byte swizzle needs its atoms
// 1024-byte aligned, a 32-byte one 256-byte aligned: the pattern is a function of the address bits.
// The descriptor from its two 32-bit halves, so that a loop can keep the constant half and advance the start
// address with one add: lo = start >> 4 (bits 0..13) | (lbo >> 4) << 16, hi = sbo >> 4 | swizzle << 30.
// Adding (bytes >> 4) to lo moves the start while it stays inside shared memory's 256 KB (14 bits).
__device__ __forceinline__ uint32_t smem_desc_lo(const void* start, uint32_t lbo = 16) {
  return ((smem_addr(start) & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16);
}
constexpr uint32_t smem_desc_hi(SmemSwizzle swizzle, uint32_t sbo) {
  return ((sbo & 0x3FFFF) >> 4) | (static_cast<uint32_t>(swizzle) << 30);
}
__device__ __forceinline__ uint64_t smem_desc(uint32_t lo, uint32_t hi) {
  uint64_t desc;
  asm("mov.b64 %0, {%1, %2};" : "=l"(desc) : "r"(lo), "r"(hi));
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Ties registers to the point where it stands (after a wait: their reads cannot move above it; before an
// issue: their writes cannot move below it). The products write their accumulators asynchronously, which the
// compiler cannot see.
template <int kRows, int kCols>
__device__ __forceinline__ void register_fence(float (&r)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+f"(r[i][j])::"memory");
  }
}

// d[64 x 16] += a[64 x 16] · B, B = 16 (n) rows of 16 (k) at `b`. d[nt][i]: mma.sync accumulator of n-tile nt.
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[2][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d[64 x 128] += a[64 x 16] · B, B = 128 (n) rows of 16 (k) at `b`.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d[64 x 32] += a[64 x 16] · B, B = 32 (n) rows of 16 (k) at `b`: Pᵀ and Oᵀ of one k-slice in one product.
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

}  // namespace kda
