// The decode plan's chunk step (docs/DESIGN.md, "The decode chunk step"): a short sequence's tokens, up to 16 at a
// time, in one step whose state products run on the tensor cores with fp32-grade operands, where the token-by-token
// kernel (decode.cu) spends 4 fp32 operations per state element and token. The arithmetic is docs/NUMERICS.md's
// "The decode chunk step", which flash_kda.numerics.decode_chunk_twin_forward re-enacts bit for bit.
//
// One CTA per (sequence, head), 8 warps; warp w holds state rows 16w .. 16w + 15 in fp32 registers as the
// accumulator fragments of 16 m16n8 tiles. A chunk of len <= 16 tokens t (rows past it are inert: k̂ = q̃ = v = 0,
// α = 1, β = 0, and the work for them is skipped), with P(j→t) = α_{j+1}···α_t (products of decays, never above 1,
// so neither gate can overflow) and D_t = α_0···α_t:
//   1. prepare (warp w: tokens 2w, 2w + 1): k̂, q̃, α, β as the token-by-token kernel does (decode_token.cuh);
//   2. the pair sums A_tj = Σ_c (k̂_j P(j→t))_c k̂_t,c (j < t) and B_tj = Σ_c (k̂_j P(j→t))_c q̃_t,c (j <= t), each in
//      the kernels' tree order (warp w: rows w and 15 − w, 32 sums, two reduce-scatters); the operands
//      X = [k̂_t D_t ; q̃_t D_t] and E_j = k̂_j P(j→len−1), each split into bf16 hi + lo;
//   3. warp 0: T = (I + diag(β)A)⁻¹diag(β) column by column in fp32 FMAs; every warp: W = S·Xᵀ;
//   4. per warp: U = (V − W_k)·Tᵀ, O = W_q + U·Bᵀ, S ← S ⊙ D_{len−1} + U·Eᵀ.
// Every product of fp32 matrices is a split product: three m16n8k16 MMAs per k-step (lo·hi, hi·lo, hi·hi).
// A bf16 state enters and leaves through shared memory by bulk copies (kStagedState); v is read by the preparing warps.
// The decode plan runs this step for calls of at least 16 tokens per sequence on average without per-token states
// (kda_plan.h, decode_chunk_runs); the token-by-token kernel runs the rest.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/decode_token.cuh"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/input_checks.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"
#include "kda/csrc/state_types.h"

