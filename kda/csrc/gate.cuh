// The gate and β of one token, as the preparation (prepare_chunk.cuh) and the decode kernel (decode.cu) compute
// them: the same instructions in both, re-enacted by the numerics twin (flash_kda/numerics.py, _gate_log2).
// Decays are base-2 logs γ = log2 α per channel (kda_params.h, GateKind).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"

namespace kda {

// The softplus gate's floor on a token's γ. 2^−128 and every product that crosses such a token are below fp32's
// normal range and flush to zero (ex2.approx.ftz), exactly as the unclamped value would; the floor only keeps a
// chunk's running sum finite (16 tokens of −1e30 would be −inf, and −inf − −inf a NaN) and small enough that
// differences of running sums keep their precision.
constexpr float kMinLog2Decay = -128.0f;

// One head's gate constants for the channels ch0 .. ch0 + 3: e^A_log (1 without A_log), dt_bias (0 without it)
// and, for the lower-bound gate, lower_bound · log2 e.
//
// e^A_log is held within fp32's normal range, [2^−126, the largest finite float] (a NaN stays NaN): an A_log past
// about ±88 would otherwise make it ∞ or 0, and ∞ · 0 (a gate input g + dt_bias of 0, or a softplus that
// underflows to 0) or 0 · ∞ (an input that overflows fp32) a NaN. Inside that range the clamp changes nothing.
constexpr float kMinExpA = 1.17549435e-38f;  // 2^−126
constexpr float kMaxExpA = 3.40282347e38f;   // the largest finite float
struct HeadGate {
  float exp_a;
  float scale;
  float bias[4];
};
// Loaded in two halves, so that a kernel can issue the parameters' loads early and use them late (decode.cu): the
// elements as loaded (bits, not yet widened: no instruction reads a loaded register until head_gate_from, so the
// warp does not wait for them), then the constants.
struct HeadGateBits {
  uint32_t a_log;    // A_log[h]: fp32 bits, or a 16-bit element in the low half
  uint32_t bias[4];  // dt_bias[h, ch0 .. ch0 + 3]: fp32 bits, or two 16-bit elements per word in bias[0..1]
};
__device__ __forceinline__ HeadGateBits load_head_gate_bits(const FwdParams& p, int h, int ch0) {
  HeadGateBits bits{};
  if (p.A_log != nullptr) {
    bits.a_log = p.A_log_type == ParamType::kFloat32 ? static_cast<const uint32_t*>(p.A_log)[h]
                                                     : static_cast<const uint16_t*>(p.A_log)[h];
  }
  if (p.dt_bias != nullptr) {
    const int64_t i = static_cast<int64_t>(h) * kHeadDim + ch0;
    if (p.dt_bias_type == ParamType::kFloat32) {
      const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const float*>(p.dt_bias) + i);
      bits.bias[0] = w.x, bits.bias[1] = w.y, bits.bias[2] = w.z, bits.bias[3] = w.w;
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p.dt_bias) + i);
      bits.bias[0] = w.x, bits.bias[1] = w.y;
    }
  }
  return bits;
}
// A parameter element widened to fp32 exactly: fp32 bits, or a 16-bit element in the low half of `bits`.
__device__ __forceinline__ float param_from_bits(ParamType type, uint32_t bits) {
  switch (type) {
    case ParamType::kBFloat16: return __uint_as_float(bits << 16);
    case ParamType::kFloat16: return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xffffu)));
    default: return __uint_as_float(bits);
  }
}
__device__ __forceinline__ HeadGate head_gate_from(const FwdParams& p, const HeadGateBits& bits) {
  HeadGate hg;
  hg.exp_a = 1.f;
  if (p.A_log != nullptr) {
    const float e = ex2_approx(__fmul_rn(param_from_bits(p.A_log_type, bits.a_log), kLog2e));
    hg.exp_a = e > kMaxExpA ? kMaxExpA : (e < kMinExpA ? kMinExpA : e);  // (comparisons with NaN are false)
  }
  hg.scale = __fmul_rn(p.lower_bound, kLog2e);
  if (p.dt_bias == nullptr) {
    hg.bias[0] = hg.bias[1] = hg.bias[2] = hg.bias[3] = 0.f;
  } else if (p.dt_bias_type == ParamType::kFloat32) {
#pragma unroll
    for (int c = 0; c < 4; ++c) hg.bias[c] = __uint_as_float(bits.bias[c]);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) hg.bias[c] = param_from_bits(p.dt_bias_type, bits.bias[c / 2] >> (16 * (c % 2)));
  }
  return hg;
}

// Both halves at once, for kernels that use the constants right away (prepare_chunk.cuh, decode_chunk.cu).
__device__ __forceinline__ HeadGate head_gate(const FwdParams& p, int h, int ch0) {
  return head_gate_from(p, load_head_gate_bits(p, h, ch0));
}

// log2(1 + e^x) = max(x, 0)·log2 e + log2(1 + 2^(−|x|·log2 e)): neither term overflows. Two MUFU instructions
// (ex2.approx, lg2.approx: absolute errors near 2^−22, as small as the fp32 rounding of γ's running sum), where
// expf and log1pf cost ten times the instructions: the preparation, which computes 2,048 of these per chunk, is
// bound by its instruction issue.
__device__ __forceinline__ float softplus_log2(float x) {
  const float tail = lg2_approx(__fadd_rn(1.f, ex2_approx(-__fmul_rn(fabsf(x), kLog2e))));
  return __fadd_rn(__fmul_rn(fmaxf(x, 0.f), kLog2e), tail);
}

// γ of channel c of a token whose gate input is g: lower bound: sigmoid((g + dt_bias)·e^A_log)·lower_bound·log2 e;
// softplus: max(−(e^A_log · softplus_log2(g + dt_bias)), kMinLog2Decay) (a NaN stays NaN). The kernels are
// instantiated per gate, so the lower-bound gate's code is what it was before the softplus gate existed.
template <GateKind kGate>
__device__ __forceinline__ float gate_log2(const HeadGate& hg, int c, float g) {
  if constexpr (kGate == GateKind::kSoftplus) {
    const float gamma = -__fmul_rn(hg.exp_a, softplus_log2(__fadd_rn(g, hg.bias[c])));
    return gamma < kMinLog2Decay ? kMinLog2Decay : gamma;
  } else {
      return __fmul_rn(sigmoid_approx(__fmul_rn(__fadd_rn(g, hg.bias[c]), hg.exp_a)), hg.scale);
  }
}

// Calls launch(std::integral_constant<GateKind, kind>{}) for the call's gate.
template <typename Launch>
void with_gate(GateKind kind, Launch launch) {
  if (kind == GateKind::kSoftplus) return launch(std::integral_constant<GateKind, GateKind::kSoftplus>{});
  return launch(std::integral_constant<GateKind, GateKind::kLowerBound>{});
}

// β of a token from its logit: beta_scale · sigmoid(logit) (beta_scale 1 or 2: both products are exact).
__device__ __forceinline__ float beta_of(const FwdParams& p, float logit) {
  return __fmul_rn(sigmoid_approx(logit), p.beta_scale);
}

// The key head (q and k) that value head h reads: h / G with G = heads / key_heads value heads per key head.
__device__ __forceinline__ int key_head_of(const FwdParams& p, int h) { return h / (p.heads / p.key_heads); }

}  // namespace kda
