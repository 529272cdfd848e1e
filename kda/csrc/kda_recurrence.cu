// KDA forward, stage 2 of 2: the recurrence over the chunks of each sequence.
//
// Grid (sequence, head, V part): each CTA owns 128 / v_split state rows of one (sequence, head); warp w of it
// owns 16 rows v for the whole sequence, kept in fp32 mma accumulators laid out as S[v, k] (rows v, columns
// k). The rows of S evolve independently, so warps and CTAs never exchange data and the V split changes no
// bit. Per chunk (SPEC §2, transposed so that v is the mma row dimension):
//   Pᵀ  = bf16(S) · Kdᵀ               (16 x 16, K = 128)
//   Oᵀ  = bf16(S) · Qdᵀ
//   Wᵀ  = β ⊙ (Vᵀ − Pᵀ)               (fp32)
//   Uᵀ  = bf16(Wᵀ) · INVᵀ
//   Oᵀ += bf16(Uᵀ) · Mqkᵀ  -> out
//   S   = S ⊙ 2^Γ + bf16(Uᵀ) · Kr     (fp32 accumulators)
// Data movement: the copy engine brings each chunk's workspace record (one bulk copy; the record is already
// the swizzled shared-memory image, kda_params.h) into a ring of kStages stages, completing on one mbarrier
// per stage; each warp fetches its own slice of the 16 value rows with one cp.async per lane. Fragments come
// out of shared memory with conflict-free ldmatrix, and outputs leave through movmatrix-transposed 4-byte
// stores.
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"
#include "kda/csrc/sm90_async.cuh"