namespace kda {
namespace {

constexpr int kStepWarps = 8;
constexpr int kStepThreads = kStepWarps * 32;
constexpr int kWarpRows = 16;  // state rows per warp: one m16 tile
static_assert(kStepWarps * kWarpRows == kHeadDim, "the warps cover a head's 128 rows");
static_assert(kStepWarps * 2 == kChunk, "warp w prepares tokens 2w and 2w + 1");
constexpr int kColTiles = kHeadDim / 8;   // n8 tiles of state columns
constexpr int kKSteps = kHeadDim / 16;    // k16 steps over the state columns
constexpr int kXPitch = kHeadDim + 8;     // bf16 per row of X: B-fragment loads free of bank conflicts
constexpr int kSmallPitch = kChunk + 8;   // bf16 per row of E, T and B: likewise
constexpr int kVPitch = kHeadDim + 4;     // fp32 per row of v: the fragment loads free of bank conflicts
// A bf16 state's rows pass through shared memory (1-D bulk copies of a row each way); 16 bytes of padding per row
// keep the fragments' 4-byte accesses free of bank conflicts.
constexpr int kStageRowBytes = kHeadDim * 2;
constexpr int kStagePitchBytes = kStageRowBytes + 16;
constexpr int kStageBytes = kHeadDim * kStagePitchBytes;

struct StepSmem {
  float k_hat[kChunk][kHeadDim];
  float q_tilde[kChunk][kHeadDim];
  float alpha[kChunk][kHeadDim];
  float beta[kChunk];
  float v[kChunk][kVPitch];  // v_t, zero past the chunk's tokens
  float a_cols[kChunk][kChunk];  // A_tj at [j][t], j < t (fp32: T's substitution, column by column)
  float decay_end[kHeadDim];  // D_{L−1}
  __nv_bfloat16 x_hi[2 * kChunk][kXPitch];  // rows 0..15: k̂_t D_t, rows 16..31: q̃_t D_t
  __nv_bfloat16 x_lo[2 * kChunk][kXPitch];
  __nv_bfloat16 e_hi[kHeadDim][kSmallPitch];  // E transposed: channel c, token j
  __nv_bfloat16 e_lo[kHeadDim][kSmallPitch];
  __nv_bfloat16 t_hi[kChunk][kSmallPitch];  // T_tj (zero above the diagonal and in rows past the chunk's tokens)
  __nv_bfloat16 t_lo[kChunk][kSmallPitch];
  __nv_bfloat16 b_hi[kChunk][kSmallPitch];  // B_tj (zero above the diagonal)
  __nv_bfloat16 b_lo[kChunk][kSmallPitch];
  uint64_t state_loaded[kStepWarps];  // warp w's 16 staged initial-state rows (one phase)
};

// x = hi + lo, each rounded to bf16 (the difference is exact in fp32).
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(__fsub_rn(x, __bfloat162float(hi)));
}

// Step 1's inputs for tokens t0 and t0 + 1 of a chunk as lane l reads them (channels 4l..4l+3), all in flight
// together: no branch around the loads (a branch made the compiler park the loaded values in local memory, each
// token's loads waiting for the previous token's).
struct TokenPairRaw {
  RawToken raw[2];
  uint2 v[2];
};
__device__ __forceinline__ TokenPairRaw load_token_pair(const FwdParams& p, int64_t c0, int len, int t0, int h, int hk,
                                                        int lane) {
  const int ch0 = prep::kChannelsPerLane * lane;
  TokenPairRaw r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // (a row past the tokens loads the last token again, unused)
    const int64_t t = c0 + (t0 + i < len ? t0 + i : len - 1);
    r.raw[i] = load_token(p, t, h, hk, ch0, 0);
    const __nv_bfloat16* v_row = static_cast<const __nv_bfloat16*>(p.v) + (t * p.heads + h) * kHeadDim;
    r.v[i] = *reinterpret_cast<const uint2*>(v_row + ch0);
  }
  return r;
}

// Step 1 for tokens t0 and t0 + 1 of the chunk (warp-wide; lane l writes channels 4l..4l+3). Rows past the
// sequence's end are inert: k̂ = q̃ = 0, α = 1, β = 0.
template <GateKind kGate>
__device__ __forceinline__ void prepare_token_pair(const FwdParams& p, const HeadGate& hg, StepSmem& sm,
                                                   const TokenPairRaw& r, int len, int t0, int lane) {
  const int ch0 = prep::kChannelsPerLane * lane;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + i;
    if (t < len) {  // (uniform over the warp)
      const LanePrep lp = prepare_token<kGate>(p, hg, r.raw[i]);
      store4(&sm.k_hat[t][ch0], lp.k_hat);
      store4(&sm.q_tilde[t][ch0], lp.q_tilde);
      store4(&sm.alpha[t][ch0], lp.alpha);
      float v[4];
      prep::unpack4(r.v[i], v);
      store4(&sm.v[t][ch0], v);
      if (lane == 0) sm.beta[t] = lp.beta;
    } else {
      const float zeros[4] = {0.f, 0.f, 0.f, 0.f}, ones[4] = {1.f, 1.f, 1.f, 1.f};
      store4(&sm.k_hat[t][ch0], zeros);
      store4(&sm.q_tilde[t][ch0], zeros);
      store4(&sm.alpha[t][ch0], ones);
      store4(&sm.v[t][ch0], zeros);
      if (lane == 0) sm.beta[t] = 0.f;
    }
  }
}

