// The preparation of one 16-token chunk of one head by one warp (docs/SPEC.md §2): everything of the chunk that
// does not depend on the state S. Shared by the preparation and tail kernels (prepare.cu, prepare_tail.cu), which
// write it to the workspace, and the single-pass kernel (single_pass.cuh), which writes it into its own
// shared-memory ring.
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
#include "kda/csrc/kda_params.h"
#include "kda/csrc/sm90_async.cuh"

namespace kda {
namespace prep {

constexpr int kChannelsPerLane = kHeadDim / 32;
static_assert(kChannelsPerLane == 4, "a lane owns one 8-byte piece of a 128-channel row");

// Per-warp scratch of the preparation kernel: the bf16 operands of the two products, swizzled like the record.
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
static_assert(kChunk * kAStride * 4 <= kPrepTileBytes, "β·A must fit in one dead tile");

// The lane's leaf of a squared norm over 128 values (lane l holding elements 4l..4l+3), in the order the twin
// re-enacts: (x0²+x1²)+(x2²+x3²).
__device__ __forceinline__ float sum_squares_4(const float (&x)[4]) {
  return __fadd_rn(__fadd_rn(__fmul_rn(x[0], x[0]), __fmul_rn(x[1], x[1])),
                   __fadd_rn(__fmul_rn(x[2], x[2]), __fmul_rn(x[3], x[3])));
}

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
  return __frcp_rn(__fsqrt_rn(__fadd_rn(sum_sq, kNormEps)));
}

// Four consecutive bf16 values (8 bytes) to float.
__device__ __forceinline__ void unpack4(uint2 raw, float (&x)[4]) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = bf16_to_float(h[i]);
}

// A gate parameter (A_log, dt_bias) element widened to fp32, whatever the caller's dtype (exact).
__device__ __forceinline__ float load_param(const void* base, ParamType type, int64_t i) {
  switch (type) {
    case ParamType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case ParamType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}
// Four consecutive elements (i % 4 == 0: one 16- or 8-byte load).
__device__ __forceinline__ void load_param4(const void* base, ParamType type, int64_t i, float (&x)[4]) {
  if (type == ParamType::kFloat32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if (type == ParamType::kBFloat16) {
    unpack4(*reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + i), x);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __half*>(base) + i);
    const __half2 lo = *reinterpret_cast<const __half2*>(&raw.x), hi = *reinterpret_cast<const __half2*>(&raw.y);
    x[0] = __low2float(lo), x[1] = __high2float(lo), x[2] = __low2float(hi), x[3] = __high2float(hi);
  }
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


// One chunk of one head, by one warp: rows t0 .. t0 + rows - 1 (rows <= 16; the rest are zero) into `record`.
// kInSmem = false (the preparation kernel): `record` is a workspace record, `scratch` three tiles (PrepScratch).
// kInSmem = true (the single-pass kernel): `record` is a ring stage in shared memory and `scratch` one tile. The
// raw q and k rows then go straight to where Qd's and Kd's rows will be written (the record's Kd|Qd block: each
// lane overwrites only the 8 bytes it read), g to the tile, which later holds Ki and then A; the products read
// Kd and Qd from the record. The same arithmetic in the same order either way, so the record's bits are the same.
// On return every async copy this warp issued before the call has landed too.
// Every row of Krᵀ and of Mqk leaves as one whole 32-byte L2 sector (lane pairs trade halves) rather than two
// partial ones: the L2 is the busiest unit of the preparation kernel (docs/DESIGN.md, "Floors").
template <bool kInSmem>
__device__ __forceinline__ void prepare_chunk(const FwdParams& p, int h, int64_t t0, int rows, uint8_t* record,
                                              __nv_bfloat16* scratch, int lane) {
  const int H = p.heads;
  const auto* q = static_cast<const __nv_bfloat16*>(p.q);
  const auto* k = static_cast<const __nv_bfloat16*>(p.k);
  const auto* g = static_cast<const __nv_bfloat16*>(p.g);
  const auto* beta = static_cast<const __nv_bfloat16*>(p.beta);
  const int ch0 = kChannelsPerLane * lane;
  auto row_offset = [&](int r) { return ((t0 + r) * H + h) * kHeadDim + ch0; };

  auto* rec_kq = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKdQdOffset);
  auto* rec_krt = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKrTOffset);
  auto* rec_inv = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kInvOffset);
  auto* rec_mqk = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kMqkOffset);
  auto* rec_decay = reinterpret_cast<float*>(record + ChunkRecordLayout::kDecayOffset);
  auto* rec_beta = reinterpret_cast<float*>(record + ChunkRecordLayout::kBetaOffset);
  // The tiles: kd, qd and ki of PrepScratch, or (kInSmem) the one tile as ki.
  __nv_bfloat16* tile_kd = scratch;
  __nv_bfloat16* tile_qd = scratch + kChunk * kHeadDim;
  __nv_bfloat16* tile_ki = kInSmem ? scratch : scratch + 2 * kChunk * kHeadDim;
  // Where the raw rows of q, k and g land (8 bytes per lane and row).
  auto raw_q = [&](int r) { return kInSmem ? rec_kq + record_kq(1, r, ch0) : tile_qd + r * kHeadDim + ch0; };
  auto raw_k = [&](int r) { return kInSmem ? rec_kq + record_kq(0, r, ch0) : tile_ki + r * kHeadDim + ch0; };
  __nv_bfloat16* raw_g = kInSmem ? tile_ki : tile_kd;

  // Phase 0: the q, k and g rows go to shared memory by async copies (one 8-byte copy per lane, row and input,
  // zeros past the end of the sequence), all issued before the first is needed, so an item costs one memory
  // round trip; the gate parameters and β are loaded meanwhile. Each row's raw data sits in row r of its tile
  // (or of the record's Kd|Qd block), which later holds the row's results (a swizzle never leaves its row).