namespace kda {
namespace {

constexpr int kStages = 4;  // chunks in flight: hides the record's trip from HBM/L2 behind ~3 steps

// Shared-memory ring of one CTA that owns kWarps * 16 state rows.
template <int kWarps>
struct RecurrenceSmem {
  static constexpr int kRows = kWarps * 16;
  // Value rows [token c][v of this CTA], padded by 16 bytes so the 8 rows an ldmatrix phase reads sit in
  // different banks (and every row stays 16-byte aligned for the bulk copies).
  static constexpr int kValueStride = kRows * 2 + 16;
  static constexpr int kValueOffset = ChunkRecordLayout::kBytes;
  static constexpr int kStageBytes = kValueOffset + kChunk * kValueStride;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  static constexpr int kBytes = kBarrierOffset + kStages * 8;
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned");
};

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

// Warp 0 brings chunk `slot`'s workspace record into `stage` with one bulk copy that completes on `full`.
__device__ __forceinline__ void fill_record(uint8_t* stage, uint64_t* full, const FwdParams& p, int64_t slot, int h,
                                            int lane) {
  if (lane == 0) {
    mbarrier_arrive_expect_tx(full, ChunkRecordLayout::kBytes);
    const uint8_t* record = static_cast<const uint8_t*>(p.workspace) +
                            (static_cast<size_t>(slot) * p.heads + h) * static_cast<size_t>(ChunkRecordLayout::kBytes);
    bulk_copy_g2s(stage, record, ChunkRecordLayout::kBytes, full);
  }
}

// Each warp copies its own 16 state rows' slice of the chunk's 16 value rows (one 16-byte cp.async per lane:
// token lane / 2, rows half lane % 2), as one commit group; rows past the end of the sequence are zero-filled
// so that β = 0 meets finite values there. Only this warp reads them: no CTA-wide synchronisation.
__device__ __forceinline__ void fill_values(uint8_t* value_tile, int value_stride, const __nv_bfloat16* v_rows,
                                            int64_t row_stride, int rows, int local_v, int lane) {
  const int c = lane >> 1, piece = lane & 1;
  const bool valid = c < rows;
  const __nv_bfloat16* src = v_rows + (valid ? c * row_stride + 8 * piece : 0);
  cp_async_16(value_tile + c * value_stride + 2 * (local_v + 8 * piece), src, valid ? 16 : 0);
}

template <typename StateT, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1) kda_recurrence_kernel(const FwdParams p) {
  using Smem = RecurrenceSmem<kWarps>;
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int H = p.heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int cta_v0 = blockIdx.z * Smem::kRows;  // first state row of this CTA
  const int local_v = warp * 16;                 // this warp's first row inside the CTA's slice
  const int v_base = cta_v0 + local_v;

  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Smem::kBarrierOffset);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
    mbarrier_init_fence();
  }
  __syncthreads();

  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;
  const int64_t slot0 = first_slot(bounds.bos, n);
  const size_t state_offset = (static_cast<size_t>(n) * H + h) * kHeadDim * kHeadDim;
  const int64_t token_stride = static_cast<int64_t>(H) * kHeadDim;  // elements between consecutive tokens
  // This head's value / output rows of the sequence's first token, at this warp's first state row.
  const auto* v_seq = static_cast<const __nv_bfloat16*>(p.v) + bounds.bos * token_stride + h * kHeadDim + v_base;
  auto rows_of = [&](int64_t chunk) {
    const int64_t remaining = len - chunk * kChunk;
    return static_cast<int>(remaining < kChunk ? remaining : kChunk);
  };
  // Issues chunk `chunk`'s copies into its stage; every warp commits one cp.async group per call.
  auto fill = [&](int64_t chunk) {
    if (chunk < num_chunks) {
      uint8_t* stage = smem + static_cast<int>(chunk % kStages) * Smem::kStageBytes;
      if (warp == 0) fill_record(stage, &full[chunk % kStages], p, slot0 + chunk, h, lane);
      fill_values(stage + Smem::kValueOffset, Smem::kValueStride, v_seq + chunk * kChunk * token_stride,
                  token_stride, rows_of(chunk), local_v, lane);
    }
    cp_async_commit();
  };
  for (int64_t c = 0; c < kStages - 1; ++c) fill(c);

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

  // The row this lane addresses for ldmatrix: matrix mat = lane / 8, row lane % 8 of it. Every B operand here
  // (Kd, Qd with k = state column; Krᵀ, INV, Mqk with k = token) is loaded as matrices (n-tile, k half) =
  // (mat / 2, mat % 2), i.e. stored row frag_row, 8-column half frag_half; the value rows likewise as (token
  // tile, v half).
  const int mat = lane >> 3;
  const int frag_row = (lane & 7) + 8 * (mat >> 1), frag_half = mat & 1;
  const int value_offset = Smem::kValueOffset + frag_row * Smem::kValueStride + 2 * (local_v + 8 * frag_half);

  auto* out_seq = static_cast<__nv_bfloat16*>(p.out) + bounds.bos * token_stride + h * kHeadDim + v_base + 2 * ti;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    // Refill the stage the previous step released (the CTA barrier at the end of that step), then wait for
    // this chunk: its value rows (this warp's own copies, the oldest of kStages groups) and its record.
    fill(chunk + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const int stage_index = static_cast<int>(chunk % kStages);
    const uint8_t* stage = smem + stage_index * Smem::kStageBytes;
    mbarrier_wait_parity_warp(&full[stage_index], static_cast<uint32_t>((chunk / kStages) & 1));

    const auto* kd = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kKdOffset);
    const auto* qd = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kQdOffset);
    const auto* krt = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kKrTOffset);
    const auto* inv = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kInvOffset);
    const auto* mqk = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kMqkOffset);
    const auto* decay = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kDecayOffset);
    const auto* beta = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kBetaOffset);

    // bf16(S) as A fragments, k-step ks covering state columns 16ks..16ks+15.
    uint32_t s_frag[kHeadDim / 16][4];
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) acc_to_a_frag(s_frag[ks], s[2 * ks], s[2 * ks + 1]);

    // Pᵀ and Oᵀ: four independent accumulation chains, each over k-steps 0..7 in order.
    float p_acc[2][4] = {};
    float o_acc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t kd_frag[4], qd_frag[4];
      const int col = 16 * ks + 8 * frag_half;
      ldmatrix_x4(kd_frag, kd + swizzle_wide(frag_row, col));
      ldmatrix_x4(qd_frag, qd + swizzle_wide(frag_row, col));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t bk[2] = {kd_frag[2 * nt], kd_frag[2 * nt + 1]};
        const uint32_t bq[2] = {qd_frag[2 * nt], qd_frag[2 * nt + 1]};
        mma_bf16_16816(p_acc[nt], s_frag[ks], bk);
        mma_bf16_16816(o_acc[nt], s_frag[ks], bq);
      }
    }

    // Wᵀ[v][c] = β[c]·(V[c][v] − Pᵀ[v][c]).
    uint32_t v_frag[4];  // [token tile nt][v half]: (V[8nt+2t][v], V[8nt+2t+1][v]), v = g (+8)
    ldmatrix_x4_trans(v_frag, stage + value_offset);
    float w[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 b = *reinterpret_cast<const float2*>(beta + 8 * nt + 2 * ti);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const __nv_bfloat162 vv = *reinterpret_cast<const __nv_bfloat162*>(&v_frag[2 * nt + half]);
        w[nt][2 * half] = __fmul_rn(b.x, __fsub_rn(__low2float(vv), p_acc[nt][2 * half]));
        w[nt][2 * half + 1] = __fmul_rn(b.y, __fsub_rn(__high2float(vv), p_acc[nt][2 * half + 1]));
      }
    }
    uint32_t w_frag[4];
    acc_to_a_frag(w_frag, w[0], w[1]);

    // Uᵀ = bf16(Wᵀ)·INVᵀ: B(k = c, n = c') = INV[c'][c], i.e. INV's rows.
    uint32_t inv_frag[4], mqk_frag[4];
    ldmatrix_x4(inv_frag, inv + swizzle_narrow(frag_row, 8 * frag_half));
    ldmatrix_x4(mqk_frag, mqk + swizzle_narrow(frag_row, 8 * frag_half));
    float u[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b[2] = {inv_frag[2 * nt], inv_frag[2 * nt + 1]};
      mma_bf16_16816(u[nt], w_frag, b);
    }
    uint32_t u_frag[4];
    acc_to_a_frag(u_frag, u[0], u[1]);

    // S = S ⊙ 2^Γ + bf16(Uᵀ)·Kr: B(k = c, n = state column) = Kr[c][col] = Krᵀ's rows. (Issued before the
    // output so that the next step's chain starts as early as possible.)