// Row t's key j = t − d decayed to token t, k̂_j·P(j→t), for the lane's channels; p carries P(j→t) from step d − 1
// (P(t−1→t) = α_t, P(j→t) = P(j+1→t)·α_{j+1}). A step past the row's first token (d > t) reads token 0: unused.
__device__ __forceinline__ void decayed_key(const StepSmem& sm, int t, int d, int ch0, float (&p)[4], float (&kd)[4]) {
  const int j = t - d >= 0 ? t - d : 0;
  load4(&sm.k_hat[j][ch0], kd);
  if (d == 0) return;
  float a[4];
  load4(&sm.alpha[j + 1][ch0], a);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    p[c] = d == 1 ? a[c] : __fmul_rn(p[c], a[c]);
    kd[c] = __fmul_rn(kd[c], p[c]);
  }
}

// Slot s of warp w's pair sums (pair_sums) into A (fp32) or B (bf16 hi + lo).
__device__ __forceinline__ void store_pair_sum(StepSmem& sm, int s, float sum, int t1, int t2) {
  const bool row2 = (s & 1) == 0 ? s <= 2 * t2 : s <= 2 * t2 - 1;
  const int t = row2 ? t2 : t1;
  const int d = row2 ? ((s & 1) == 0 ? s / 2 : (s + 1) / 2) : ((s & 1) == 0 ? (32 - s) / 2 : (31 - s) / 2);
  const bool is_b = ((s & 1) == 0) == row2;  // row t2: B in even slots; row t1: B in odd slots
  if (is_b) {
    split_bf16(sum, sm.b_hi[t][t - d], sm.b_lo[t][t - d]);
  } else {
    sm.a_cols[t - d][t] = sum;
  }
}

// Step 2's pair sums for warp w: rows t2 = 15 − w (31 − 2w sums) and t1 = w (2w + 1 sums), 32 in all, for the rows
// before `len` (the others feed nothing). At decay step d (j = t − d), row t2 puts B_{t2,j} in slot 2d and A_{t2,j}
// in slot 2d − 1 (slots 0 .. 30 − 2w); row t1 puts B_{t1,j} in slot 31 − 2d and A_{t1,j} in slot 32 − 2d (slots
// 31 − 2w .. 31). Two reduce-scatters of 16 slots (the state's registers stay live): slots 0..15 are row t2's steps
// 0..8, slots 16..31 its steps 8..15 and row t1.
__device__ __forceinline__ void pair_sums(StepSmem& sm, int warp, int lane, int len) {
  const int ch0 = prep::kChannelsPerLane * lane;
  const int t1 = warp, t2 = kChunk - 1 - warp;
  if (t1 >= len) return;  // (t1 < t2)
  float v[16];
  float k2[4], q2[4], p2[4], kd[4];
  float b_mid = 0.f;  // B_{t2,t2−8}: slot 16
  const bool row2 = t2 < len;
  if (row2) {
    load4(&sm.k_hat[t2][ch0], k2);
    load4(&sm.q_tilde[t2][ch0], q2);
#pragma unroll
    for (int d = 0; d <= 8; ++d) {  // (t2 >= 8)
      decayed_key(sm, t2, d, ch0, p2, kd);
      if (d < 8) v[2 * d] = prep::dot_leaf_4(kd, q2);
      else b_mid = prep::dot_leaf_4(kd, q2);
      if (d > 0) v[2 * d - 1] = prep::dot_leaf_4(kd, k2);
    }
    const float sum = reduce_scatter_16(v, lane);
    if ((lane & 1) == 0) store_pair_sum(sm, lane / 2, sum, t1, t2);
  }

#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = 0.f;
  v[0] = b_mid;
  if (row2) {
#pragma unroll
    for (int d = 9; d < kChunk; ++d) {
      decayed_key(sm, t2, d, ch0, p2, kd);
      if (d <= t2) {
        v[2 * d - 16] = prep::dot_leaf_4(kd, q2);
        v[2 * d - 17] = prep::dot_leaf_4(kd, k2);
      }
    }
  }
  float k1[4], q1[4], p1[4];
  load4(&sm.k_hat[t1][ch0], k1);
  load4(&sm.q_tilde[t1][ch0], q1);
#pragma unroll
  for (int d = 0; d < kChunk / 2; ++d) {  // (t1 <= 7)
    decayed_key(sm, t1, d, ch0, p1, kd);
    if (d <= t1) {
      v[15 - 2 * d] = prep::dot_leaf_4(kd, q1);
      if (d > 0) v[16 - 2 * d] = prep::dot_leaf_4(kd, k1);
    }
  }
  const float sum = reduce_scatter_16(v, lane);
  if ((lane & 1) == 0) {
    const int s = 16 + lane / 2;
    if (row2 || s >= 31 - 2 * warp) store_pair_sum(sm, s, sum, t1, t2);  // (row t2's slots only if it counts)
  }
}