#pragma unroll
  for (int r = 0; r < kChunk; ++r) {
    const bool valid = r < rows;
    const int64_t at = valid ? row_offset(r) : 0;
    cp_async_8(raw_q(r), q + at, valid ? 8 : 0);
    cp_async_8(raw_k(r), k + at, valid ? 8 : 0);
    cp_async_8(raw_g + r * kHeadDim + ch0, g + at, valid ? 8 : 0);
  }
  cp_async_commit();
  const float a_log = load_param(p.A_log, p.A_log_type, h);
  float bias_c[4];
  load_param4(p.dt_bias, p.dt_bias_type, static_cast<int64_t>(h) * kHeadDim + ch0, bias_c);
  const bool has_beta = lane < rows;  // lanes 0..15 own β of row `lane`
  const float beta_raw = has_beta ? bf16_to_float(beta[(t0 + lane) * H + h]) : 0.f;
  cp_async_wait<0>();
  __syncwarp();

  // Phase 1: gates γ = sigmoid((g + dt_bias)·2^(A_log·log2 e))·lower_bound·log2 e and their running sum G.
  const float exp_a = ex2_approx(__fmul_rn(a_log, kLog2e));
  const float gate_scale = __fmul_rn(p.lower_bound, kLog2e);
  float cum[kChunk][kChannelsPerLane];
  {
    float acc[kChannelsPerLane] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      float gf[4];
      unpack4(*reinterpret_cast<const uint2*>(raw_g + r * kHeadDim + ch0), gf);
#pragma unroll
      for (int c = 0; c < kChannelsPerLane; ++c) {
        const float x = __fmul_rn(__fadd_rn(gf[c], bias_c[c]), exp_a);
        const float gamma = r < rows ? __fmul_rn(sigmoid_approx(x), gate_scale) : 0.f;
        acc[c] = __fadd_rn(acc[c], gamma);
        cum[r][c] = acc[c];
      }
    }
  }
  const float my_beta = has_beta ? sigmoid_approx(beta_raw) : 0.f;  // lanes 0..15: β of row `lane`
  if (lane < kChunk) rec_beta[lane] = my_beta;
  {
    float4 decay;
    decay.x = ex2_approx(cum[kChunk - 1][0]);
    decay.y = ex2_approx(cum[kChunk - 1][1]);
    decay.z = ex2_approx(cum[kChunk - 1][2]);
    decay.w = ex2_approx(cum[kChunk - 1][3]);
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

  // Phase 2b, row by row: the decayed / restored keys and queries.
  uint32_t krt_packed[kChannelsPerLane][kChunk / 2];
  float kr_even[kChannelsPerLane];
#pragma unroll
  for (int r = 0; r < kChunk; ++r) {
    float qf[4], kf[4];
    unpack4(*reinterpret_cast<const uint2*>(raw_q(r)), qf);
    unpack4(*reinterpret_cast<const uint2*>(raw_k(r)), kf);
    const float inv_norm_q = __shfl_sync(0xffffffffu, my_inv_norm, r);
    const float inv_norm_k = __shfl_sync(0xffffffffu, my_inv_norm, kChunk + r);
    float kd[4], qd[4], ki[4];
#pragma unroll
    for (int c = 0; c < kChannelsPerLane; ++c) {
      const float k_hat = __fmul_rn(kf[c], inv_norm_k);
      const float q_hat = __fmul_rn(qf[c], inv_norm_q);
      const float decay = ex2_approx(cum[r][c]);
      kd[c] = __fmul_rn(k_hat, decay);
      qd[c] = __fmul_rn(__fmul_rn(q_hat, p.scale), decay);
      ki[c] = __fmul_rn(k_hat, ex2_approx(-cum[r][c]));
      const float kr = __fmul_rn(k_hat, ex2_approx(__fsub_rn(cum[kChunk - 1][c], cum[r][c])));
      if (r % 2 == 0) {
        kr_even[c] = kr;
      } else {
        krt_packed[c][r / 2] = pack_bf16x2(kr_even[c], kr);
      }
    }
    const int at = swizzle_wide(r, ch0);
    const uint2 kd_bits = make_uint2(pack_bf16x2(kd[0], kd[1]), pack_bf16x2(kd[2], kd[3]));
    const uint2 qd_bits = make_uint2(pack_bf16x2(qd[0], qd[1]), pack_bf16x2(qd[2], qd[3]));
    const uint2 ki_bits = make_uint2(pack_bf16x2(ki[0], ki[1]), pack_bf16x2(ki[2], ki[3]));
    __syncwarp();  // every lane has read row r's raw q and k before any lane overwrites the row
    *reinterpret_cast<uint2*>(rec_kq + record_kq(0, r, ch0)) = kd_bits;
    *reinterpret_cast<uint2*>(rec_kq + record_kq(1, r, ch0)) = qd_bits;
    if constexpr (!kInSmem) {
      *reinterpret_cast<uint2*>(tile_kd + at) = kd_bits;
      *reinterpret_cast<uint2*>(tile_qd + at) = qd_bits;
    }
    *reinterpret_cast<uint2*>(tile_ki + at) = ki_bits;
  }
  // Krᵀ rows ch0..ch0+3 (16 tokens each, two 16-byte halves, swizzled). Lane pairs trade halves so that each store
  // writes whole 32-byte rows: the even lane writes half 0 and the odd lane half 1 of the pair's even row, then of
  // its odd row.
  {
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

  // Phase 3: A = Kd·Kiᵀ and Mqk = Qd·Kiᵀ on the tensor cores, k-steps in order. Mqk leaves from the
  // accumulators, causally masked; β·A goes to a dead tile (kd, or ki once read) for the substitution: its factors
  // A_im·β_i, each rounded once here instead of once by every column's lane (the same value).
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


// Chunk j of sequence n, head h, of a fixed-length batch (the overlap's items), into its record.
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
  prepare_chunk<false>(p, h, bos + j * kChunk, rows, record, sc.kd, lane);
}

}  // namespace prep
}  // namespace kda
