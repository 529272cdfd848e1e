// The preparation of one 16-token chunk of one head by one warp (docs/SPEC.md §2): everything of the chunk that
// does not depend on the state S. Shared by the preparation and tail kernels (prepare.cu, prepare_tail.cu), which
// write it to the workspace, and the single-pass kernel and the stream pass (single_pass.cuh, stream_pass.cuh),
// which write it into their own shared-memory rings.
//
// Lane l owns channels 4l..4l+3 of every row of the chunk. The warp computes L2-normalised q/k, the
// per-channel log2 gates and their in-chunk cumulative sum G, Kd = k̂·2^G, Qd = scale·q̂·2^G, Kr = k̂·2^{Γ-G},
// 2^Γ, β, the products A = Kd·Kiᵀ and Mqk = Qd·Kiᵀ on the tensor cores, and INV = (I + β·strict_lower(A))⁻¹ by
// forward substitution in fp32, and writes one record in the recurrence's shared-memory image (kda_params.h).
// Rows past the end of a sequence are zero (q = k = v = 0, γ = 0, β = 0), which makes them inert.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/sm90_async.cuh"

namespace kda {
namespace prep {

constexpr int kChannelsPerLane = kHeadDim / 32;
static_assert(kChannelsPerLane == 4, "a lane owns one 8-byte piece of a 128-channel row");

// Per-warp scratch of the preparation kernels and the stream pass (its looped form: kLoopedScratchBytes below):
// the bf16 operands of the two products, swizzled like the record.
// Each tile first receives a raw input by async copy (kd: g, qd: q, ki: k); once the products are done, kd holds
// β·A in fp32 (row i of A times β_i: the substitution's factors).
struct PrepScratch {
  __nv_bfloat16 kd[kChunk * kHeadDim];
  __nv_bfloat16 qd[kChunk * kHeadDim];
  __nv_bfloat16 ki[kChunk * kHeadDim];
};
// Row stride of β·A in the kd tile: 24 floats keeps each half-warp's 8-byte fragment stores free of bank conflicts.
constexpr int kAStride = 24;
constexpr int kPrepTileBytes = kChunk * kHeadDim * 2;  // one bf16 [16][128] tile
static_assert(kChunk * kAStride * 4 + kChunk * kChunk * 4 <= kPrepTileBytes,
              "β·A (and the softplus gate's Mqk staging behind it) must fit in one dead tile");
// The looped form's scratch (prepare_chunk<true, kLowerBound, true>): the tile, then G as fp32 [16][128].
constexpr int kLoopedScratchBytes = kPrepTileBytes + kChunk * kHeadDim * 4;
static_assert(kLoopedScratchBytes <= static_cast<int>(sizeof(PrepScratch)), "a PrepScratch holds it");
// The looped form's rows per turn of phase 2b: Krᵀ leaves in 8-byte pieces (two token pairs per channel); 8 rows
// and 16-byte pieces ran no faster (docs/PERFORMANCE.md at tag measurements-2026-12-07, "Which side sets the time").
constexpr int kLoopRows = 4;

// The lane's leaf of a sum over 128 channels (lane l holding channels 4l..4l+3) of x·y, in the order the twin
// re-enacts (tree_sum_128): (x0·y0 + x1·y1) + (x2·y2 + x3·y3); a squared norm's with y = x.
__device__ __forceinline__ float dot_leaf_4(const float (&x)[4], const float (&y)[4]) {
  return __fadd_rn(__fadd_rn(__fmul_rn(x[0], y[0]), __fmul_rn(x[1], y[1])),
                   __fadd_rn(__fmul_rn(x[2], y[2]), __fmul_rn(x[3], y[3])));
}
__device__ __forceinline__ float sum_squares_4(const float (&x)[4]) { return dot_leaf_4(x, x); }

// 32 sums over the warp at once, lane l holding a leaf of each: the halving tree over lanes (xor 16, 8, 4, 2, 1)
// that the twin re-enacts, as a reduce-scatter. At each level a lane keeps the half of its partial sums whose
// index bit matches its own lane bit and adds its partner's partial of the same sums, so every sum is built
// from exactly the pairs of a butterfly reduction, with 31 shuffles instead of 160. Lane l ends with sum l.
template <int kOffset>
__device__ __forceinline__ void reduce_scatter_level(float (&v)[32], int lane) {
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int i = 0; i < kOffset; ++i) {
    const float lo = v[i], hi = v[i + kOffset];
    const float keep = upper ? hi : lo, send = upper ? lo : hi;
    v[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, kOffset));
  }
}
__device__ __forceinline__ float reduce_scatter_32(float (&v)[32], int lane) {
  reduce_scatter_level<16>(v, lane);
  reduce_scatter_level<8>(v, lane);
  reduce_scatter_level<4>(v, lane);
  reduce_scatter_level<2>(v, lane);
  reduce_scatter_level<1>(v, lane);
  return v[0];
}

__device__ __forceinline__ float inv_norm(float sum_sq) {
  return rcp_sqrt_rn(__fadd_rn(sum_sq, kNormEps));
}

// Four consecutive bf16 values (8 bytes) to float.
__device__ __forceinline__ void unpack4(uint2 raw, float (&x)[4]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = bf16_to_float(h[i]);
}