// Step 2's operands, one thread per channel and chain, for the chunk's `len` tokens: D_t and X (threads 0..127),
// P(j→len−1) and E (128..255; E is zero past the tokens). Past the tokens α = 1, so D_{len−1} and P(j→len−1) are
// bit for bit the chunk-of-16 values D_15 and P(j→15).
__device__ __forceinline__ void chunk_operands(StepSmem& sm, int tid, int len) {
  const int c = tid & (kHeadDim - 1);
  if (tid < kHeadDim) {
    float decay = 1.f;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t >= len) break;
      decay = t == 0 ? sm.alpha[0][c] : __fmul_rn(decay, sm.alpha[t][c]);
      split_bf16(__fmul_rn(sm.k_hat[t][c], decay), sm.x_hi[t][c], sm.x_lo[t][c]);
      split_bf16(__fmul_rn(sm.q_tilde[t][c], decay), sm.x_hi[kChunk + t][c], sm.x_lo[kChunk + t][c]);
    }
    sm.decay_end[c] = decay;
  } else {
    float to_end = 1.f;
#pragma unroll
    for (int j = kChunk - 1; j >= 0; --j) {
      if (j >= len) {
        sm.e_hi[c][j] = sm.e_lo[c][j] = __float2bfloat16_rn(0.f);
      } else if (j == len - 1) {
        split_bf16(sm.k_hat[j][c], sm.e_hi[c][j], sm.e_lo[c][j]);
      } else {
        to_end = j == len - 2 ? sm.alpha[j + 1][c] : __fmul_rn(to_end, sm.alpha[j + 1][c]);
        split_bf16(__fmul_rn(sm.k_hat[j][c], to_end), sm.e_hi[c][j], sm.e_lo[c][j]);
      }
    }
  }
}

// T = (I + diag(β)·A)⁻¹·diag(β), lower triangular (one warp; lane j < 16 owns column j): T_tt = β_t and, for j < t,
// T_tj = (−β_t)·Σ_{i<t} A_ti T_ij, the sum as FMAs in i order. Rows past the chunk's tokens are zero. Column by
// column: once T_ij is known it enters every later row's sum (each row's FMAs stay in i order), so the dependent
// chain is one FMA and one product per row; the other rows' FMAs fill it, and the next column's 16-byte loads are
// in flight meanwhile (β read four at a time: few registers beside the state's).
__device__ __forceinline__ void substitution_matrix(StepSmem& sm, int lane, int len) {
  const int j = lane & (kChunk - 1);
  float acc[kChunk], beta[4], a_col[kChunk], a_next[kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) acc[t] = 0.f;
#pragma unroll
  for (int q = 0; q < kChunk / 4; ++q) load4(&sm.a_cols[0][4 * q], *reinterpret_cast<float(*)[4]>(&a_col[4 * q]));
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    if (i % 4 == 0) load4(&sm.beta[i], beta);
#pragma unroll
    for (int q = (i + 2) / 4; q < kChunk / 4; ++q) {  // column i + 1, in flight during this column's FMAs
      if (i + 1 < kChunk) load4(&sm.a_cols[i + 1][4 * q], *reinterpret_cast<float(*)[4]>(&a_next[4 * q]));
    }
    const float value = i == j ? beta[i % 4] : (i > j ? __fmul_rn(-beta[i % 4], acc[i]) : 0.f);
    const float t_ij = i < len ? value : 0.f;
#pragma unroll
    for (int t = i + 1; t < kChunk; ++t) acc[t] = __fmaf_rn(a_col[t], t_ij, acc[t]);
    if (lane < kChunk) split_bf16(t_ij, sm.t_hi[i][j], sm.t_lo[i][j]);
#pragma unroll
    for (int t = i + 2; t < kChunk; ++t) a_col[t] = a_next[t];
  }
}

