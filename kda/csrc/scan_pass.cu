// The time split's scan pass (kda_segment_scan_kernel) and its launcher: the recurrence's step without outputs,
// over each scanned segment, from zero (the end state Q) and from the identity (the transition map M).
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_launch.cuh"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/recurrence_step.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/window_table.cuh"

namespace kda {
namespace {

// The scan pass of the time split: one CTA per (scanned segment, head, map part). The segment runs twice over
// the same records: from zero with the values (its end state Q) and from the identity without them (the
// transition map M, as rows: row i is e_i carried through the segment). Both go to the window's storage: Q in
// fp32 rows, M split into bf16 hi + lo in the composition kernel's fragment order.
//
// 8-warp scan CTAs get the register budget of two per SM (128 registers, 32 bytes of spills): each step is slower,
// but the plan picks 8-warp scans only when they outnumber the SMs 1.5 to 1 (kda_plan.h, plan_with_segments), and
// two per SM run them in one wave instead of two (H200, scan ms, one / two per SM: T32768 H8 0.176 / 0.155,
// T1048576 H1 0.677 / 0.639). The finishing pass keeps one per SM: two were slower on every shape, multi-wave
// batches included (B32 T512 H32 0.264 / 0.297; docs/DESIGN.md, "The time split").
template <int kWarps>
constexpr int kScanCtasPerSm = kWarps == 8 ? 2 : 1;
template <int kWarps, bool kWgmma, bool kHiLo>
__global__ void __launch_bounds__(kWarps * 32, kScanCtasPerSm<kWarps>) kda_segment_scan_kernel(const FwdParams p) {
  using Smem = RecurrenceSmem<kWarps>;
  const int L = p.segment_chunks;
  int64_t n, j, window;  // the scanned segment of this CTA column (kda_params.h, pass_columns)
  if (p.cu_seqlens == nullptr) {
    const int64_t per_seq = segment_count(p.seqlen, L) - 1;
    n = blockIdx.x / per_seq;
    j = blockIdx.x % per_seq;
    window = window_of(n * p.seqlen, n, j, L);
  } else {
    const WindowItem item = scanned_segment_in_window(p, blockIdx.x);
    if (item.n < 0) return;  // no scanned segment starts in this window (CTA-uniform)
    n = item.n;
    j = item.j;
    window = blockIdx.x;
  }
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  constexpr int kParts = kHeadDim / Smem::kRows;  // CTAs per map
  const bool transition = static_cast<int>(blockIdx.z) < kParts;
  const int v_base = (blockIdx.z % kParts) * Smem::kRows + warp * 16;

  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  uint64_t* full = init_ring<kWarps>(smem);

  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  uint8_t* data = window_data(p, window, h);
  StateRows s;
  if (transition) {
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = (v_base + gi + 8 * (i >> 1) == 8 * nt + 2 * ti + (i & 1)) ? 1.f : 0.f;
    }
    run_chunks<kWarps, false, false, kWgmma, kHiLo>(p, smem, full, n, h, bounds, j * L, L, v_base, s);
    // Rows v_base.. of M are k-step v_base / 16 of the composition's B operand (k = input state column i,
    // n = output column): b0 of lane (g, t) is (M[16ks + 2t][8nt + g], M[16ks + 2t + 1][8nt + g]), the
    // transpose of this lane's accumulator block, hence movmatrix.
    const int ks = v_base / 16;
    auto* hi = reinterpret_cast<uint2*>(data + WindowLayout::kMHiOffset);
    auto* lo = reinterpret_cast<uint2*>(data + WindowLayout::kMLoOffset);
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      uint32_t bh[2], bl[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float x0 = s[nt][2 * half], x1 = s[nt][2 * half + 1];
        const uint32_t packed = pack_bf16x2(x0, x1);
        bh[half] = movmatrix_trans(packed);
        bl[half] = movmatrix_trans(pack_lo_bf16x2(x0, x1, packed));
      }
      const int index = (nt * (kHeadDim / 16) + ks) * 32 + lane;
      hi[index] = make_uint2(bh[0], bh[1]);
      lo[index] = make_uint2(bl[0], bl[1]);
    }
  } else {
    fill_rows(s, 0.f);
    run_chunks<kWarps, false, true, kWgmma, kHiLo>(p, smem, full, n, h, bounds, j * L, L, v_base, s);
    store_rows(reinterpret_cast<float*>(data + WindowLayout::kNextOffset), s, v_base, gi, ti);
  }
}

}  // namespace

void launch_segment_scan(const FwdParams& p, cudaStream_t stream) {
  const int64_t columns = pass_columns(p).scan;
  if (columns == 0 || p.heads == 0) return;
  // z: the M parts, then the Q parts (scan_v_split CTAs each).
  const dim3 grid(static_cast<unsigned>(columns), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(2 * p.scan_v_split));
  with_warps(p.scan_v_split, p.lower_bound, [&](auto warps, auto hi_lo) {
    constexpr int kWarps = decltype(warps)::value;
    constexpr bool kHiLo = decltype(hi_lo)::value;
    launch_ring_kernel<kWarps, kda_segment_scan_kernel<kWarps, kUseWgmma<kWarps>, kHiLo>>(grid, p, stream);
  });
  KDA_CHECK_LAUNCH("kda_segment_scan_kernel");
}

}  // namespace kda