// Row address for ldmatrix of the A fragment of rows 0..15, k-step ks, of a swizzled [16][128] tile.
__device__ __forceinline__ const __nv_bfloat16* a_frag_row(const __nv_bfloat16* tile, int ks, int lane) {
  const int m = lane >> 3, row = (lane & 7) + 8 * (m & 1), col = 16 * ks + 8 * (m >> 1);
  return tile + swizzle_wide(row, col);
}
// Row address for ldmatrix of the A fragment of rows 0..15, k-step ks, of tile 0 (Kd) or 1 (Qd) of a record's
// Kd|Qd block (record_kq).
__device__ __forceinline__ const __nv_bfloat16* a_frag_in_record(const __nv_bfloat16* kq, int tile, int ks, int lane) {
  const int m = lane >> 3, row = (lane & 7) + 8 * (m & 1), col = 16 * ks + 8 * (m >> 1);
  return kq + record_kq(tile, row, col);
}
// Row address for ldmatrix of the B fragments (n-tiles 0 and 1, k-step ks) of Xᵀ, X a swizzled [16][128] tile.
__device__ __forceinline__ const __nv_bfloat16* b_frag_row(const __nv_bfloat16* tile, int ks, int lane) {
  const int m = lane >> 3, row = (lane & 7) + 8 * (m >> 1), col = 16 * ks + 8 * (m & 1);
  return tile + swizzle_wide(row, col);
}


// ---- The softplus gate's intra-chunk products (docs/NUMERICS.md, "The softplus gate") -------------------------
// A = Σ_c k̂_i k̂_j 2^(G_i − G_j) (i > j) and Mqk = Σ_c q̃_i k̂_j 2^(G_i − G_j) (i ≥ j), q̃ = scale·q̂, without the
// factor 2^(−G) of Ki, which overflows once a chunk's decay passes 2^−128 (the lower-bound gate cannot get there in
// 16 tokens). The 16 rows form 4 blocks of 4. A pair inside a block has its coefficient formed directly, and its
// sum over the channels is taken in fp32 (the halving tree). A pair across blocks splits the coefficient at an
// anchor row e between them, 2^(G_i − G_e) · 2^(G_e − G_j), both exponents ≤ 0, and is a tensor-core product of
// (k̂_i or q̃_i)·2^(G_i − G_e) and k̂_j·2^(G_e − G_j). Anchors: row 7 for rows 8..15 against 0..7, row 3 for 4..7
// against 0..3, row 11 for 12..15 against 8..11. One m16n16 product holds all three:
//   A-operand tiles (Lk, Lq) row x: rows 4..15 at x = i − 4 (anchor 3 for i < 8, else 7), rows 12..15 also at
//   x = i (anchor 11);  B-operand tile (R) row y: j 0..7 at y = j (anchor 7), j 8..11 at y = j (anchor 11),
//   j 0..3 at y = j + 12 (anchor 3).
// Tile rows are written no later than the raw row of the same tile index is read (Lq and R share tiles with the
// raw q and k rows), except R's rows 12..15, held until the loop ends. A factor that underflows to zero bounds
// its coefficient below 2^−126: nothing overflows.
constexpr int kAnchorBlock = 4;
constexpr int kDiagPairs = 16;  // per block: 6 pairs i > j of A, then 10 pairs i ≥ j of Mqk

// Pair p of a block: rows (i, j) within the block and whether it is A's (else Mqk's).
__host__ __device__ constexpr void diag_pair(int p, int& i, int& j, bool& of_a) {
  of_a = p < 6;
  const int q = of_a ? p : p - 6;
  if (of_a) {
    i = q < 1 ? 1 : (q < 3 ? 2 : 3);
    j = q - i * (i - 1) / 2;
  } else {
    i = q < 1 ? 0 : (q < 3 ? 1 : (q < 6 ? 2 : 3));
    j = q - i * (i + 1) / 2;
  }
}

__device__ __forceinline__ uint2 pack4_scaled(const float (&x)[4], const float (&f)[4]) {
  return make_uint2(pack_bf16x2(__fmul_rn(x[0], f[0]), __fmul_rn(x[1], f[1])),
                    pack_bf16x2(__fmul_rn(x[2], f[2]), __fmul_rn(x[3], f[3])));
}
// 2^(G_to − G_from) for the lane's channels.
__device__ __forceinline__ void anchor_factors(const float (&to)[4], const float (&from)[4], float (&f)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) f[c] = ex2_approx(__fsub_rn(to[c], from[c]));
}

// Row r's operand rows (kh = k̂, qt = q̃): into Lk, Lq and R, or R's late rows.
__device__ __forceinline__ void anchored_operand_rows(int r, const float (&kh)[4], const float (&qt)[4],
                                                      const float (&cum)[kChunk][kChannelsPerLane], int ch0,
                                                      __nv_bfloat16* lk, __nv_bfloat16* lq, __nv_bfloat16* rt,
                                                      uint2 (&late_rows)[kAnchorBlock]) {
  float f[4];
  if (r >= kAnchorBlock) {
    anchor_factors(cum[r], cum[r < 2 * kAnchorBlock ? 3 : 7], f);
    const int at = swizzle_wide(r - kAnchorBlock, ch0);
    *reinterpret_cast<uint2*>(lk + at) = pack4_scaled(kh, f);
    *reinterpret_cast<uint2*>(lq + at) = pack4_scaled(qt, f);
  }
  if (r >= 3 * kAnchorBlock) {
    anchor_factors(cum[r], cum[11], f);
    const int at = swizzle_wide(r, ch0);
    *reinterpret_cast<uint2*>(lk + at) = pack4_scaled(kh, f);
    *reinterpret_cast<uint2*>(lq + at) = pack4_scaled(qt, f);
  }
  if (r < 3 * kAnchorBlock) {
    anchor_factors(cum[r < 2 * kAnchorBlock ? 7 : 11], cum[r], f);
    *reinterpret_cast<uint2*>(rt + swizzle_wide(r, ch0)) = pack4_scaled(kh, f);
  }
  if (r < kAnchorBlock) {
    anchor_factors(cum[3], cum[r], f);
    late_rows[r] = pack4_scaled(kh, f);
  }
}