__device__ __forceinline__ uint32_t smem_u32(const __nv_bfloat16* at) { return *reinterpret_cast<const uint32_t*>(at); }

// The A fragments (hi, lo) of the 16 x 16 tile whose fp32 accumulators are `lo_tile` (columns 0..7) and `hi_tile`.
__device__ __forceinline__ void split_a_frags(uint32_t (&hi)[4], uint32_t (&lo)[4], const float (&lo_tile)[4],
                                              const float (&hi_tile)[4]) {
  acc_to_a_frag(hi, lo_tile, hi_tile);
  lo[0] = pack_lo_bf16x2(lo_tile[0], lo_tile[1], hi[0]);
  lo[1] = pack_lo_bf16x2(lo_tile[2], lo_tile[3], hi[1]);
  lo[2] = pack_lo_bf16x2(hi_tile[0], hi_tile[1], hi[2]);
  lo[3] = pack_lo_bf16x2(hi_tile[2], hi_tile[3], hi[3]);
}

// D += A·B for a split product, as three m16n8k16 products: A_lo·B_hi, A_hi·B_lo, A_hi·B_hi. The B fragments are
// column n = g of a [n][k] bf16 array (k contiguous, row pitch `pitch`), k from k0.
__device__ __forceinline__ void split_mma(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          const __nv_bfloat16* b_hi_row, const __nv_bfloat16* b_lo_row) {
  const uint32_t b_hi[2] = {smem_u32(b_hi_row), smem_u32(b_hi_row + 8)};
  const uint32_t b_lo[2] = {smem_u32(b_lo_row), smem_u32(b_lo_row + 8)};
  mma_bf16_16816(d, a_lo, b_hi);
  mma_bf16_16816(d, a_hi, b_lo);
  mma_bf16_16816(d, a_hi, b_hi);
}

// A bf16 state travels by 1-D bulk copies, a row each (the states are 16-byte aligned: validation.py), through the
// staging rows after StepSmem. Each warp copies in its own 16 rows at the start, on its own mbarrier, and they land
// while the tokens are prepared (the state's registers are not needed until W); at the end each warp copies its
// final rows out. (Bulk copies take uniform operands: one warp issuing all 128 rows ran them one lane at a time, about
// 1,100 instructions on the warp that then computes T.) An fp32 state is read and written by the threads directly.
template <typename T>
constexpr bool kStagedState = std::is_same<T, __nv_bfloat16>::value;

constexpr int kStageOffset = (static_cast<int>(sizeof(StepSmem)) + 127) / 128 * 128;  // bulk copies: 16-byte aligned

template <typename InitT, typename FinalT>
constexpr int step_smem_bytes() {
  return kStageOffset + (kStagedState<InitT> || kStagedState<FinalT> ? kStageBytes : 0);
}

