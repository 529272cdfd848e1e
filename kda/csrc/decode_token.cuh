// One token's preparation as a warp of the decode kernels computes it (decode.cu, decode_chunk.cu,
// decode_warp_specialised.cu): lane l loads channels 4l..4l+3 of q, k and g and computes k̂ = k / ‖k‖,
// q̃ = (q / ‖q‖)·scale and α = 2^γ for them, with the chunked plans' instructions (prepare_chunk.cuh, gate.cuh),
// which the numerics twin re-enacts (_prepare_tokens).
#pragma once

#include <cuda_bf16.h>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"

namespace kda {

// Two whole-warp sums of one leaf per lane each (the halving tree, as an xor butterfly: every lane gets both),
// level by level together, so that the two shuffle chains overlap instead of following each other.
__device__ __forceinline__ void warp_sum_2(float& x, float& y) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) {
    const float x_other = __shfl_xor_sync(0xffffffffu, x, offset), y_other = __shfl_xor_sync(0xffffffffu, y, offset);
    x = __fadd_rn(x, x_other);
    y = __fadd_rn(y, y_other);
  }
}

// Two levels of the halving tree over a lane's partial sums of 4 rows, as a reduce-scatter between the lanes that
// differ in lane bits kHigh and kLow (xor kHigh, then xor kLow): the lane ends with the sum of row
// 2·[lane & kHigh] + [lane & kLow]. kda_decode_kernel ends its row sums with it.
template <int kHigh, int kLow>
__device__ __forceinline__ float reduce_scatter_4_rows(const float (&x)[4], int lane) {
  const bool upper_high = (lane & kHigh) != 0, upper_low = (lane & kLow) != 0;
  float y[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float keep = upper_high ? x[i + 2] : x[i], send = upper_high ? x[i] : x[i + 2];
    y[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, kHigh));
  }
  const float keep = upper_low ? y[1] : y[0], send = upper_low ? y[0] : y[1];
  return __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, kLow));
}

// The same reduce-scatter for a lane whose slot i holds row own ^ i, own being the row it ends with (the
// warp-specialised kernel's layout): every lane keeps slots 0, 1 and sends 2, 3, then keeps 0 and sends 1, so no lane
// selects. Each sum is reduce_scatter_4_rows' (the same operands in the same order), so the bits are its bits.
template <int kHigh, int kLow>
__device__ __forceinline__ float reduce_scatter_4_own_first(const float (&x)[4]) {
  float y[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) y[i] = __fadd_rn(x[i], __shfl_xor_sync(0xffffffffu, x[i + 2], kHigh));
  return __fadd_rn(y[0], __shfl_xor_sync(0xffffffffu, y[1], kLow));
}

// Four consecutive values (channels or state columns 4l..4l+3) widened to fp32 / stored from fp32.
__device__ __forceinline__ void load4(const float* src, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* src, float (&x)[4]) {
  prep::unpack4(*reinterpret_cast<const uint2*>(src), x);
}
__device__ __forceinline__ void store4(float* dst, const float (&x)[4]) {
  *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* dst, const float (&x)[4]) {
  uint2 raw;
  raw.x = pack_bf16x2(x[0], x[1]);
  raw.y = pack_bf16x2(x[2], x[3]);
  *reinterpret_cast<uint2*>(dst) = raw;
}

// The token step's two sweeps over a lane's state registers s[r][k] (rows r, register slot k holding the 4 columns
// col(k) .. col(k) + 3), as both token-by-token kernels run them (decode.cu, decode_warp_specialised.cu); they differ
// only in how many rows and leaves a lane holds and in col. A sweep changes each element with `change` (row r, the
// element, the operand x at its column), then forms the row's leaves against y.
template <int kRows, int kLeaves, typename ColumnOf, typename Change>
__device__ __forceinline__ void sweep(float (&s)[kRows][kLeaves][4], float (&leaves)[kRows][kLeaves], const float* x,
                                      const float* y, const ColumnOf& col, const Change& change) {
#pragma unroll
  for (int k = 0; k < kLeaves; ++k) {
    float xk[4], yk[4];
    load4(x + col(k), xk);
    load4(y + col(k), yk);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][k][c] = change(r, s[r][k][c], xk[c]);
      leaves[r][k] = lane_leaf4(s[r][k], yk);
    }
  }
}

// First: decay S ← S·diag(α), then the leaves of S·k̂.
template <int kRows, int kLeaves, typename ColumnOf>
__device__ __forceinline__ void decay_and_key_leaves(float (&s)[kRows][kLeaves][4], float (&leaves)[kRows][kLeaves],
                                                     const float* alpha, const float* k_hat, const ColumnOf& col) {
  sweep(s, leaves, alpha, k_hat, col, [](int, float e, float a) { return __fmul_rn(e, a); });
}

