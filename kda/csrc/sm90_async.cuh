// Hopper data-movement primitives the kernels use: mbarriers, 1-D bulk copies (the copy engine moves a whole
// contiguous workspace record or state row with one instruction) and the warp-wide matrix loads/transposes
// (ldmatrix, movmatrix), and the warpgroup register reallocation (setmaxnreg). None of these touch values, so they
// cannot change a bit of the results.
#pragma once

#include <cstdint>

namespace kda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes initialised barriers visible to the copy engine (then a CTA barrier makes them visible to all threads).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of bulk-copy traffic the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One plain arrival (a consumer releasing a ring stage).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One poll: whether the phase of `bar` with the given parity has completed (try_wait may also block briefly).
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits, as one thread, for the phase of `bar` with the given parity to complete.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}

// Waits, as a whole warp, for the phase of `bar` with the given parity to complete. The exit is warp-uniform
// (a vote), so the warp-collective .aligned instructions that follow (ldmatrix, mma) run converged: a plain
// per-lane poll can release lanes on different iterations, and the compiler may drop a __syncwarp after it.
__device__ __forceinline__ void mbarrier_wait_parity_warp(uint64_t* bar, uint32_t parity) {
  while (!__all_sync(0xffffffffu, mbarrier_try_wait_parity(bar, parity))) {
  }
}

// Orders this thread's earlier shared-memory stores (generic proxy) before later reads by the async proxy (wgmma
// operands); a CTA barrier after it extends that to the other threads' reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- the overlap's ready flags (kda_params.h): one record's stores published to another SM's bulk copy -----
// Orders this thread's earlier global stores (generic proxy) with later async-proxy accesses (the bulk copies
// that read the record), on the writer's side before the release and on the reader's side after the acquire.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- programmatic dependent launch (griddepcontrol): no-ops unless the launch carries the attribute ---------
// Lets the next kernel of the stream launch (once every CTA of this grid has executed it or exited).
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Waits until the grids this one depends on have completed and their memory operations are visible.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// ---- 1-D bulk copy global -> shared, completing on an mbarrier (16-byte aligned, size % 16 == 0) ---------
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// ---- tensor copy global -> shared through a tensor map (TMA), completing on an mbarrier -----------------------
// `map`: the address of a __grid_constant__ CUtensorMap kernel parameter; c0 the innermost coordinate. One thread
// issues it; the box lands in shared memory laid out (and swizzled) as the map says.
__device__ __forceinline__ void tensor_copy_3d_g2s(void* smem_dst, const void* map, int c0, int c1, int c2,
                                                   uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(smem_dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

// ---- 1-D bulk copy shared -> global in bulk groups (16-byte aligned, size % 16 == 0) ------------------------
// The writing threads' stores must be ordered before it with fence_proxy_async_shared; the source may be reused
// (or the CTA exit) once bulk_wait_read_all returns, and the global writes are visible when the grid completes.
__device__ __forceinline__ void bulk_copy_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_addr(smem_src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until this thread's committed bulk stores have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// ---- tensor copy shared -> global through a tensor map (TMA), in bulk groups ----------------------------------
// As bulk_copy_s2g (fence before, bulk_commit and bulk_wait_read_all after); the box is read from shared memory laid
// out (and swizzled) as the map says.
__device__ __forceinline__ void tensor_copy_3d_s2g(const void* map, int c0, int c1, int c2, const void* smem_src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(map), "r"(c0),
               "r"(c1), "r"(c2), "r"(smem_addr(smem_src))
               : "memory");
}

// ---- bulk prefetch of a global range into L2 (16-byte aligned, size % 16 == 0): no registers, no completion ----
__device__ __forceinline__ void bulk_prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}

// ---- per-thread 16-byte async copy global -> shared (zero-fills the bytes past src_bytes), in commit groups --
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
// The same for 8 bytes (through L1, which .cg does not allow for pieces under 16 bytes).
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* gmem_src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- warp-wide fragment loads and transposes ------------------------------------------------------------
// Four 8x8 bf16 matrices; lane i gives the address of row i % 8 of matrix i / 8 (16 bytes each). Thread
// (g = lane / 4, t = lane % 4) receives elements (g, 2t) and (g, 2t + 1) of matrix j in r[j].
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// The same with each matrix transposed: thread (g, t) receives elements (2t, g) and (2t + 1, g).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// Transposes one 8x8 bf16 matrix held as one register per lane (element (g, 2t..2t+1) in, (g, 2t..2t+1) of
// the transpose out).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// ---- Register reallocation -------------------------------------------------------------------------------
// A warpgroup (4 consecutive warps, all executing it) raises or lowers its per-thread register limit. Raising
// waits until the registers others released are free: the limits of a CTA's warps must fit what the CTA was
// launched with, per SM sub-partition (warp i runs on partition i % 4), or the raise waits forever.
constexpr int kSubPartitionRegs = 16384;  // the registers of one SM sub-partition
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace kda