// kCheckpoints: the call asks for checkpoints (a separate instantiation: calls without them keep their registers).
template <typename InitT, typename FinalT, GateKind kGate, bool kCheckpoints>
__global__ void __launch_bounds__(kStepThreads, 2) kda_decode_chunk_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  StepSmem& sm = *reinterpret_cast<StepSmem*>(smem_raw);
  unsigned char* stage = smem_raw + kStageOffset;  // kStageBytes, when a state is bf16
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q4 = lane & 3;

  const int64_t n = blockIdx.x / p.heads;
  const int h = static_cast<int>(blockIdx.x % p.heads), hk = key_head_of(p, h);
  // The first chunk's token loads and the head's gate parameters go out first; the state's copies and the input
  // checks are issued while they are in flight.
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  auto chunk_len = [&](int64_t c0) {
    return bounds.eos - c0 < kChunk ? static_cast<int>(bounds.eos - c0) : kChunk;
  };
  TokenPairRaw first_tokens;
  if (bounds.bos < bounds.eos) {
    first_tokens = load_token_pair(p, bounds.bos, chunk_len(bounds.bos), 2 * warp, h, hk, lane);
  }
  const HeadGate hg = head_gate(p, h, prep::kChannelsPerLane * lane);
  const int64_t slot = state_slot(p, n);
  const int row0 = kWarpRows * warp;  // the warp's first state row
  const bool staged_init = kStagedState<InitT> && p.initial_state != nullptr && slot >= 0;
  if (staged_init) {  // (uniform over the CTA) each warp copies in its own 16 rows on its own mbarrier
    uint64_t* loaded = &sm.state_loaded[warp];
    if (lane == 0) {
      mbarrier_init(loaded, 1);
      mbarrier_init_fence();
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive_expect_tx(loaded, kWarpRows * kStageRowBytes);
    __syncwarp();
    if (lane < kWarpRows) {
      const InitT* src = static_cast<const InitT*>(p.initial_state) + state_offset(p, slot, h) +
                         static_cast<size_t>(row0 + lane) * kHeadDim;
      bulk_copy_g2s(stage + (row0 + lane) * kStagePitchBytes, src, kStageRowBytes, loaded);
    }
  }

  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kStepThreads + tid; i <= last_check_item<kCheckpoints>(p);
       i += static_cast<int64_t>(gridDim.x) * kStepThreads) {
    check_call_inputs<kCheckpoints>(p, i);
  }

  float s[kColTiles][4];  // rows g and g + 8 of the warp's tile, columns 8i + 2·q4 + {0, 1}: accumulator fragments
  auto store_state = [&](int64_t to) {
    FinalT* dst = static_cast<FinalT*>(p.final_state) + state_offset(p, to, h) +
                  static_cast<size_t>(row0 + g) * kHeadDim + 2 * q4;
#pragma unroll
    for (int i = 0; i < kColTiles; ++i) {
      store_pair(dst + 8 * i, s[i][0], s[i][1]);
      store_pair(dst + 8 * kHeadDim + 8 * i, s[i][2], s[i][3]);
    }
  };
  auto zero_state = [&]() {
#pragma unroll
    for (int i = 0; i < kColTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  };
  // A staged (bf16) initial state: this warp's rows into the fragments once they have landed, or zeros.
  auto take_staged_init = [&]() {
    if (!staged_init) return zero_state();
    mbarrier_wait_parity_warp(&sm.state_loaded[warp], 0);
    const unsigned char* row = stage + (row0 + g) * kStagePitchBytes + 4 * q4;
#pragma unroll
    for (int i = 0; i < kColTiles; ++i) {
      load_pair(reinterpret_cast<const __nv_bfloat16*>(row + 16 * i), s[i][0], s[i][1]);
      load_pair(reinterpret_cast<const __nv_bfloat16*>(row + 8 * kStagePitchBytes + 16 * i), s[i][2], s[i][3]);
    }
  };

  // An fp32 initial state, read directly, or zeros.
  if constexpr (!kStagedState<InitT>) {
    if (p.initial_state != nullptr && slot >= 0) {
      const InitT* src = static_cast<const InitT*>(p.initial_state) + state_offset(p, slot, h) +
                         static_cast<size_t>(row0 + g) * kHeadDim + 2 * q4;
#pragma unroll
      for (int i = 0; i < kColTiles; ++i) {
        load_pair(src + 8 * i, s[i][0], s[i][1]);
        load_pair(src + 8 * kHeadDim + 8 * i, s[i][2], s[i][3]);
      }
    } else {
      zero_state();
    }
  }
  // T and B are zero above the diagonal: written once here, never by a chunk.
  for (int i = tid; i < kChunk * kChunk; i += kStepThreads) {
    const int t = i / kChunk, j = i % kChunk;
    if (j > t) sm.t_hi[t][j] = sm.t_lo[t][j] = sm.b_hi[t][j] = sm.b_lo[t][j] = __float2bfloat16_rn(0.f);
  }

  // The first chunk's preparation stands outside the loop: there no state is live (a bf16 state is taken after the
  // first barrier), so the tokens loaded above stay in registers instead of being spilled.
  if (bounds.bos < bounds.eos) {
    prepare_token_pair<kGate>(p, hg, sm, first_tokens, chunk_len(bounds.bos), 2 * warp, lane);
  }
  for (int64_t c0 = bounds.bos; c0 < bounds.eos; c0 += kChunk) {
    const int len = chunk_len(c0);  // the chunk's tokens
    if (c0 != bounds.bos) {
      prepare_token_pair<kGate>(p, hg, sm, load_token_pair(p, c0, len, 2 * warp, h, hk, lane), len, 2 * warp, lane);
    }
    __syncthreads();
    if constexpr (kStagedState<InitT>) {
      if (c0 == bounds.bos) take_staged_init();  // (landed during the preparation, whose registers it spared)
    }
    pair_sums(sm, warp, lane, len);
    chunk_operands(sm, tid, len);
    __syncthreads();
    if (warp == 0) substitution_matrix(sm, lane, len);

    // v of the lane's tokens (fragment element e of tile i: token 8i + 2·q4 + (e & 1), row g + 8·(e >> 1)).
    float v_in[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) v_in[i][e] = sm.v[8 * i + 2 * q4 + (e & 1)][row0 + g + 8 * (e >> 1)];
    }

    // W = S·Xᵀ: tiles 0, 1 are W_k (tokens 0..7, 8..15), 2, 3 W_q (tiles of tokens past the chunk skipped).
    const bool second_half = len > kChunk / 2;
    float w[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a_hi[4], a_lo[4];
      split_a_frags(a_hi, a_lo, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
      for (int tile = 0; tile < 4; ++tile) {
        if ((tile & 1) && !second_half) continue;
        const int col = 16 * ks + 2 * q4;
        split_mma(w[tile], a_hi, a_lo, &sm.x_hi[8 * tile + g][col], &sm.x_lo[8 * tile + g][col]);
      }
    }

    // R = V − W_k (zero past the tokens), U = R·Tᵀ, O = W_q + U·Bᵀ.
    float r[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) r[i][e] = 8 * i + 2 * q4 + (e & 1) < len ? __fsub_rn(v_in[i][e], w[i][e]) : 0.f;
    }
    __syncthreads();  // T is in shared memory
    uint32_t a_hi[4], a_lo[4];
    split_a_frags(a_hi, a_lo, r[0], r[1]);
    float u[2][4] = {};
#pragma unroll
    for (int i = 0; i < 2; ++i) split_mma(u[i], a_hi, a_lo, &sm.t_hi[8 * i + g][2 * q4], &sm.t_lo[8 * i + g][2 * q4]);
    split_a_frags(a_hi, a_lo, u[0], u[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      split_mma(w[2 + i], a_hi, a_lo, &sm.b_hi[8 * i + g][2 * q4], &sm.b_lo[8 * i + g][2 * q4]);
    }
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * i + 2 * q4 + (e & 1);
        if (t < len) {
          out[((c0 + t) * p.heads + h) * kHeadDim + row0 + g + 8 * (e >> 1)] = __float2bfloat16_rn(w[2 + i][e]);
        }
      }
    }

    // S ← S ⊙ D_{len−1} + U·Eᵀ.