// The lane's leaves of the pair sums of block b whose later row is row i of the block (kh = k̂, qt = q̃ of that row;
// block_k: k̂ of the block's earlier rows): ((x0 + x1) + (x2 + x3)), x_c = (a_c · k̂_j,c) · 2^(G_i,c − G_j,c), a = k̂_i
// (A) or q̃_i (Mqk); the diagonal's coefficient is 1 (not multiplied), and A's and Mqk's pairs share theirs.
__device__ __forceinline__ void diag_row_leaves(int b, int i, const float (&kh)[4], const float (&qt)[4],
                                                const float (&block_k)[kAnchorBlock][kChannelsPerLane],
                                                const float (&cum)[kChunk][kChannelsPerLane],
                                                float (&leaves)[kDiagPairs]) {
  const int row = kAnchorBlock * b + i;
#pragma unroll
  for (int j = 0; j <= i; ++j) {
    float xa[4], xm[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float kj = j == i ? kh[c] : block_k[j][c];
      xa[c] = __fmul_rn(kh[c], kj);
      xm[c] = __fmul_rn(qt[c], kj);
      if (j < i) {
        const float coeff = ex2_approx(__fsub_rn(cum[row][c], cum[kAnchorBlock * b + j][c]));
        xa[c] = __fmul_rn(xa[c], coeff);
        xm[c] = __fmul_rn(xm[c], coeff);
      }
    }
    // Pair indices (diag_pair): A's (i, j) is i(i − 1)/2 + j, Mqk's (i, j) is 6 + i(i + 1)/2 + j.
    if (j < i) leaves[i * (i - 1) / 2 + j] = __fadd_rn(__fadd_rn(xa[0], xa[1]), __fadd_rn(xa[2], xa[3]));
    leaves[6 + i * (i + 1) / 2 + j] = __fadd_rn(__fadd_rn(xm[0], xm[1]), __fadd_rn(xm[2], xm[3]));
  }
}

// What the softplus gate's rows carry from row to row: k̂ of the current block's rows, the leaves of its pair sums,
// the block sums (diag_sums[b]: sum lane / 2 of block b) and R's rows 12..15 (written once raw k's rows 12..15 are
// read).
struct AnchoredRows {
  float block_k[kAnchorBlock][kChannelsPerLane];
  float leaves[kDiagPairs];
  float diag_sums[kChunk / kAnchorBlock];
  uint2 late_rows[kAnchorBlock];
};

// Row r's part of the softplus gate's products (kh = k̂, qt = q̃), once every lane has read the raw row r: its
// operand rows (anchored_operand_rows) and its block's pair leaves; the block's sums after its last row.
__device__ __forceinline__ void anchored_row(int r, const float (&kh)[4], const float (&qt)[4],
                                             const float (&cum)[kChunk][kChannelsPerLane], int ch0, int lane,
                                             __nv_bfloat16* lk, __nv_bfloat16* lq, __nv_bfloat16* rt,
                                             AnchoredRows& a) {
  anchored_operand_rows(r, kh, qt, cum, ch0, lk, lq, rt, a.late_rows);
  diag_row_leaves(r / kAnchorBlock, r % kAnchorBlock, kh, qt, a.block_k, cum, a.leaves);
#pragma unroll
  for (int c = 0; c < kChannelsPerLane; ++c) a.block_k[r % kAnchorBlock][c] = kh[c];
  if (r % kAnchorBlock == kAnchorBlock - 1) a.diag_sums[r / kAnchorBlock] = reduce_scatter_16(a.leaves, lane);
}

__device__ __forceinline__ void anchored_late_rows(const AnchoredRows& a, int ch0, __nv_bfloat16* rt) {
#pragma unroll
  for (int i = 0; i < kAnchorBlock; ++i) {
    *reinterpret_cast<uint2*>(rt + swizzle_wide(3 * kAnchorBlock + i, ch0)) = a.late_rows[i];
  }
}