#pragma unroll
    for (int pair = 0; pair < kHeadDim / 16; ++pair) {
      uint32_t kr_frag[4];
      ldmatrix_x4(kr_frag, krt + swizzle_narrow(16 * pair + frag_row, 8 * frag_half));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int nt = 2 * pair + j;
        const float2 d = *reinterpret_cast<const float2*>(decay + 8 * nt + 2 * ti);
        s[nt][0] = __fmul_rn(s[nt][0], d.x);
        s[nt][1] = __fmul_rn(s[nt][1], d.y);
        s[nt][2] = __fmul_rn(s[nt][2], d.x);
        s[nt][3] = __fmul_rn(s[nt][3], d.y);
        const uint32_t b[2] = {kr_frag[2 * j], kr_frag[2 * j + 1]};
        mma_bf16_16816(s[nt], u_frag, b);
      }
    }

    // Oᵀ += bf16(Uᵀ)·Mqkᵀ, then out[token][h][v]: each 8x8 bf16 block is transposed in registers so a lane
    // stores two adjacent v of one token.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b[2] = {mqk_frag[2 * nt], mqk_frag[2 * nt + 1]};
      mma_bf16_16816(o_acc[nt], u_frag, b);
    }
    const int rows = rows_of(chunk);
    __nv_bfloat16* out_chunk = out_seq + (chunk * kChunk + gi) * token_stride;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t block = movmatrix_trans(pack_bf16x2(o_acc[nt][2 * half], o_acc[nt][2 * half + 1]));
        if (8 * nt + gi < rows) {  // token 8nt + gi of the chunk
          *reinterpret_cast<uint32_t*>(out_chunk + 8 * nt * token_stride + 8 * half) = block;
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before warp 0 refills it
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

template <typename StateT, int kWarps>
void launch_with(const FwdParams& p, int v_split, cudaStream_t stream) {
  using Smem = RecurrenceSmem<kWarps>;
  auto kernel = kda_recurrence_kernel<StateT, kWarps>;
  // More than 48 KB of dynamic shared memory needs an opt-in, once per function and device (no sync).
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices || !opted_in[device]) {
    KDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::kBytes));
    if (device < kMaxDevices) opted_in[device] = true;
  }
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads), static_cast<unsigned>(v_split));
  kernel<<<grid, kWarps * 32, Smem::kBytes, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_recurrence_kernel");
}

template <typename StateT>
void launch_for_state(const FwdParams& p, int v_split, cudaStream_t stream) {
  switch (v_split) {
    case 1: return launch_with<StateT, 8>(p, v_split, stream);
    case 2: return launch_with<StateT, 4>(p, v_split, stream);
    case 4: return launch_with<StateT, 2>(p, v_split, stream);
    case 8: return launch_with<StateT, 1>(p, v_split, stream);
    default: throw std::invalid_argument("flash_kda: v_split must be 1, 2, 4 or 8, got " + std::to_string(v_split));
  }
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  const int v_split = p.v_split > 0 ? p.v_split : choose_v_split(p.num_seqs, p.heads, current_sm_count());
  if (p.state_is_fp32) {
    launch_for_state<float>(p, v_split, stream);
  } else {
    launch_for_state<__nv_bfloat16>(p, v_split, stream);
  }
}

}  // namespace kda