#pragma unroll
    for (int i = 0; i < kColTiles; ++i) {
      const int col = 8 * i + 2 * q4;
      const float d0 = sm.decay_end[col], d1 = sm.decay_end[col + 1];
      s[i][0] = __fmul_rn(s[i][0], d0), s[i][1] = __fmul_rn(s[i][1], d1);
      s[i][2] = __fmul_rn(s[i][2], d0), s[i][3] = __fmul_rn(s[i][3], d1);
      split_mma(s[i], a_hi, a_lo, &sm.e_hi[8 * i + g][2 * q4], &sm.e_lo[8 * i + g][2 * q4]);
    }
    // Checkpoints: the state after every C = 16·checkpoint_chunks tokens into its slot (state_slots.cuh; none in
    // the sequence's own final slot, which a bf16 state's bulk copies write in no order with these stores).
    if (kCheckpoints && len == kChunk && p.final_state != nullptr) {
      const int64_t cs = checkpoint_slot(p, n, (c0 - bounds.bos) / kChunk + 1, slot);
      if (cs >= 0) store_state(cs);
    }
    // (The next chunk writes its tokens before its first barrier, and the operands read here only after it.)
  }
  if constexpr (kStagedState<InitT>) {
    if (bounds.bos >= bounds.eos) take_staged_init();  // (a sequence without tokens)
  }
  if (p.final_state == nullptr || slot < 0) return;
  if constexpr (!kStagedState<FinalT>) return store_state(slot);
  // The warp's rows into its staging rows (which only this warp read), then a bulk copy per row.
  unsigned char* row = stage + (row0 + g) * kStagePitchBytes + 4 * q4;