// The softplus gate's A and Mqk from the product of Lk / Lq with Rᵀ (accumulators as in phase 3) and the block
// sums (AnchoredRows): β·A into a_rows (row stride kAStride), Mqk into rec_mqk. m_stage: fp32 [16][16] scratch.
__device__ __forceinline__ void anchored_epilogue(const float (&a_acc)[2][4], const float (&m_acc)[2][4],
                                                  const float (&diag_sums)[kChunk / kAnchorBlock], float my_beta,
                                                  float* a_rows,
                                                  float* m_stage, __nv_bfloat16* rec_mqk, int lane) {
  const int gi = lane >> 2, ti = lane & 3;
  // Accumulator (half, nt, e) is tile row x = gi + 8·half, column y = 8·nt + 2·ti + e (A row i, column j):
  //   nt 0, x in 4..11: anchor 7, i = x + 4, j = y;  nt 1, x in 0..3, y ≥ 12: anchor 3, i = x + 4, j = y − 12;
  //   nt 1, x in 12..15, y in 8..11: anchor 11, i = x, j = y.  The rest mixes anchors and is dropped.
  const float beta_x4 = __shfl_sync(0xffffffffu, my_beta, (gi + 4) & 15);
  const float beta_x12 = __shfl_sync(0xffffffffu, my_beta, (gi + 12) & 15);
  const float beta_x8 = __shfl_sync(0xffffffffu, my_beta, (gi + 8) & 15);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int x = gi + 8 * half;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int y = 8 * nt + 2 * ti + e;
        int i = -1, j = 0;
        float b = 0.f;
        if (nt == 0 && x >= 4 && x < 12) {
          i = x + 4, j = y, b = half == 0 ? beta_x4 : beta_x12;
        } else if (nt == 1 && x < 4 && y >= 12) {
          i = x + 4, j = y - 12, b = beta_x4;
        } else if (nt == 1 && x >= 12 && y < 12) {
          i = x, j = y, b = beta_x8;
        }
        if (i >= 0) {
          a_rows[i * kAStride + j] = __fmul_rn(a_acc[nt][2 * half + e], b);
          m_stage[i * kChunk + j] = m_acc[nt][2 * half + e];
        }
      }
    }
  }
  // The block sums: lanes 2p and 2p + 1 hold pair p of every block (the even one writes it).
  int pi = 0, pj = 0;
  bool of_a = false;
  diag_pair(lane >> 1, pi, pj, of_a);
#pragma unroll
  for (int b = 0; b < kChunk / kAnchorBlock; ++b) {
    const int i = kAnchorBlock * b + pi, j = kAnchorBlock * b + pj;
    const float beta_i = __shfl_sync(0xffffffffu, my_beta, i);
    if ((lane & 1) == 0) {
      if (of_a) {
        a_rows[i * kAStride + j] = __fmul_rn(diag_sums[b], beta_i);
      } else {
        m_stage[i * kChunk + j] = diag_sums[b];
      }
    }
  }
  __syncwarp();
  // Mqk, causally masked: lane l writes row l / 2, columns 8·(l % 2) .. + 7 (one 16-byte piece).
  const int row = lane >> 1, col0 = 8 * (lane & 1);
  uint32_t bits[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int col = col0 + 2 * c;
    bits[c] = pack_bf16x2(col <= row ? m_stage[row * kChunk + col] : 0.f,
                          col + 1 <= row ? m_stage[row * kChunk + col + 1] : 0.f);
  }
  *reinterpret_cast<uint4*>(rec_mqk + swizzle_narrow(row, col0)) = make_uint4(bits[0], bits[1], bits[2], bits[3]);
}

// The lower-bound gate's A and Mqk from the products Kd·Kiᵀ and Qd·Kiᵀ (accumulators of phase 3): β·A into a_rows
// (row stride kAStride), Mqk, causally masked, into rec_mqk.
__device__ __forceinline__ void product_epilogue(const float (&a_acc)[2][4], const float (&m_acc)[2][4], float my_beta,
                                                 float* a_rows, __nv_bfloat16* rec_mqk, int lane) {
  const int gi = lane >> 2, ti = lane & 3;
  const float beta_lo = __shfl_sync(0xffffffffu, my_beta, gi), beta_hi = __shfl_sync(0xffffffffu, my_beta, gi + 8);
  // Mqk's row gi + 8·half: lane ti holds columns 2ti, 2ti + 1 of both n-tiles; lane pairs trade so that the even
  // lane stores columns 2ti .. 2ti + 3 and the odd one 2ti + 6 .. 2ti + 9, and 4 lanes write the row's whole sector.
  const bool odd = (ti & 1) != 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = gi + 8 * half;
    const float b = half == 0 ? beta_lo : beta_hi;
    uint32_t m_bits[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = 8 * nt + 2 * ti;  // accumulators 2·half, 2·half + 1
      *reinterpret_cast<float2*>(a_rows + row * kAStride + col) =
          make_float2(__fmul_rn(a_acc[nt][2 * half], b), __fmul_rn(a_acc[nt][2 * half + 1], b));
      const float m0 = col <= row ? m_acc[nt][2 * half] : 0.f;
      const float m1 = col + 1 <= row ? m_acc[nt][2 * half + 1] : 0.f;
      m_bits[nt] = pack_bf16x2(m0, m1);
    }
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? m_bits[0] : m_bits[1], 1);
    *reinterpret_cast<uint2*>(rec_mqk + swizzle_narrow(row, 2 * ti + (odd ? 6 : 0))) =
        odd ? make_uint2(got, m_bits[1]) : make_uint2(m_bits[0], got);
  }
}

