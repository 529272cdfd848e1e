// KDA forward, stage 2 of 2: the recurrence over the chunks of each sequence.
//
// One CTA per (sequence, head); warp w owns state rows v = 16w..16w+15 for the whole sequence, kept in
// fp32 mma accumulators laid out as S[v, k] (rows v, columns k). The rows of S evolve independently, so
// warps never exchange data: a later version can split V across CTAs without changing a single bit.
// Per chunk (SPEC §2, transposed so that v is the mma row dimension):
//   Pᵀ  = bf16(S) · Kdᵀ               (16 x 16, K = 128)
//   Oᵀ  = bf16(S) · Qdᵀ
//   Wᵀ  = β ⊙ (Vᵀ − Pᵀ)               (fp32)
//   Uᵀ  = bf16(Wᵀ) · INVᵀ
//   Oᵀ += bf16(Uᵀ) · Mqkᵀ  -> out
//   S   = S ⊙ 2^Γ + bf16(Uᵀ) · Kr     (fp32 accumulators)
// Workspace records and value tiles stream through a two-stage cp.async pipeline.
#include <cuda_bf16.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"

namespace kda {
namespace {

constexpr int kRecWarps = kHeadDim / 16;  // one warp per 16 state rows
constexpr int kRecThreads = kRecWarps * 32;
constexpr int kValueTileBytes = kChunk * kHeadDim * 2;
constexpr int kStageBytes = ChunkRecordLayout::kBytes + kValueTileBytes;
constexpr int kStages = 2;

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Issues the async copies of chunk `chunk` (its workspace record and its value rows; rows past the end of
// the sequence are zero-filled) into `stage`.
__device__ __forceinline__ void load_stage(uint8_t* stage, const FwdParams& p, int64_t slot, int h,
                                           int64_t token0, int rows) {
  const uint8_t* record = static_cast<const uint8_t*>(p.workspace) +
                          (static_cast<size_t>(slot) * p.heads + h) * static_cast<size_t>(ChunkRecordLayout::kBytes);
  for (int i = threadIdx.x; i < ChunkRecordLayout::kBytes / 16; i += kRecThreads) {
    cp_async_16(stage + 16 * i, record + 16 * i, 16);
  }
  constexpr int kPiecesPerRow = kHeadDim * 2 / 16;
  const auto* v = static_cast<const __nv_bfloat16*>(p.v);
  for (int i = threadIdx.x; i < kChunk * kPiecesPerRow; i += kRecThreads) {
    const int r = i / kPiecesPerRow, piece = i % kPiecesPerRow;
    const bool valid = r < rows;
    const __nv_bfloat16* src = valid ? v + ((token0 + r) * p.heads + h) * kHeadDim + piece * 8 : v;
    cp_async_16(stage + ChunkRecordLayout::kBytes + 16 * i, src, valid ? 16 : 0);
  }
  cp_async_commit();
}

template <typename StateT>
__device__ __forceinline__ void load_state_pair(const StateT* src, float& a, float& b);
template <>
__device__ __forceinline__ void load_state_pair<float>(const float* src, float& a, float& b) {
  const float2 x = *reinterpret_cast<const float2*>(src);
  a = x.x;
  b = x.y;
}
template <>
__device__ __forceinline__ void load_state_pair<__nv_bfloat16>(const __nv_bfloat16* src, float& a, float& b) {
  const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(src);
  a = __low2float(x);
  b = __high2float(x);
}

__device__ __forceinline__ void store_state_pair(float* dst, float a, float b) {
  *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}
__device__ __forceinline__ void store_state_pair(__nv_bfloat16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

template <typename StateT>
__global__ void __launch_bounds__(kRecThreads, 1) kda_recurrence_kernel(const FwdParams p) {
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int H = p.heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = warp * 16;

  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;
  const int64_t slot0 = first_slot(bounds.bos, n);
  const size_t state_offset = (static_cast<size_t>(n) * H + h) * kHeadDim * kHeadDim;

  // s[nt][i]: S[v_base + gi + 8*(i/2)][8*nt + 2*ti + i%2]
  float s[kHeadDim / 8][4];
  if (p.initial_state != nullptr) {
    const StateT* init = static_cast<const StateT*>(p.initial_state) + state_offset;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = v_base + gi + 8 * half;
        load_state_pair<StateT>(init + row * kHeadDim + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
    }
  }

  __shared__ __align__(16) uint8_t smem[kStages][kStageBytes];
  auto rows_of = [&](int64_t chunk) {
    const int64_t remaining = len - chunk * kChunk;
    return static_cast<int>(remaining < kChunk ? remaining : kChunk);
  };
  if (num_chunks > 0) {
    load_stage(smem[0], p, slot0, h, bounds.bos, rows_of(0));
  }
  auto* out = static_cast<__nv_bfloat16*>(p.out);

  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    if (chunk + 1 < num_chunks) {
      load_stage(smem[(chunk + 1) % kStages], p, slot0 + chunk + 1, h, bounds.bos + (chunk + 1) * kChunk,
                 rows_of(chunk + 1));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const uint8_t* stage = smem[chunk % kStages];
    const auto* kd = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kKdOffset);
    const auto* qd = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kQdOffset);
    const auto* krt = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kKrTOffset);
    const auto* inv = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kInvOffset);
    const auto* mqk = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kMqkOffset);
    const auto* decay = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kDecayOffset);
    const auto* beta = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kBetaOffset);
    const auto* vt = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kBytes);

    // bf16(S) as A fragments, k-step ks covering state columns 16ks..16ks+15.
    uint32_t s_frag[kHeadDim / 16][4];
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) acc_to_a_frag(s_frag[ks], s[2 * ks], s[2 * ks + 1]);

    float p_acc[2][4] = {};
    float o_acc[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t b[2];
        load_b_frag(b, kd + 8 * nt * kHeadDim + 16 * ks, kHeadDim, lane);
        mma_bf16_16816(p_acc[nt], s_frag[ks], b);
      }
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t b[2];
        load_b_frag(b, qd + 8 * nt * kHeadDim + 16 * ks, kHeadDim, lane);
        mma_bf16_16816(o_acc[nt], s_frag[ks], b);
      }
    }

    // Wᵀ[v][c] = β[c]·(V[c][v] − Pᵀ[v][c]).
    float w[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = 8 * nt + 2 * ti + (i & 1);
        const int row = v_base + gi + 8 * (i >> 1);
        w[nt][i] = __fmul_rn(beta[c], __fsub_rn(bf16_to_float(vt[c * kHeadDim + row]), p_acc[nt][i]));
      }
    }
    uint32_t w_frag[4];
    acc_to_a_frag(w_frag, w[0], w[1]);

    // Uᵀ = bf16(Wᵀ)·INVᵀ: B(k = c, n = c') = INV[c'][c], i.e. INV stored row-major.
    float u[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b[2];
      load_b_frag(b, inv + 8 * nt * kChunk, kChunk, lane);
      mma_bf16_16816(u[nt], w_frag, b);
    }
    uint32_t u_frag[4];
    acc_to_a_frag(u_frag, u[0], u[1]);

    // Oᵀ += bf16(Uᵀ)·Mqkᵀ, then out[token c'][h][v].
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b[2];
      load_b_frag(b, mqk + 8 * nt * kChunk, kChunk, lane);
      mma_bf16_16816(o_acc[nt], u_frag, b);
    }
    const int rows = rows_of(chunk);
    const int64_t token0 = bounds.bos + chunk * kChunk;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = 8 * nt + 2 * ti + (i & 1);
        const int row = v_base + gi + 8 * (i >> 1);
        if (c < rows) {
          out[((token0 + c) * H + h) * kHeadDim + row] = __float2bfloat16_rn(o_acc[nt][i]);
        }
      }
    }

    // S = S ⊙ 2^Γ + bf16(Uᵀ)·Kr: B(k = c, n = state column) = Kr[c][col] = KrT[col][c].
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      const float d0 = decay[8 * nt + 2 * ti], d1 = decay[8 * nt + 2 * ti + 1];
      s[nt][0] = __fmul_rn(s[nt][0], d0);
      s[nt][1] = __fmul_rn(s[nt][1], d1);
      s[nt][2] = __fmul_rn(s[nt][2], d0);
      s[nt][3] = __fmul_rn(s[nt][3], d1);
      uint32_t b[2];
      load_b_frag(b, krt + 8 * nt * kChunk, kChunk, lane);
      mma_bf16_16816(s[nt], u_frag, b);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  if (p.final_state != nullptr) {
    StateT* fin = static_cast<StateT*>(p.final_state) + state_offset;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = v_base + gi + 8 * half;
        store_state_pair(fin + row * kHeadDim + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
      }
    }
  }
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads));
  if (p.state_is_fp32) {
    kda_recurrence_kernel<float><<<grid, kRecThreads, 0, stream>>>(p);
  } else {
    kda_recurrence_kernel<__nv_bfloat16><<<grid, kRecThreads, 0, stream>>>(p);
  }
  KDA_CHECK_LAUNCH("kda_recurrence_kernel");
}

}  // namespace kda