#pragma unroll
  for (int i = 0; i < kColTiles; ++i) {
    store_pair(reinterpret_cast<__nv_bfloat16*>(row + 16 * i), s[i][0], s[i][1]);
    store_pair(reinterpret_cast<__nv_bfloat16*>(row + 8 * kStagePitchBytes + 16 * i), s[i][2], s[i][3]);
  }
  fence_proxy_async_shared();
  __syncwarp();
  if (lane < kWarpRows) {
    FinalT* dst = static_cast<FinalT*>(p.final_state) + state_offset(p, slot, h) + (row0 + lane) * kHeadDim;
    bulk_copy_s2g(dst, stage + (row0 + lane) * kStagePitchBytes, kStageRowBytes);
    bulk_commit();
    bulk_wait_read_all();
  }
}

template <typename InitT, typename FinalT, bool kCheckpoints>
void launch_gated(const FwdParams& p, cudaStream_t stream) {
  with_gate(p.gate, [&](auto gate) {
    constexpr auto kernel = kda_decode_chunk_kernel<InitT, FinalT, decltype(gate)::value, kCheckpoints>;
    constexpr int kSmem = step_smem_bytes<InitT, FinalT>();
    opt_in_dynamic_smem<kernel>(kSmem);
    kernel<<<static_cast<unsigned>(p.num_seqs * p.heads), kStepThreads, kSmem, stream>>>(p);
    KDA_CHECK_LAUNCH("kda_decode_chunk_kernel");
  });
}

template <typename InitT, typename FinalT>
void launch_typed(const FwdParams& p, cudaStream_t stream) {
  if (p.checkpoint_chunks > 0) return launch_gated<InitT, FinalT, true>(p, stream);
  launch_gated<InitT, FinalT, false>(p, stream);
}

}  // namespace

void launch_decode_chunk(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  // A missing state takes the bf16 instantiation: its pointer is null, so the kernel never reads or writes it.
  with_state_types(p, [&](auto init, auto fin) {
    launch_typed<typename decltype(init)::type, typename decltype(fin)::type>(p, stream);
  });
}

}  // namespace kda