// Phases 3 and 4 of a chunk (prepare_chunk) whose phases 0 to 2b have written the record's Kd|Qd block (rec_kq) and
// the scratch tiles: the products, then INV. my_beta: β of row `lane` (lanes 0..15); diag_sums: the softplus gate's
// block sums (AnchoredRows; unread for the lower-bound gate).
template <bool kInSmem, GateKind kGate>
__device__ __forceinline__ void chunk_products(const __nv_bfloat16* rec_kq, __nv_bfloat16* rec_inv,
                                               __nv_bfloat16* rec_mqk, __nv_bfloat16* tile_kd, __nv_bfloat16* tile_qd,
                                               __nv_bfloat16* tile_ki, float my_beta,
                                               const float (&diag_sums)[kChunk / kAnchorBlock], int lane) {
  constexpr bool softplus = kGate == GateKind::kSoftplus;
  // Phase 3: A = Kd·Kiᵀ and Mqk = Qd·Kiᵀ on the tensor cores, k-steps in order (softplus gate: Lk·Rᵀ and Lq·Rᵀ, the
  // same tiles' places, then anchored_epilogue). Mqk leaves from the accumulators, causally masked; β·A goes to a
  // dead tile (kd, or ki once read) for the substitution: its factors A_im·β_i, each rounded once here instead of
  // once by every column's lane (the same value).
  float* a_rows = reinterpret_cast<float*>(kInSmem ? tile_ki : tile_kd);
  {
    float a_acc[2][4] = {}, m_acc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t kd_frag[4], qd_frag[4], ki_frag[4];
      if constexpr (kInSmem) {
        ldmatrix_x4(kd_frag, a_frag_in_record(rec_kq, 0, ks, lane));
        ldmatrix_x4(qd_frag, a_frag_in_record(rec_kq, 1, ks, lane));
      } else {
        ldmatrix_x4(kd_frag, a_frag_row(tile_kd, ks, lane));
        ldmatrix_x4(qd_frag, a_frag_row(tile_qd, ks, lane));
      }
      ldmatrix_x4(ki_frag, b_frag_row(tile_ki, ks, lane));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t b[2] = {ki_frag[2 * nt], ki_frag[2 * nt + 1]};
        mma_bf16_16816(a_acc[nt], kd_frag, b);
        mma_bf16_16816(m_acc[nt], qd_frag, b);
      }
    }
    __syncwarp();  // every lane's fragments of the tile are read before β·A overwrites it
    if constexpr (softplus) {
      anchored_epilogue(a_acc, m_acc, diag_sums, my_beta, a_rows, a_rows + kChunk * kAStride, rec_mqk, lane);
    } else {
      product_epilogue(a_acc, m_acc, my_beta, a_rows, rec_mqk, lane);
    }
  }
  __syncwarp();

  // Phase 4: INV by forward substitution (lane j < 16 owns column j, rows in order, m in order).
  if (lane < kChunk) {
    const int j = lane;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) {
        acc = __fadd_rn(acc, __fmul_rn(a_rows[i * kAStride + m], x[m]));
      }
      x[i] = __fsub_rn(i == j ? 1.f : 0.f, acc);
      rec_inv[swizzle_narrow(i, j)] = __float2bfloat16_rn(x[i]);
    }
  }
}

// Phases 3 and 4 of a chunk that prepare_chunk's looped form has taken through phase 2b into `record` (a ring stage),
// with `scratch` as it left it; my_beta: what it returned.
__device__ __forceinline__ void finish_looped_chunk(uint8_t* record, __nv_bfloat16* scratch, float my_beta, int lane) {
  const float no_sums[kChunk / kAnchorBlock] = {};
  chunk_products<true, GateKind::kLowerBound>(
      reinterpret_cast<const __nv_bfloat16*>(record + ChunkRecordLayout::kKdQdOffset),
      reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kInvOffset),
      reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kMqkOffset), scratch, nullptr, scratch, my_beta,
      no_sums, lane);
}

// No work between issuing a chunk's loads and waiting for them (prepare_chunk's default).
struct NoWork {
  __device__ __forceinline__ void operator()() const {}
};