// Second: the update S += u·k̂ᵀ (u[r] for row r), then the leaves of the output S·q̃.
template <int kRows, int kLeaves, typename ColumnOf>
__device__ __forceinline__ void update_and_query_leaves(float (&s)[kRows][kLeaves][4], float (&leaves)[kRows][kLeaves],
                                                        const float (&u)[kRows], const float* k_hat,
                                                        const float* q_tilde, const ColumnOf& col) {
  sweep(s, leaves, k_hat, q_tilde, col, [&u](int r, float e, float kh) { return __fmaf_rn(u[r], kh, e); });
}

// One token's key-side inputs as lane l of a decode kernel reads them: channels 4l..4l+3 of q, k and g.
struct RawKeys {
  uint2 q, k, g;
};

__device__ __forceinline__ RawKeys load_keys(const FwdParams& p, int64_t t, int h, int hk, int ch0) {
  const int64_t base = (t * p.heads + h) * kHeadDim, key_base = (t * p.key_heads + hk) * kHeadDim;
  RawKeys r;
  r.q = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.q) + key_base + ch0);
  r.k = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.k) + key_base + ch0);
  r.g = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.g) + base + ch0);
  return r;
}

// The keys, β's logit and v of the row whose sums the lane ends with (decode.cu, decode_chunk.cu).
struct RawToken : RawKeys {
  __nv_bfloat16 beta, v;
};

__device__ __forceinline__ RawToken load_token(const FwdParams& p, int64_t t, int h, int hk, int ch0, int v_row) {
  RawToken r;
  static_cast<RawKeys&>(r) = load_keys(p, t, h, hk, ch0);
  r.beta = static_cast<const __nv_bfloat16*>(p.beta)[t * p.heads + h];
  r.v = static_cast<const __nv_bfloat16*>(p.v)[(t * p.heads + h) * kHeadDim + v_row];
  return r;
}

// The keys, the lane's 4 channels of v and β's logit, as a preparing warp reads them (decode_warp_specialised.cu).
struct RawTokenChannels : RawKeys {
  uint2 v;
  __nv_bfloat16 beta;
};

__device__ __forceinline__ RawTokenChannels load_token_channels(const FwdParams& p, int64_t t, int h, int hk,
                                                                int ch0) {
  RawTokenChannels r;
  static_cast<RawKeys&>(r) = load_keys(p, t, h, hk, ch0);
  r.v = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.v) + (t * p.heads + h) * kHeadDim + ch0);
  r.beta = static_cast<const __nv_bfloat16*>(p.beta)[t * p.heads + h];
  return r;
}

// The part of a token's preparation every decode kernel shares, as lane l computes it: k̂ = k / ‖k‖,
// q̃ = (q / ‖q‖)·scale and α = 2^γ for channels 4l..4l+3 (the chunked plans' instructions, gate.cuh), and β.
struct LaneKeys {
  float alpha[4], k_hat[4], q_tilde[4];
  float beta;
};
template <GateKind kGate>
__device__ __forceinline__ LaneKeys prepare_keys(const FwdParams& p, const HeadGate& hg, const RawKeys& raw,
                                                 __nv_bfloat16 beta_logit) {
  LaneKeys lk;
  float gf[4];
  prep::unpack4(raw.k, lk.k_hat);
  prep::unpack4(raw.q, lk.q_tilde);
  prep::unpack4(raw.g, gf);
  float sum_k = prep::sum_squares_4(lk.k_hat), sum_q = prep::sum_squares_4(lk.q_tilde);
  warp_sum_2(sum_k, sum_q);
  const float inv_k = prep::inv_norm(sum_k), inv_q = prep::inv_norm(sum_q);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    lk.k_hat[c] = __fmul_rn(lk.k_hat[c], inv_k);
    lk.q_tilde[c] = __fmul_rn(__fmul_rn(lk.q_tilde[c], inv_q), p.scale);
    lk.alpha[c] = ex2_approx(gate_log2<kGate>(hg, c, gf[c]));
  }
  lk.beta = beta_of(p, bf16_to_float(beta_logit));
  return lk;
}

// A token as a lane of kda_decode_kernel prepares it: prepare_keys, and v of the row whose sums the lane ends with.
struct LanePrep : LaneKeys {
  float v;
};
template <GateKind kGate>
__device__ __forceinline__ LanePrep prepare_token(const FwdParams& p, const HeadGate& hg, const RawToken& raw) {
  LanePrep lp;
  static_cast<LaneKeys&>(lp) = prepare_keys<kGate>(p, hg, raw, raw.beta);
  lp.v = bf16_to_float(raw.v);
  return lp;
}

}  // namespace kda
