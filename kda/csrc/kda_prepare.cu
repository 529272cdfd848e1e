// KDA forward, stage 1 of 2: the token-parallel preparation kernel.
//
// One CTA per (chunk slot, head). It computes everything of a 16-token chunk that does not depend on the
// state S (SPEC §2): L2-normalised q/k, the per-channel log2 gates and their in-chunk cumulative sum G,
// Kd = k̂·2^G, Qd = scale·q̂·2^G, Kr = k̂·2^{Γ-G}, 2^Γ, β, the masked products A and Mqk, and
// INV = (I + β·strict_lower(Kd Kiᵀ))⁻¹ by forward substitution in fp32; then writes one workspace record.
// Rows past the end of a sequence are zero (q = k = v = 0, γ = 0, β = 0), which makes them inert.
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"

namespace kda {
namespace {

constexpr int kPrepThreads = 128;  // 4 warps: warp-per-row for norms/gates, thread-per-channel after.
constexpr int kPrepWarps = kPrepThreads / 32;
static_assert(kPrepThreads == kHeadDim, "phase 2 maps one thread to one channel");

// Sum of squares of 128 values, lane l holding elements 4l..4l+3, in the fixed order the twin re-enacts:
// ((x0²+x1²)+(x2²+x3²)) per lane, then a halving tree over lanes (xor 16, 8, 4, 2, 1).
__device__ __forceinline__ float sum_squares_128(const float (&x)[4]) {
  float s = __fadd_rn(__fadd_rn(__fmul_rn(x[0], x[0]), __fmul_rn(x[1], x[1])),
                      __fadd_rn(__fmul_rn(x[2], x[2]), __fmul_rn(x[3], x[3])));
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) {
    s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
  }
  return s;
}

__device__ __forceinline__ float inv_norm(float sum_sq) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(sum_sq, kNormEps)));
}

// Four consecutive bf16 values (8 bytes) to float; zeros when `valid` is false.
__device__ __forceinline__ void load4_bf16(const __nv_bfloat16* src, bool valid, float (&x)[4], uint2& raw) {
  raw = valid ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = bf16_to_float(h[i]);
}

// Finds the sequence whose slots contain `slot`: the largest n with first_slot(n) <= slot.
__device__ int64_t find_sequence(const FwdParams& p, int64_t slot) {
  int64_t lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, mid, p.seqlen, p.total_tokens);
    if (first_slot(b.bos, mid) <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kPrepThreads) kda_prepare_kernel(const FwdParams p) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y;
  const int H = p.heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int64_t n = find_sequence(p, slot);
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t chunk = slot - first_slot(bounds.bos, n);
  const int64_t len = bounds.eos - bounds.bos;
  if (chunk < 0 || chunk * kChunk >= len) return;  // an unused slot (uniform over the CTA)
  const int64_t t0 = bounds.bos + chunk * kChunk;
  const int64_t remaining = len - chunk * kChunk;
  const int rows = static_cast<int>(remaining < kChunk ? remaining : kChunk);

  __shared__ __align__(16) __nv_bfloat16 q_s[kChunk][kHeadDim];
  __shared__ __align__(16) __nv_bfloat16 k_s[kChunk][kHeadDim];
  __shared__ __align__(16) __nv_bfloat16 kd_s[kChunk][kHeadDim];
  __shared__ __align__(16) __nv_bfloat16 qd_s[kChunk][kHeadDim];
  __shared__ __align__(16) __nv_bfloat16 ki_s[kChunk][kHeadDim];
  __shared__ float gamma_s[kChunk][kHeadDim];
  __shared__ float inv_norm_q_s[kChunk], inv_norm_k_s[kChunk], beta_s[kChunk];
  __shared__ float a_s[kChunk][kChunk], m_s[kChunk][kChunk];

  const auto* q = static_cast<const __nv_bfloat16*>(p.q);
  const auto* k = static_cast<const __nv_bfloat16*>(p.k);
  const auto* g = static_cast<const __nv_bfloat16*>(p.g);
  const auto* beta = static_cast<const __nv_bfloat16*>(p.beta);

  // Phase 1, warp per row: norms, gates, beta.
  const float exp_a = ex2_approx(__fmul_rn(p.A_log[h], kLog2e));
  const float gate_scale = __fmul_rn(p.lower_bound, kLog2e);  // λ·log2(e) = lower_bound·log2(e)·sigmoid(.)
  const float* dt_bias = p.dt_bias + static_cast<int64_t>(h) * kHeadDim;