// One chunk of one head, by one warp: rows t0 .. t0 + rows - 1 (rows <= 16; the rest are zero) into `record`.
// kInSmem = false (the preparation kernel): `record` is a workspace record, `scratch` three tiles (PrepScratch).
// kInSmem = true (the single-pass kernel; the stream pass with kLooped): `record` is a ring stage in shared memory
// and `scratch` one tile (kLooped: kLoopedScratchBytes, a PrepScratch, the tile then G's fp32 rows). The
// raw q and k rows then go straight to where Qd's and Kd's rows will be written (the record's Kd|Qd block: each
// lane overwrites only the 8 bytes it read), g to the tile, which later holds Ki and then A; the products read
// Kd and Qd from the record. The same arithmetic in the same order either way, so the record's bits are the same.
// On return every async copy this warp issued before the call has landed too.
// Unless kLooped, every row of Krᵀ and of Mqk leaves as one whole 32-byte L2 sector (lane pairs trade halves)
// rather than two partial ones: the L2 is the busiest unit of the preparation kernel (docs/DESIGN.md, "Floors").
// kLooped (the stream pass, kInSmem and the lower-bound gate): phases 1 and 2b run as loops (2a stays unrolled), so
// that a preparing warp's code stays in the instruction cache beside the step warps' (docs/DESIGN.md, "The stream
// pass"). The running sums G go to shared memory behind the tile instead of registers, raw g to the record's Krᵀ
// block, and Krᵀ leaves every kLoopRows rows. while_loading() runs once the chunk's loads are issued, before any
// is awaited (the stream pass finishes its previous chunk there), and phases 3 and 4 are left to the caller
// (finish_looped_chunk, with the returned β). The same arithmetic in the same order: the record's bits are the same.
// Returns β of row `lane` (lanes 0..15).
template <bool kInSmem, GateKind kGate = GateKind::kLowerBound, bool kLooped = false, typename WhileLoading = NoWork>
__device__ __forceinline__ float prepare_chunk(const FwdParams& p, int h, int64_t t0, int rows, uint8_t* record,
                                               __nv_bfloat16* scratch, int lane, WhileLoading while_loading = {}) {
  const int H = p.heads;
  const int hk = key_head_of(p, h);
  const auto* q = static_cast<const __nv_bfloat16*>(p.q);
  const auto* k = static_cast<const __nv_bfloat16*>(p.k);
  const auto* g = static_cast<const __nv_bfloat16*>(p.g);
  const auto* beta = static_cast<const __nv_bfloat16*>(p.beta);
  const int ch0 = kChannelsPerLane * lane;
  static_assert(!kInSmem || kGate == GateKind::kLowerBound,
                "kInSmem (the single pass, the looped stream pass) runs the lower-bound gate only");
  static_assert(!kLooped || kInSmem, "the looped form keeps its running sums where kInSmem leaves room");
  constexpr bool softplus = kGate == GateKind::kSoftplus;
  auto row_offset = [&](int r) { return ((t0 + r) * H + h) * kHeadDim + ch0; };
  auto key_row_offset = [&](int r) { return ((t0 + r) * p.key_heads + hk) * kHeadDim + ch0; };

  auto* rec_kq = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKdQdOffset);
  auto* rec_krt = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKrTOffset);
  auto* rec_inv = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kInvOffset);
  auto* rec_mqk = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kMqkOffset);
  auto* rec_decay = reinterpret_cast<float*>(record + ChunkRecordLayout::kDecayOffset);
  auto* rec_beta = reinterpret_cast<float*>(record + ChunkRecordLayout::kBetaOffset);
  // The tiles: kd, qd and ki of PrepScratch, or (kInSmem) the one tile as ki (kLooped: G's fp32 rows, cum_rows,
  // behind it).
  __nv_bfloat16* tile_kd = scratch;
  __nv_bfloat16* tile_qd = scratch + kChunk * kHeadDim;
  __nv_bfloat16* tile_ki = kInSmem ? scratch : scratch + 2 * kChunk * kHeadDim;
  // Where the raw rows of q, k and g land (8 bytes per lane and row).
  auto raw_q = [&](int r) { return kInSmem ? rec_kq + record_kq(1, r, ch0) : tile_qd + r * kHeadDim + ch0; };
  auto raw_k = [&](int r) { return kInSmem ? rec_kq + record_kq(0, r, ch0) : tile_ki + r * kHeadDim + ch0; };
  // (kLooped: the record's Krᵀ block, written only once phase 1 has read g, so that the tile stays free for the
  // previous chunk's phases 3 and 4 while this chunk's copies are in flight.)
  __nv_bfloat16* raw_g = kLooped ? rec_krt : (kInSmem ? tile_ki : tile_kd);

  // Phase 0: the q, k and g rows go to shared memory by async copies (one 8-byte copy per lane, row and input,
  // zeros past the end of the sequence), all issued before the first is needed, so an item costs one memory
  // round trip; the gate parameters and β are loaded meanwhile. Each row's raw data sits in row r of its tile
  // (or of the record's Kd|Qd block), which later holds the row's results (a swizzle never leaves its row).
  auto load_row = [&](int r) {
    const bool valid = r < rows;
    const int64_t at = valid ? row_offset(r) : 0, key_at = valid ? key_row_offset(r) : 0;
    cp_async_8(raw_q(r), q + key_at, valid ? 8 : 0);
    cp_async_8(raw_k(r), k + key_at, valid ? 8 : 0);
    cp_async_8(raw_g + r * kHeadDim + ch0, g + at, valid ? 8 : 0);
  };
  if constexpr (kLooped) {
    // The sources advance by a token's stride (64-bit adds, where load_row recomputes each row's offset in 64-bit
    // products) and stay on the last valid row past the end (read nothing there: zero bytes).
    const int64_t stride = static_cast<int64_t>(H) * kHeadDim;
    const int64_t key_stride = static_cast<int64_t>(p.key_heads) * kHeadDim;
    const __nv_bfloat16* q_src = q + key_row_offset(0);
    const __nv_bfloat16* k_src = k + key_row_offset(0);
    const __nv_bfloat16* g_src = g + row_offset(0);
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      const int bytes = r < rows ? 8 : 0;
      cp_async_8(raw_q(r), q_src, bytes);
      cp_async_8(raw_k(r), k_src, bytes);
      cp_async_8(raw_g + r * kHeadDim + ch0, g_src, bytes);
      if (r + 1 < rows) q_src += key_stride, k_src += key_stride, g_src += stride;
    }
  } else {
#pragma unroll
    for (int r = 0; r < kChunk; ++r) load_row(r);
  }
  cp_async_commit();
  const bool has_beta = lane < rows;  // lanes 0..15 own β of row `lane`
  HeadGate hg;
  float beta_raw;
  if constexpr (kLooped) {
    // The parameters' and β's loads are issued, then while_loading() runs before any of their registers is read.
    const HeadGateBits bits = load_head_gate_bits(p, h, ch0);
    const __nv_bfloat16 beta_bits = has_beta ? beta[(t0 + lane) * H + h] : __float2bfloat16_rn(0.f);
    while_loading();
    hg = head_gate_from(p, bits);
    beta_raw = bf16_to_float(beta_bits);
  } else {
    hg = head_gate(p, h, ch0);
    beta_raw = has_beta ? bf16_to_float(beta[(t0 + lane) * H + h]) : 0.f;
  }
  cp_async_wait<0>();
  __syncwarp();

  // Phase 1: the gates γ (gate.cuh) and their running sum G (kLooped: G's rows to cum_rows, its last in last_cum).
  float cum[kChunk][kChannelsPerLane];  // (kLooped: unused)
  float* cum_rows = reinterpret_cast<float*>(scratch + kChunk * kHeadDim);
  float last_cum[kChannelsPerLane];
  float acc[kChannelsPerLane] = {0.f, 0.f, 0.f, 0.f};
  auto add_row = [&](int r) {  // row r's gates into the running sums acc
    float gf[4];
    unpack4(*reinterpret_cast<const uint2*>(raw_g + r * kHeadDim + ch0), gf);
#pragma unroll
    for (int c = 0; c < kChannelsPerLane; ++c) {
      const float gamma = r < rows ? gate_log2<kGate>(hg, c, gf[c]) : 0.f;
      acc[c] = __fadd_rn(acc[c], gamma);
    }
  };
  if constexpr (kLooped) {
#pragma unroll 2
    for (int r = 0; r < kChunk; ++r) {
      add_row(r);
      *reinterpret_cast<float4*>(cum_rows + r * kHeadDim + ch0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
#pragma unroll
    for (int c = 0; c < kChannelsPerLane; ++c) last_cum[c] = acc[c];
  } else {
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      add_row(r);
#pragma unroll
      for (int c = 0; c < kChannelsPerLane; ++c) cum[r][c] = acc[c];
    }
  }
  const float my_beta = has_beta ? beta_of(p, beta_raw) : 0.f;  // lanes 0..15: β of row `lane`
  if (lane < kChunk) rec_beta[lane] = my_beta;
  const float (&last)[kChannelsPerLane] = kLooped ? last_cum : cum[kChunk - 1];  // Γ, the chunk's G
  {
    float4 decay;
    decay.x = ex2_approx(last[0]);
    decay.y = ex2_approx(last[1]);
    decay.z = ex2_approx(last[2]);
    decay.w = ex2_approx(last[3]);
    *reinterpret_cast<float4*>(rec_decay + ch0) = decay;
  }

  // Phase 2a: the 32 squared norms (q and k of 16 rows) in one reduce-scatter; lane r ends with q's of row r
  // and lane 16 + r with k's, so one reciprocal square root per lane serves all rows.
  float leaves[2 * kChunk];
#pragma unroll
  for (int r = 0; r < kChunk; ++r) {
    float qf[4], kf[4];
    unpack4(*reinterpret_cast<const uint2*>(raw_q(r)), qf);
    unpack4(*reinterpret_cast<const uint2*>(raw_k(r)), kf);
    leaves[r] = sum_squares_4(qf);
    leaves[kChunk + r] = sum_squares_4(kf);
  }
  const float my_inv_norm = inv_norm(reduce_scatter_32(leaves, lane));

  // Phase 2b, row by row: the decayed / restored keys and queries (softplus gate: and the anchored products' rows).
  // Row r's G is cum_r; its restored keys Kr = k̂·2^(Γ − G) go to keep_kr(c, Kr of channel ch0 + c).
  AnchoredRows anchored;
  auto row_step = [&](int r, const float (&cum_r)[kChannelsPerLane], auto&& keep_kr) {
    float qf[4], kf[4];
    unpack4(*reinterpret_cast<const uint2*>(raw_q(r)), qf);
    unpack4(*reinterpret_cast<const uint2*>(raw_k(r)), kf);
    const float inv_norm_q = __shfl_sync(0xffffffffu, my_inv_norm, r);
    const float inv_norm_k = __shfl_sync(0xffffffffu, my_inv_norm, kChunk + r);
    float kd[4], qd[4], kh[4], qt[4];
    [[maybe_unused]] float ki[4];  // (the lower-bound gate's)
#pragma unroll
    for (int c = 0; c < kChannelsPerLane; ++c) {
      kh[c] = __fmul_rn(kf[c], inv_norm_k);
      qt[c] = __fmul_rn(__fmul_rn(qf[c], inv_norm_q), p.scale);
      const float decay = ex2_approx(cum_r[c]);
      kd[c] = __fmul_rn(kh[c], decay);
      qd[c] = __fmul_rn(qt[c], decay);
      if constexpr (!softplus) ki[c] = __fmul_rn(kh[c], ex2_approx(-cum_r[c]));
      keep_kr(c, __fmul_rn(kh[c], ex2_approx(__fsub_rn(last[c], cum_r[c]))));
    }
    const int at = swizzle_wide(r, ch0);
    const uint2 kd_bits = make_uint2(pack_bf16x2(kd[0], kd[1]), pack_bf16x2(kd[2], kd[3]));
    const uint2 qd_bits = make_uint2(pack_bf16x2(qd[0], qd[1]), pack_bf16x2(qd[2], qd[3]));
    __syncwarp();  // every lane has read row r's raw q and k before any lane overwrites the row
    *reinterpret_cast<uint2*>(rec_kq + record_kq(0, r, ch0)) = kd_bits;
    *reinterpret_cast<uint2*>(rec_kq + record_kq(1, r, ch0)) = qd_bits;
    if constexpr (softplus) {
      anchored_row(r, kh, qt, cum, ch0, lane, tile_kd, tile_qd, tile_ki, anchored);
    } else {
      if constexpr (!kInSmem) {
        *reinterpret_cast<uint2*>(tile_kd + at) = kd_bits;
        *reinterpret_cast<uint2*>(tile_qd + at) = qd_bits;
      }
      *reinterpret_cast<uint2*>(tile_ki + at) = make_uint2(pack_bf16x2(ki[0], ki[1]), pack_bf16x2(ki[2], ki[3]));
    }
  };
  // Straight-line form: Krᵀ rows ch0..ch0+3 as bf16 token pairs, krt_packed[c][i] holding tokens 2i, 2i + 1 of
  // channel ch0 + c (the looped form stores each turn's pieces instead).
  uint32_t krt_packed[kChannelsPerLane][kChunk / 2];
  if constexpr (kLooped) {
    // kLoopRows rows per turn; their Krᵀ pieces (kLoopRows / 2 token pairs of each channel) leave at its end.
#pragma unroll 1
    for (int r0 = 0; r0 < kChunk; r0 += kLoopRows) {
      uint32_t piece[kChannelsPerLane][kLoopRows / 2];
      float kr_even[kChannelsPerLane];
#pragma unroll
      for (int i = 0; i < kLoopRows; ++i) {
        const float4 g_row = *reinterpret_cast<const float4*>(cum_rows + (r0 + i) * kHeadDim + ch0);
        const float cum_r[kChannelsPerLane] = {g_row.x, g_row.y, g_row.z, g_row.w};
        row_step(r0 + i, cum_r, [&](int c, float kr) {
          if (i % 2 == 0) {
            kr_even[c] = kr;
          } else {
            piece[c][i / 2] = pack_bf16x2(kr_even[c], kr);
          }
        });
      }
#pragma unroll
      for (int c = 0; c < kChannelsPerLane; ++c) {
        *reinterpret_cast<uint2*>(rec_krt + swizzle_narrow(ch0 + c, r0)) = make_uint2(piece[c][0], piece[c][1]);
      }
    }
  } else {
    float kr_even[kChannelsPerLane];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      row_step(r, cum[r], [&](int c, float kr) {
        if (r % 2 == 0) {
          kr_even[c] = kr;
        } else {
          krt_packed[c][r / 2] = pack_bf16x2(kr_even[c], kr);
        }
      });
    }
  }
  if constexpr (softplus) anchored_late_rows(anchored, ch0, tile_ki);
  // Straight-line form: Krᵀ rows ch0..ch0+3 (16 tokens each, two 16-byte halves, swizzled). Lane pairs trade halves
  // so that each store writes whole 32-byte rows: the even lane writes half 0 and the odd lane half 1 of the pair's
  // even row, then of its odd row.
  if constexpr (!kLooped) {
    const bool odd = (lane & 1) != 0;
    const int even_ch0 = ch0 & ~4, odd_ch0 = ch0 | 4;
#pragma unroll
    for (int c = 0; c < kChannelsPerLane; ++c) {
      uint32_t got[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        got[i] = __shfl_xor_sync(0xffffffffu, odd ? krt_packed[c][i] : krt_packed[c][4 + i], 1);
      }
      const uint4 mine0 = make_uint4(krt_packed[c][0], krt_packed[c][1], krt_packed[c][2], krt_packed[c][3]);
      const uint4 mine1 = make_uint4(krt_packed[c][4], krt_packed[c][5], krt_packed[c][6], krt_packed[c][7]);
      const uint4 theirs = make_uint4(got[0], got[1], got[2], got[3]);
      *reinterpret_cast<uint4*>(rec_krt + swizzle_narrow(even_ch0 + c, odd ? 8 : 0)) = odd ? theirs : mine0;
      *reinterpret_cast<uint4*>(rec_krt + swizzle_narrow(odd_ch0 + c, odd ? 8 : 0)) = odd ? mine1 : theirs;
    }
  }
  __syncwarp();

  if constexpr (!kLooped) {
    chunk_products<kInSmem, kGate>(rec_kq, rec_inv, rec_mqk, tile_kd, tile_qd, tile_ki, my_beta, anchored.diag_sums,
                                   lane);
  }
  return my_beta;
}


// Chunk j of sequence n, head h, of a fixed-length batch (the overlap's items), into its record.
template <GateKind kGate>
__device__ __forceinline__ void prepare_fixed_chunk(const FwdParams& p, int64_t j, int64_t n, int h, int lane,
                                                    int warp) {
  const int64_t bos = n * p.seqlen;
  const int64_t remaining = p.seqlen - j * kChunk;
  const int rows = static_cast<int>(remaining < kChunk ? remaining : kChunk);
  extern __shared__ __align__(16) uint8_t prep_smem[];
  PrepScratch& sc = reinterpret_cast<PrepScratch*>(prep_smem)[warp];
  uint8_t* record = static_cast<uint8_t*>(p.workspace) +
                    (static_cast<size_t>(first_slot(bos, n) + j) * p.heads + h) *
                        static_cast<size_t>(ChunkRecordLayout::kBytes);
  prepare_chunk<false, kGate>(p, h, bos + j * kChunk, rows, record, sc.kd, lane);
}

}  // namespace prep
}  // namespace kda