#pragma unroll
  for (int i = 0; i < kChunk / kPrepWarps; ++i) {
    const int r = warp + kPrepWarps * i;
    const bool valid = r < rows;
    const int64_t offset = ((t0 + r) * H + h) * kHeadDim + 4 * lane;
    float qf[4], kf[4], gf[4];
    uint2 q_raw, k_raw, g_raw;
    load4_bf16(q + offset, valid, qf, q_raw);
    load4_bf16(k + offset, valid, kf, k_raw);
    load4_bf16(g + offset, valid, gf, g_raw);
    *reinterpret_cast<uint2*>(&q_s[r][4 * lane]) = q_raw;
    *reinterpret_cast<uint2*>(&k_s[r][4 * lane]) = k_raw;
    const float inv_norm_q = inv_norm(sum_squares_128(qf));
    const float inv_norm_k = inv_norm(sum_squares_128(kf));
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float x = __fmul_rn(__fadd_rn(gf[c], dt_bias[4 * lane + c]), exp_a);
      gamma_s[r][4 * lane + c] = valid ? __fmul_rn(sigmoid_approx(x), gate_scale) : 0.f;
    }
    if (lane == 0) {
      inv_norm_q_s[r] = inv_norm_q;
      inv_norm_k_s[r] = inv_norm_k;
      beta_s[r] = valid ? sigmoid_approx(bf16_to_float(beta[(t0 + r) * H + h])) : 0.f;
    }
  }
  __syncthreads();

  uint8_t* record = static_cast<uint8_t*>(p.workspace) +
                    (static_cast<size_t>(slot) * H + h) * static_cast<size_t>(ChunkRecordLayout::kBytes);
  auto* rec_kd = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKdOffset);
  auto* rec_qd = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kQdOffset);
  auto* rec_krt = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kKrTOffset);
  auto* rec_inv = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kInvOffset);
  auto* rec_mqk = reinterpret_cast<__nv_bfloat16*>(record + ChunkRecordLayout::kMqkOffset);
  auto* rec_decay = reinterpret_cast<float*>(record + ChunkRecordLayout::kDecayOffset);
  auto* rec_beta = reinterpret_cast<float*>(record + ChunkRecordLayout::kBetaOffset);

  // Phase 2, thread per channel: cumulative gates and the decayed/restored keys and queries.
  {
    const int ch = tid;
    float cum[kChunk];
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      acc = __fadd_rn(acc, gamma_s[r][ch]);
      cum[r] = acc;
    }
    const float total = cum[kChunk - 1];  // Γ: padded rows add γ = 0
    uint32_t krt_packed[kChunk / 2];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      const float k_hat = __fmul_rn(bf16_to_float(k_s[r][ch]), inv_norm_k_s[r]);
      const float q_hat = __fmul_rn(bf16_to_float(q_s[r][ch]), inv_norm_q_s[r]);
      const float decay = ex2_approx(cum[r]);
      const __nv_bfloat16 kd = __float2bfloat16_rn(__fmul_rn(k_hat, decay));
      const __nv_bfloat16 qd = __float2bfloat16_rn(__fmul_rn(__fmul_rn(q_hat, p.scale), decay));
      const __nv_bfloat16 ki = __float2bfloat16_rn(__fmul_rn(k_hat, ex2_approx(-cum[r])));
      const float kr = __fmul_rn(k_hat, ex2_approx(__fsub_rn(total, cum[r])));
      kd_s[r][ch] = kd;
      qd_s[r][ch] = qd;
      ki_s[r][ch] = ki;
      rec_kd[r * kHeadDim + ch] = kd;
      rec_qd[r * kHeadDim + ch] = qd;
      if (r % 2 == 0) {
        krt_packed[r / 2] = 0;
      }
      const __nv_bfloat16 kr_bf = __float2bfloat16_rn(kr);
      krt_packed[r / 2] |= static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&kr_bf)) << (16 * (r % 2));
    }
    uint4* krt_row = reinterpret_cast<uint4*>(rec_krt + ch * kChunk);
    krt_row[0] = make_uint4(krt_packed[0], krt_packed[1], krt_packed[2], krt_packed[3]);
    krt_row[1] = make_uint4(krt_packed[4], krt_packed[5], krt_packed[6], krt_packed[7]);
    rec_decay[ch] = ex2_approx(total);
  }
  __syncthreads();

  // Phase 3: A = Kd·Kiᵀ (warp 0) and Mqk = Qd·Kiᵀ (warp 1) on the tensor cores, k-steps in order.
  if (warp < 2) {
    const __nv_bfloat16* lhs = warp == 0 ? &kd_s[0][0] : &qd_s[0][0];
    float(*dst)[kChunk] = warp == 0 ? a_s : m_s;
    const int gi = lane >> 2, ti = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t a[4], b[2];
        load_a_frag(a, lhs + 16 * ks, kHeadDim, lane);
        load_b_frag(b, &ki_s[8 * nt][16 * ks], kHeadDim, lane);
        mma_bf16_16816(d, a, b);
      }
      dst[gi][8 * nt + 2 * ti] = d[0];
      dst[gi][8 * nt + 2 * ti + 1] = d[1];
      dst[gi + 8][8 * nt + 2 * ti] = d[2];
      dst[gi + 8][8 * nt + 2 * ti + 1] = d[3];
    }
  }
  __syncthreads();

  // Phase 4: INV by forward substitution (thread j owns column j), masked Mqk, beta.
  if (tid < kChunk) {
    const int j = tid;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) {
        acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(a_s[i][m], beta_s[i]), x[m]));
      }
      x[i] = __fsub_rn(i == j ? 1.f : 0.f, acc);
      rec_inv[i * kChunk + j] = __float2bfloat16_rn(x[i]);
    }
  } else if (warp == 1) {
    for (int e = lane; e < kChunk * kChunk; e += 32) {
      const int i = e / kChunk, jj = e % kChunk;
      rec_mqk[e] = __float2bfloat16_rn(jj <= i ? m_s[i][jj] : 0.f);
    }
  } else if (warp == 2 && lane < kChunk) {
    rec_beta[lane] = beta_s[lane];
  }
}

}  // namespace

void launch_prepare(const FwdParams& p, cudaStream_t stream) {
  const int64_t slots = num_chunk_slots(p.total_tokens, p.num_seqs);
  if (slots == 0 || p.heads == 0) return;
  const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.heads));
  kda_prepare_kernel<<<grid, kPrepThreads, 0, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_prepare_kernel");
}

}  // namespace kda
