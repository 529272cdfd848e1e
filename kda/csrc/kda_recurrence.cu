// KDA forward: the recurrence over the chunks of each sequence (or of each time segment), the time split's scan
// pass, which runs the same step without outputs, and the single pass, which prepares its own chunks into the ring
// (kda_fwd.cu shows the order of the kernels).
//
// Grid (sequence or segment, head, V part): each CTA owns 128 / v_split state rows of one (sequence, head);
// warp w of it owns 16 rows v for its whole chunk range, kept in fp32 mma accumulators laid out as S[v, k]
// (rows v, columns k). The rows of S evolve independently, so warps and CTAs never exchange data and the V split changes no
// bit. Per chunk (SPEC §2, transposed so that v is the mma row dimension):
//   Pᵀ  = bf16(S) · Kdᵀ               (16 x 16, K = 128)
//   Oᵀ  = bf16(S) · Qdᵀ
//   Wᵀ  = β ⊙ (Vᵀ − Pᵀ)               (fp32)
//   Uᵀ  = bf16(Wᵀ) · INVᵀ
//   Oᵀ += bf16(Uᵀ) · Mqkᵀ  -> out
//   S   = S ⊙ 2^Γ + bf16(Uᵀ) · Kr     (fp32 accumulators)
// Data movement: the copy engine brings each chunk's workspace record (one bulk copy; the record is already
// the swizzled shared-memory image, kda_params.h) into a ring of kStages stages, completing on one mbarrier
// per stage (issued by a producer warp in the finishing pass's CTAs of two warpgroups, which release each stage
// on an "empty" mbarrier; the other CTAs refill behind a CTA barrier by warp 0); each warp fetches its own slice
// of the 16 value rows with one cp.async per lane. Fragments come
// out of shared memory with conflict-free ldmatrix, and outputs leave through movmatrix-transposed stores
// (8-byte stores filling whole 32-byte sectors in the wgmma CTAs, 4-byte ones in the others).
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/dependent_launch.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"
#include "kda/csrc/kda_prepare_chunk.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/sm90_wgmma.cuh"
#include "kda/csrc/smem_opt_in.h"

namespace kda {
namespace {

// Chunks in flight: hides the record's trip from HBM/L2 behind ~3 steps (6 and 8 measured slower: docs/KERNEL.md).
constexpr int kStages = 4;

// Shared-memory ring of kRingStages stages of one CTA that owns kWarps * 16 state rows.
template <int kWarps, int kRingStages = kStages>
struct RecurrenceSmem {
  static constexpr int kRows = kWarps * 16;
  // Value rows [token c][v of this CTA], padded by 16 bytes so the 8 rows an ldmatrix phase reads sit in
  // different banks (and every row stays 16-byte aligned for the bulk copies).
  static constexpr int kValueStride = kRows * 2 + 16;
  static constexpr int kValueOffset = ChunkRecordLayout::kBytes;
  // Stages start 1024-byte aligned: wgmma's 128-byte swizzle is a function of the address bits.
  static constexpr int kStageBytes = (kValueOffset + kChunk * kValueStride + 1023) / 1024 * 1024;
  static constexpr int kBarrierOffset = kRingStages * kStageBytes;
  static constexpr int kEmptyOffset = kBarrierOffset + kRingStages * 8;  // used by CTAs with a producer warp
  static constexpr int kBytes = kEmptyOffset + kRingStages * 8;
  static constexpr int kLaunchBytes = kBytes + 1024;  // room to align the dynamic shared memory's start
  // A warp fetches its value columns of a chunk with one 16-byte cp.async per lane: token lane / 2, 8-column half
  // lane % 2. Where that piece goes in a stage, for the warp whose first row in the CTA is local_v:
  static __device__ __forceinline__ int value_fill_offset(int lane, int local_v) {
    return kValueOffset + (lane >> 1) * kValueStride + 2 * (local_v + 8 * (lane & 1));
  }
};
// And where it comes from, given the chunk's first value of the warp's first column (rows past the end of a
// sequence are zero-filled from that first value instead, which is in bounds, so that β = 0 meets finite values).
__device__ __forceinline__ const __nv_bfloat16* value_fill_source(const __nv_bfloat16* chunk_v, int lane,
                                                                  int64_t token_stride) {
  return chunk_v + (lane >> 1) * token_stride + 8 * (lane & 1);
}

// The ring's start: the dynamic shared memory rounded up to 1024 bytes.
__device__ __forceinline__ uint8_t* aligned_ring(uint8_t* dynamic_smem) {
  return dynamic_smem + ((1024u - (smem_addr(dynamic_smem) & 1023u)) & 1023u);
}

// Lane 0 brings one chunk's workspace record into `stage` with one bulk copy that completes on `full`.
__device__ __forceinline__ void fill_record(uint8_t* stage, uint64_t* full, const uint8_t* record, int lane) {
  if (lane == 0) {
    mbarrier_arrive_expect_tx(full, ChunkRecordLayout::kBytes);
    bulk_copy_g2s(stage, record, ChunkRecordLayout::kBytes, full);
  }
}

// This warp's 16 state rows as fp32 mma accumulators: s[nt][i] = S[v_base + gi + 8*(i/2)][8*nt + 2*ti + i%2].
using StateRows = float[kHeadDim / 8][4];

// Loads S rows v_base.. from a row-major [128][128] state of type T (the caller's initial state, or fp32
// workspace states of the time split). Lane ti holds columns 8nt + 2ti, +1 of its rows; in bf16 that is 4 bytes
// per n-tile, so lane pairs trade and each access moves 8 bytes: the even lane columns 16m + 2ti .. +3, the odd
// one 16m + 2ti + 6 .. +9, and 4 lanes fill a row's 32-byte sector (fp32 pairs already do).
template <typename T>
__device__ __forceinline__ void load_rows(StateRows& s, const T* state, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const T* row = state + (v_base + gi + 8 * half) * kHeadDim;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const bool odd = (ti & 1) != 0;
#pragma unroll
      for (int m = 0; m < kHeadDim / 16; ++m) {
        const uint2 raw = *reinterpret_cast<const uint2*>(row + 16 * m + 2 * ti + (odd ? 6 : 0));
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? raw.x : raw.y, 1);
        const uint32_t lo = odd ? got : raw.x, hi = odd ? raw.y : got;  // n-tiles 2m and 2m + 1
        const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&lo);
        const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&hi);
        s[2 * m][2 * half] = __low2float(a), s[2 * m][2 * half + 1] = __high2float(a);
        s[2 * m + 1][2 * half] = __low2float(b), s[2 * m + 1][2 * half + 1] = __high2float(b);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) {
        load_pair<T>(row + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
      }
    }
  }
}
template <typename T>
__device__ __forceinline__ void store_rows(T* state, const StateRows& s, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    T* row = state + (v_base + gi + 8 * half) * kHeadDim;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const bool odd = (ti & 1) != 0;
#pragma unroll
      for (int m = 0; m < kHeadDim / 16; ++m) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(s[2 * m][2 * half], s[2 * m][2 * half + 1]);
        const __nv_bfloat162 b = __floats2bfloat162_rn(s[2 * m + 1][2 * half], s[2 * m + 1][2 * half + 1]);
        const uint32_t lo = *reinterpret_cast<const uint32_t*>(&a), hi = *reinterpret_cast<const uint32_t*>(&b);
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 1);
        *reinterpret_cast<uint2*>(row + 16 * m + 2 * ti + (odd ? 6 : 0)) = odd ? make_uint2(got, hi) : make_uint2(lo, got);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) store_pair(row + 8 * nt + 2 * ti, s[nt][2 * half], s[nt][2 * half + 1]);
    }
  }
}
__device__ __forceinline__ void fill_rows(StateRows& s, float value) {
#pragma unroll
  for (int nt = 0; nt < kHeadDim / 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = value;
  }
}

// Sets up the CTA's stage barriers (once per CTA: a CTA runs one chunk range).
template <int kWarps>
__device__ __forceinline__ uint64_t* init_ring(uint8_t* smem) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + RecurrenceSmem<kWarps>::kBarrierOffset);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + RecurrenceSmem<kWarps>::kEmptyOffset);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(&full[st], 1);
      mbarrier_init(&empty[st], kWarps * 32);  // one arrival per consumer thread (CTAs with a producer warp)
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  return full;
}

// Runs chunks c0 .. c0 + count - 1 of (sequence `bounds`, head h) over this warp's 16 state rows `s`.
// kOutput: compute and store the chunk outputs (the finishing pass); the scan pass only needs the end state.
// kValues: the value rows enter (state rows); transition rows (the map M of the time split) see v = 0.
// kWgmma: the products as warpgroup wgmma (kWarps a multiple of 4) instead of per-warp mma.sync; the same
// products in the same order, rounded the same way (docs/KERNEL.md), so no bit changes. With kOutput too (the
// finishing pass) the CTA has a producer warp for the records (produce_records).
// Each product keeps its own order, so neither the step's schedule nor the ring's synchronisation changes a bit.
// kHiLo: the state update adds bf16(Uᵀ − bf16(Uᵀ))·Kr after bf16(Uᵀ)·Kr (slow decay, kda_plan.h).
// kSelfFed (the single pass): the CTA has already put the chunks' records and value rows into stages 0 .. count - 1
// of a ring of kRingStages >= count stages and synchronised; the steps then neither copy nor wait.
template <int kWarps, bool kOutput, bool kValues, bool kWgmma, bool kHiLo, int kRingStages = kStages,
          bool kSelfFed = false>
__device__ __forceinline__ void run_chunks(const FwdParams& p, uint8_t* smem, uint64_t* full, int64_t n, int h,
                                           const SeqBounds& bounds, int64_t c0, int64_t count, int v_base,
                                           StateRows& s) {
  using Smem = RecurrenceSmem<kWarps, kRingStages>;
  constexpr int kStages = kRingStages;  // this ring's depth (the file's kStages is the default)
  // CTAs of two warpgroups (the finishing pass) have a producer warp for the records and release each stage on
  // its empty barrier, so the warpgroups never meet at a CTA barrier and their products interleave on the tensor
  // cores; the others refill a stage after a CTA barrier placed while the tensor cores update S. Either way the
  // output product of a wgmma CTA goes first, so that its stores overlap the state update.
  constexpr bool kProducer = kWgmma && kOutput && !kSelfFed;
  constexpr bool kOutputFirst = kWgmma && kOutput;
  // The 8-warp scan runs two CTAs per SM on 128 registers: bf16(S) in four parts and S ⊙ 2^Γ after Pᵀ, so that
  // ptxas need not serialise the products (docs/KERNEL.md, v12).
  constexpr bool kScanParts = kWgmma && !kOutput;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int local_v = warp * 16;  // this warp's first row inside the CTA's slice
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t token_stride = static_cast<int64_t>(p.heads) * kHeadDim;  // elements between consecutive tokens
  const int64_t chunk_stride = kChunk * token_stride;                      // elements between consecutive chunks

  // The value rows run kStages - 1 chunks ahead of the math, the records as far as the ring allows (the producer
  // warp) or kStages - 1 (warp 0), in chunk order. Everything they address advances by
  // a fixed stride per chunk, so the loop keeps running pointers instead of recomputing 64-bit products (the
  // bookkeeping between two steps sits on the step's dependent chain).
  const uint8_t* record_fill = static_cast<const uint8_t*>(p.workspace) +
                               (static_cast<size_t>(first_slot(bounds.bos, n) + c0) * p.heads + h) *
                                   static_cast<size_t>(ChunkRecordLayout::kBytes);
  const size_t record_stride = static_cast<size_t>(p.heads) * ChunkRecordLayout::kBytes;
  // This warp's value rows (Smem::value_fill_offset, value_fill_source).
  const int fill_token = lane >> 1;
  const __nv_bfloat16* v_fill = static_cast<const __nv_bfloat16*>(p.v) + (bounds.bos + c0 * kChunk) * token_stride +
                                h * kHeadDim + v_base;  // the chunk being filled, its first token
  const __nv_bfloat16* v_fill_lane = value_fill_source(v_fill, lane, token_stride);  // this lane's piece
  const int fill_dst = Smem::value_fill_offset(lane, local_v);
  // 32-bit step bookkeeping (registers are scarce in the two-per-SM scan): a sequence's chunk count and the
  // tokens left are far below 2^31 for any tensor that fits in memory; the token count is clamped there anyway.
  const int steps = static_cast<int>(count);
  const int rows_total = static_cast<int>(min(len - c0 * kChunk, static_cast<int64_t>(INT32_MAX - kChunk)));
  int rows_fill = rows_total;
  int filled = 0;
  int fill_stage = 0;
  // Issues the next chunk's copies into its stage (the record too without a producer warp); every warp commits
  // one cp.async group per call.
  auto fill_next = [&]() {
    if (filled < steps) {
      uint8_t* stage = smem + fill_stage * Smem::kStageBytes;
      if (!kProducer && warp == 0) fill_record(stage, &full[fill_stage], record_fill, lane);
      if (kValues) {
        const bool valid = fill_token < rows_fill;
        cp_async_16(stage + fill_dst, valid ? v_fill_lane : v_fill, valid ? 16 : 0);
      }
      record_fill += record_stride;
      v_fill += chunk_stride;
      v_fill_lane += chunk_stride;
      rows_fill -= kChunk;
      fill_stage = fill_stage + 1 == kStages ? 0 : fill_stage + 1;
      ++filled;
    }
    cp_async_commit();
  };
  if constexpr (!kSelfFed) {
    for (int i = 0; i < kStages - 1; ++i) fill_next();
  }

  // The row this lane addresses for ldmatrix: matrix mat = lane / 8, row lane % 8 of it. Every B operand here
  // (Kd, Qd with k = state column; Krᵀ, INV, Mqk with k = token) is loaded as matrices (n-tile, k half) =
  // (mat / 2, mat % 2), i.e. stored row frag_row, 8-column half frag_half; the value rows likewise as (token
  // tile, v half).
  const int mat = lane >> 3;
  const int frag_row = (lane & 7) + 8 * (mat >> 1), frag_half = mat & 1;
  const int value_offset = Smem::kValueOffset + frag_row * Smem::kValueStride + 2 * (local_v + 8 * frag_half);

  // Outputs: token gi of the chunk (and gi + 8, one tile further), columns v_base + 2ti (+ 8 per half).
  __nv_bfloat16* out_chunk = static_cast<__nv_bfloat16*>(p.out) + (bounds.bos + c0 * kChunk + gi) * token_stride +
                             h * kHeadDim + v_base + 2 * ti;
  const int64_t out_tile = 8 * token_stride;
  int rows_math = rows_total;  // tokens from the chunk being computed to the end of the sequence (clamped)
  // wgmma descriptors: the constant halves, and the ring's start address (a stage adds its offset >> 4).
  constexpr uint32_t kKqDescHi = smem_desc_hi(SmemSwizzle::k128B, 1024);  // Kd | Qd, 8-row groups 1 KB apart
  constexpr uint32_t kNarrowDescHi = smem_desc_hi(SmemSwizzle::k32B, 256);  // Krᵀ, INV | Mqk
  const uint32_t ring_desc_lo = smem_desc_lo(smem);
  int stage_index = 0;
  uint32_t phase = 0;
  for (int i = 0; i < steps; ++i) {
    // Wait for this chunk: its value rows (this warp's own copies, the oldest group in flight) and its record.
    // With a producer warp, this warp first refills its value rows of the stage it used last step (no other
    // warp reads them); without one, every refill happens later in the step, after a CTA barrier.
    if constexpr (kSelfFed) {
      // nothing to wait for: the caller's CTA barrier
    } else if constexpr (kProducer) {
      fill_next();
      cp_async_wait<kStages - 1>();
    } else {
      cp_async_wait<kStages - 2>();
    }
    const uint8_t* stage = smem + stage_index * Smem::kStageBytes;
    if constexpr (!kSelfFed) {
      __syncwarp();
      mbarrier_wait_parity_warp(&full[stage_index], phase);
    }

    const uint8_t* kq = stage + ChunkRecordLayout::kKdQdOffset;
    const uint32_t stage_desc_lo = ring_desc_lo + stage_index * (Smem::kStageBytes / 16);
    const auto* krt = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kKrTOffset);
    const auto* inv = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kInvOffset);
    const auto* mqk = reinterpret_cast<const __nv_bfloat16*>(stage + ChunkRecordLayout::kMqkOffset);
    const auto* decay = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kDecayOffset);
    const auto* beta = reinterpret_cast<const float*>(stage + ChunkRecordLayout::kBetaOffset);

    // bf16(S) as A fragments, k-step ks covering state columns 16ks..16ks+15.
    uint32_t s_frag[kHeadDim / 16][4];
    if constexpr (!kScanParts) {
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) acc_to_a_frag(s_frag[ks], s[2 * ks], s[2 * ks + 1]);
    }

    // The operands of Wᵀ besides Pᵀ (the value rows, V = 0 for transition rows, and β), and S ⊙ 2^Γ, the first
    // term of the state update: with wgmma both run while the tensor cores compute Pᵀ, off the step's chain.
    uint32_t v_frag[4] = {0u, 0u, 0u, 0u};  // [token tile nt][v half]: (V[8nt+2t][v], V[8nt+2t+1][v]), v = g (+8)
    float2 beta_pair[2];
    auto load_w_operands = [&]() {
      if (kValues) ldmatrix_x4_trans(v_frag, stage + value_offset);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) beta_pair[nt] = *reinterpret_cast<const float2*>(beta + 8 * nt + 2 * ti);
    };
    auto decay_state = [&]() {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(decay + 8 * nt + 2 * ti);
        s[nt][0] = __fmul_rn(s[nt][0], d.x);
        s[nt][1] = __fmul_rn(s[nt][1], d.y);
        s[nt][2] = __fmul_rn(s[nt][2], d.x);
        s[nt][3] = __fmul_rn(s[nt][3], d.y);
      }
    };

    // Pᵀ (po[0..1]) and Oᵀ (po[2..3]): independent accumulation chains, each over k-steps 0..7 in order. With
    // wgmma one product per k-step covers both (Kd's and Qd's rows are one 32-row operand).
    float po[4][4] = {};
    if constexpr (kWgmma) {
      if constexpr (!kScanParts) {
        load_w_operands();
        decay_state();
      }
      register_fence(s);
      register_fence(po);
      // The two-per-SM scan converts a quarter of bf16(S) at a time and waits for its products (four round trips
      // instead of eight serialised ones: 32 fragment registers beside S and its factors do not fit in 128).
      constexpr int kPParts = kScanParts ? 4 : 1;
#pragma unroll
      for (int part = 0; part < kPParts; ++part) {
        constexpr int kSlices = kHeadDim / 16 / kPParts;
        if constexpr (kScanParts) {
#pragma unroll
          for (int k = 0; k < kSlices; ++k) {
            const int ks = part * kSlices + k;
            acc_to_a_frag(s_frag[ks], s[2 * ks], s[2 * ks + 1]);
          }
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kSlices; ++k) {
          const int ks = part * kSlices + k;
          const int offset = ChunkRecordLayout::kKdQdOffset + (ks / 4) * 4096 + (ks % 4) * 32;  // k-slice ks
          const uint64_t b = smem_desc(stage_desc_lo + offset / 16, kKqDescHi);
          if constexpr (kOutput) {
            wgmma_m64n32k16(po, s_frag[ks], b);
          } else {
            wgmma_m64n16k16(*reinterpret_cast<float(*)[2][4]>(&po[0]), s_frag[ks], b);
          }
        }
        wgmma_commit();
        wgmma_wait<0>();
        register_fence(po);
      }
      if constexpr (kScanParts) {
        load_w_operands();
        decay_state();
      }
    } else {
      const auto* kq_bf16 = reinterpret_cast<const __nv_bfloat16*>(kq);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t kd_frag[4], qd_frag[4];
        const int col = 16 * ks + 8 * frag_half;
        ldmatrix_x4(kd_frag, kq_bf16 + record_kq(0, frag_row, col));
        if (kOutput) ldmatrix_x4(qd_frag, kq_bf16 + record_kq(1, frag_row, col));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t bk[2] = {kd_frag[2 * nt], kd_frag[2 * nt + 1]};
          mma_bf16_16816(po[nt], s_frag[ks], bk);
          if (kOutput) {
            const uint32_t bq[2] = {qd_frag[2 * nt], qd_frag[2 * nt + 1]};
            mma_bf16_16816(po[2 + nt], s_frag[ks], bq);
          }
        }
      }
      load_w_operands();
    }

    // Wᵀ[v][c] = β[c]·(V[c][v] − Pᵀ[v][c]).
    float w[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 b = beta_pair[nt];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const __nv_bfloat162 vv = *reinterpret_cast<const __nv_bfloat162*>(&v_frag[2 * nt + half]);
        w[nt][2 * half] = __fmul_rn(b.x, __fsub_rn(__low2float(vv), po[nt][2 * half]));
        w[nt][2 * half + 1] = __fmul_rn(b.y, __fsub_rn(__high2float(vv), po[nt][2 * half + 1]));
      }
    }
    uint32_t w_frag[4];
    acc_to_a_frag(w_frag, w[0], w[1]);

    // Uᵀ = bf16(Wᵀ)·INVᵀ: B(k = c, n = c') = INV[c'][c], i.e. INV's rows.
    float u[2][4] = {};
    uint32_t mqk_frag[4];
    if constexpr (kWgmma) {
      register_fence(u);
      wgmma_fence();
      wgmma_m64n16k16(u, w_frag, smem_desc(stage_desc_lo + ChunkRecordLayout::kInvOffset / 16, kNarrowDescHi));
      wgmma_commit();
      wgmma_wait<0>();
      register_fence(u);
    } else {
      uint32_t inv_frag[4];
      ldmatrix_x4(inv_frag, inv + swizzle_narrow(frag_row, 8 * frag_half));
      if (kOutput) ldmatrix_x4(mqk_frag, mqk + swizzle_narrow(frag_row, 8 * frag_half));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t b[2] = {inv_frag[2 * nt], inv_frag[2 * nt + 1]};
        mma_bf16_16816(u[nt], w_frag, b);
      }
    }
    uint32_t u_frag[4];
    acc_to_a_frag(u_frag, u[0], u[1]);
    uint32_t u_lo_frag[4];  // bf16(Uᵀ − U_hi), same fragment layout (the difference is exact in fp32)
    if constexpr (kHiLo) {
      u_lo_frag[0] = pack_lo_bf16x2(u[0][0], u[0][1], u_frag[0]);
      u_lo_frag[1] = pack_lo_bf16x2(u[0][2], u[0][3], u_frag[1]);
      u_lo_frag[2] = pack_lo_bf16x2(u[1][0], u[1][1], u_frag[2]);
      u_lo_frag[3] = pack_lo_bf16x2(u[1][2], u[1][3], u_frag[3]);
    }

    // S = S ⊙ 2^Γ + bf16(Uᵀ)·Kr: B(k = c, n = state column) = Kr[c][col] = Krᵀ's rows; and Oᵀ += bf16(Uᵀ)·Mqkᵀ
    // (mma.sync: issued after, so that the next step's chain starts as early as possible; wgmma: first, in a
    // group of its own, so that the output stores overlap the state update).
    if constexpr (!kWgmma) decay_state();
    // out[token][h][v] from Oᵀ: each 8x8 bf16 block is transposed in registers so a lane holds two adjacent v of
    // one token (v 2ti, +1 of each half). In a wgmma CTA, whose stores run in the shadow of the state update, lane
    // pairs then trade so that each lane stores 4 adjacent v (the even lane v 2ti .. +3, the odd one 2ti + 6 .. +9)
    // and 4 lanes fill the token's 32-byte sector: half the L2 sector writes of two 4-byte stores.
    auto store_outputs = [&]() {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t block[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          block[half] = movmatrix_trans(pack_bf16x2(po[2 + nt][2 * half], po[2 + nt][2 * half + 1]));
        }
        const bool valid = 8 * nt + gi < rows_math;  // token 8nt + gi of the chunk
        if constexpr (kWgmma) {
          const bool odd = (ti & 1) != 0;
          const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? block[0] : block[1], 1);
          if (valid) {
            *reinterpret_cast<uint2*>(out_chunk + nt * out_tile + (odd ? 6 : 0)) =
                odd ? make_uint2(got, block[1]) : make_uint2(block[0], got);
          }
        } else if (valid) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            *reinterpret_cast<uint32_t*>(out_chunk + nt * out_tile + 8 * half) = block[half];
          }
        }
      }
    };
    if constexpr (kWgmma) {
      register_fence(s);
      register_fence(po);
      wgmma_fence();
      const uint64_t kr_desc = smem_desc(stage_desc_lo + ChunkRecordLayout::kKrTOffset / 16, kNarrowDescHi);
      if constexpr (kOutputFirst) {
        // Oᵀ += bf16(Uᵀ)·Mqkᵀ first, in a group of its own, so that its stores run while the tensor cores update
        // S. INV's and Mqk's rows are one 32-row operand: the INV half lands in the spent Pᵀ accumulators.
        wgmma_m64n32k16(po, u_frag, smem_desc(stage_desc_lo + ChunkRecordLayout::kInvOffset / 16, kNarrowDescHi));
        wgmma_commit();
      }
      wgmma_m64n128k16(s, u_frag, kr_desc);
      if constexpr (kHiLo) wgmma_m64n128k16(s, u_lo_frag, kr_desc);
      wgmma_commit();
      if constexpr (kOutputFirst) {
        wgmma_wait<1>();
        register_fence(po);
        store_outputs();
      } else if constexpr (!kSelfFed) {
        // While the tensor cores update S: every warp has finished the previous step (it waited for that step's
        // products before this one), so the stage of that step is free to refill.
        __syncthreads();
        fill_next();
      }
      wgmma_wait<0>();
      register_fence(s);
      register_fence(po);
      if constexpr (kProducer) {
        // The products above were this stage's last readers: release it to the producer warp, every thread for
        // its own reads of the stage (an mbarrier arrival releases the arriving thread's accesses only; with one
        // arrival per warp after __syncwarp, compute-sanitizer's racecheck reported the refill's bulk copy against
        // the other lanes' reads of β and 2^Γ; per-thread arrivals measured the same time, call 51). The __syncwarp
        // orders every lane's ldmatrix of this stage's value rows before the next step's refill of them by any lane.
        __syncwarp();
        mbarrier_arrive(&full[kStages + stage_index]);  // its empty barrier (kEmptyOffset)
      }
    } else {
#pragma unroll
      for (int pair = 0; pair < kHeadDim / 16; ++pair) {
        uint32_t kr_frag[4];
        ldmatrix_x4(kr_frag, krt + swizzle_narrow(16 * pair + frag_row, 8 * frag_half));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t b[2] = {kr_frag[2 * j], kr_frag[2 * j + 1]};
          mma_bf16_16816(s[2 * pair + j], u_frag, b);
          if constexpr (kHiLo) mma_bf16_16816(s[2 * pair + j], u_lo_frag, b);
        }
      }
      if (kOutput) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t b[2] = {mqk_frag[2 * nt], mqk_frag[2 * nt + 1]};
          mma_bf16_16816(po[2 + nt], u_frag, b);
        }
      }
      // The state update's mma.sync are in flight: refill the previous step's stage meanwhile.
      if constexpr (!kSelfFed) {
        __syncthreads();
        fill_next();
      }
    }

    if constexpr (kOutput && !kOutputFirst) store_outputs();
    out_chunk += chunk_stride;
    rows_math -= kChunk;
    stage_index = stage_index + 1 == kStages ? 0 : stage_index + 1;
    phase ^= stage_index == 0 ? 1u : 0u;
  }
}

// The producer warp of a two-warpgroup finishing CTA (its lane 0): the records of chunks c0 .. c0 + count - 1
// into the ring, each stage refilled once all 8 consumer warps released it on its empty barrier.
// kOverlap (kda_params.h, "The overlap"; no time split, so c0 = 0): a record past the lead is copied only once
// its ready flag is set (the acquire half of the tail kernel's release), polled before the stage is free so that
// the flag's round trip overlaps the consumers' steps.
template <int kWarps, bool kOverlap>
__device__ __forceinline__ void produce_records(const FwdParams& p, uint8_t* smem, uint64_t* full, int64_t n, int h,
                                                const SeqBounds& bounds, int64_t c0, int64_t count) {
  using Smem = RecurrenceSmem<kWarps>;
  uint64_t* empty = full + kStages;  // RecurrenceSmem::kEmptyOffset
  const uint8_t* record = static_cast<const uint8_t*>(p.workspace) +
                          (static_cast<size_t>(first_slot(bounds.bos, n) + c0) * p.heads + h) *
                              static_cast<size_t>(ChunkRecordLayout::kBytes);
  const size_t record_stride = static_cast<size_t>(p.heads) * ChunkRecordLayout::kBytes;
  const int steps = static_cast<int>(count);
  const uint32_t* flag = nullptr;  // the overlap: the ready flag of the first tail record, then the next one
  if constexpr (kOverlap) {
    flag = overlap_flags(p) + overlap_tail_item(p.lead_chunks, n, h, p.lead_chunks, p.num_seqs, p.heads);
  }
  const int64_t flag_stride = p.num_seqs * p.heads;
  for (int c = 0; c < steps; ++c) {
    const int st = c % kStages;
    if constexpr (kOverlap) {
      if (c >= p.lead_chunks) {
        while (ld_acquire_gpu(flag) == 0u) __nanosleep(32);
        fence_proxy_async_global();  // the record's stores, seen through the flag, before the bulk copy reads it
        flag += flag_stride;
      }
    }
    if (c >= kStages) mbarrier_wait_parity(&empty[st], ((c / kStages) - 1) & 1);
    mbarrier_arrive_expect_tx(&full[st], ChunkRecordLayout::kBytes);
    bulk_copy_g2s(smem + st * Smem::kStageBytes, record, ChunkRecordLayout::kBytes, &full[st]);
    record += record_stride;
  }
}

// The finishing pass: one CTA per (segment, head, V part) runs the segment's chunks from its true start state
// and writes its outputs; a sequence's last segment writes final_state. Without a time split a segment is a
// whole sequence (blockIdx.x = n) and the start state is the caller's initial state.
template <int kWarps, bool kWgmma>
constexpr int kFinishThreads = (kWarps + (kWgmma ? 1 : 0)) * 32;  // the wgmma CTAs add a producer warp
// kOverlap: the records past the lead arrive from the tail kernel while this grid runs (produce_records), and the
// grid completes only after the tail grid has, so that the stream's next work waits for both.
template <typename InitT, typename FinalT, int kWarps, bool kWgmma, bool kHiLo, bool kOverlap = false>
__global__ void __launch_bounds__(kFinishThreads<kWarps, kWgmma>, 1) kda_recurrence_kernel(const FwdParams p) {
  using Smem = RecurrenceSmem<kWarps>;
  // Longest first (kda_params.h): the grid is (head, rank), so CTAs start in the order of the sequences' lengths.
  const int h = p.longest_first ? blockIdx.x : blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = blockIdx.z * Smem::kRows + warp * 16;

  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  uint64_t* full = init_ring<kWarps>(smem);

  const int L = p.segment_chunks;
  // Sequence and segment of this CTA column (kda_params.h, pass_columns).
  int64_t n = p.longest_first ? longest_first_order(p)[blockIdx.y] : blockIdx.x, j = 0;
  if (L > 0 && p.cu_seqlens == nullptr) {
    const int64_t segments = segment_count(p.seqlen, L);
    n = blockIdx.x / segments;
    j = blockIdx.x % segments;
  } else if (L > 0) {
    n = find_sequence(p.cu_seqlens, p.cu_seqlens_is_int64, p.num_seqs, p.seqlen, p.total_tokens, blockIdx.x,
                      [L](int64_t bos, int64_t i) { return first_segment_slot(bos, i, L); });
  }
  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;
  const size_t state_offset = (static_cast<size_t>(n) * p.heads + h) * kHeadDim * kHeadDim;

  StateRows s;
  int64_t c0 = 0, count = num_chunks;
  bool last = true;
  const float* split_start = nullptr;  // the start state from the time split's composition (fp32)
  if (L > 0) {
    if (p.cu_seqlens != nullptr) j = static_cast<int64_t>(blockIdx.x) - first_segment_slot(bounds.bos, n, L);
    const int64_t segments = segment_count(len, L);
    if (j < 0 || j >= segments) return;  // an unused segment slot (CTA-uniform)
    c0 = j * L;
    count = num_chunks - c0 < L ? num_chunks - c0 : L;
    last = j + 1 == segments;
    if (segments > 1) {
      split_start = reinterpret_cast<const float*>(
          j == 0 ? window_data(p, window_of(bounds.bos, n, 0, L), h) + WindowLayout::kFirstOffset
                 : window_data(p, window_of(bounds.bos, n, j - 1, L), h) + WindowLayout::kNextOffset);
    }
  }
  if constexpr (kWgmma) {
    if (warp == kWarps) {  // the producer warp
      if (lane == 0) {
        produce_records<kWarps, kOverlap>(p, smem, full, n, h, bounds, c0, count);
        if constexpr (kOverlap) grid_dependency_wait();
      }
      return;
    }
  }
  if (split_start != nullptr) {
    load_rows<float>(s, split_start, v_base, gi, ti);
  } else if (p.initial_state != nullptr) {
    load_rows<InitT>(s, static_cast<const InitT*>(p.initial_state) + state_offset, v_base, gi, ti);
  } else {
    fill_rows(s, 0.f);
  }

  run_chunks<kWarps, true, true, kWgmma, kHiLo>(p, smem, full, n, h, bounds, c0, count, v_base, s);

  if (last && p.final_state != nullptr) {
    store_rows(static_cast<FinalT*>(p.final_state) + state_offset, s, v_base, gi, ti);
  }
}

// The single pass (plan.single_pass, no time split): one CTA of two warpgroups per (sequence, head) prepares its own
// chunks, kSinglePassStages at a time, into a ring of as many stages (warp w prepares chunk w of the block,
// kda_prepare_chunk.cuh) while its value rows land, then runs their steps from the ring (run_chunks, kSelfFed).
// No workspace records: 1,282 instead of 3,018 bytes per token-head cross HBM. The two halves of a block take turns
// on the SM instead of sharing it (a co-resident preparation slows the steps about as much as it takes,
// docs/KERNEL.md), so this pays where many (sequence, head) pairs fill the GPU, not where a few long ones run.
constexpr int kSinglePassWarps = 8;
constexpr int kSinglePassStages = kSinglePassWarps;  // one chunk per warp and block
struct SinglePassSmem {
  using Ring = RecurrenceSmem<kSinglePassWarps, kSinglePassStages>;
  static constexpr int kScratchOffset = (Ring::kBytes + 127) / 128 * 128;  // one preparation tile per warp
  static constexpr int kBytes = kScratchOffset + kSinglePassWarps * prep::kPrepTileBytes;
  static constexpr int kLaunchBytes = kBytes + 1024;  // room to align the ring's start
};

template <typename InitT, typename FinalT, bool kHiLo>
__global__ void __launch_bounds__(kSinglePassWarps * 32, 1) kda_single_pass_kernel(const FwdParams p) {
  using Ring = SinglePassSmem::Ring;
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = warp * 16;

  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  auto* scratch =
      reinterpret_cast<__nv_bfloat16*>(smem + SinglePassSmem::kScratchOffset + warp * prep::kPrepTileBytes);

  const SeqBounds bounds = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
  const int64_t len = bounds.eos - bounds.bos;
  const int64_t num_chunks = (len + kChunk - 1) / kChunk;
  const size_t state_offset = (static_cast<size_t>(n) * p.heads + h) * kHeadDim * kHeadDim;

  StateRows s;
  if (p.initial_state != nullptr) {
    load_rows<InitT>(s, static_cast<const InitT*>(p.initial_state) + state_offset, v_base, gi, ti);
  } else {
    fill_rows(s, 0.f);
  }

  // This warp's value rows, laid out as run_chunks lays them out (Ring::value_fill_offset, value_fill_source).
  const int64_t token_stride = static_cast<int64_t>(p.heads) * kHeadDim;
  const int fill_token = lane >> 1;
  const __nv_bfloat16* v_head =
      static_cast<const __nv_bfloat16*>(p.v) + bounds.bos * token_stride + h * kHeadDim + v_base;
  const int fill_dst = Ring::value_fill_offset(lane, v_base);

  for (int64_t c0 = 0; c0 < num_chunks; c0 += kSinglePassStages) {
    const int count = static_cast<int>(min(num_chunks - c0, static_cast<int64_t>(kSinglePassStages)));
#pragma unroll
    for (int c = 0; c < kSinglePassStages; ++c) {
      if (c < count) {
        const int64_t token = (c0 + c) * kChunk;
        const __nv_bfloat16* chunk_v = v_head + token * token_stride;
        const bool valid = token + fill_token < len;
        cp_async_16(smem + c * Ring::kStageBytes + fill_dst, valid ? value_fill_source(chunk_v, lane, token_stride) : chunk_v,
                    valid ? 16 : 0);
      }
    }
    cp_async_commit();
    if (warp < count) {
      const int64_t token = (c0 + warp) * kChunk;
      const int rows = static_cast<int>(min(len - token, static_cast<int64_t>(kChunk)));
      prep::prepare_chunk<true>(p, h, bounds.bos + token, rows, smem + warp * Ring::kStageBytes, scratch, lane);
    }
    cp_async_wait<0>();
    fence_proxy_async_shared();  // the records' stores before the other warps' wgmma reads
    __syncthreads();
    run_chunks<kSinglePassWarps, true, true, true, kHiLo, kSinglePassStages, true>(p, smem, nullptr, n, h, bounds,
                                                                                  c0, count, v_base, s);
    __syncthreads();  // every warp's last products have read the ring before the next block overwrites it
  }

  if (p.final_state != nullptr) {
    store_rows(static_cast<FinalT*>(p.final_state) + state_offset, s, v_base, gi, ti);
  }
}

// The scan pass of the time split: one CTA per (scanned segment, head, map part). The segment runs twice over
// the same records: from zero with the values (its end state Q) and from the identity without them (the
// transition map M, as rows: row i is e_i carried through the segment). Both go to the window's storage: Q in
// fp32 rows, M split into bf16 hi + lo in the composition kernel's fragment order.
//
// 8-warp scan CTAs get the register budget of two per SM (128 registers, 32 bytes of spills): each step is slower,
// but the plan picks 8-warp scans only when they outnumber the SMs 1.5 to 1 (kda_plan.h, plan_with_segments), and
// two per SM run them in one wave instead of two (H200, scan ms, one / two per SM: T32768 H8 0.176 / 0.155,
// T1048576 H1 0.677 / 0.639). The finishing pass keeps one per SM: two were slower on every shape, multi-wave
// batches included (B32 T512 H32 0.264 / 0.297; docs/KERNEL.md).
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
    const WindowItem item = window_table(p)[blockIdx.x];
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

// Launches kKernel (a CTA of kWarps warps and RecurrenceSmem<kWarps>) on `grid`.
template <int kWarps, auto kKernel, int kThreads = kWarps * 32>
void launch_ring_kernel(const dim3& grid, const FwdParams& p, cudaStream_t stream) {
  using Smem = RecurrenceSmem<kWarps>;
  opt_in_dynamic_smem<kKernel>(Smem::kLaunchBytes);
  kKernel<<<grid, kThreads, Smem::kLaunchBytes, stream>>>(p);
}

template <typename HiLo, typename Launch>
void with_warps_and(int v_split, HiLo hi_lo, Launch launch) {
  switch (v_split) {
    case 1: return launch(std::integral_constant<int, 8>{}, hi_lo);
    case 2: return launch(std::integral_constant<int, 4>{}, hi_lo);
    case 4: return launch(std::integral_constant<int, 2>{}, hi_lo);
    case 8: return launch(std::integral_constant<int, 1>{}, hi_lo);
    default: throw std::invalid_argument("flash_kda: v_split must be 1, 2, 4 or 8, got " + std::to_string(v_split));
  }
}

// The state update of the call's lower bound (kda_plan.h) as a compile-time flag: launch(std::bool_constant).
template <typename Launch>
void with_hi_lo(float lower_bound, Launch launch) {
  if (hi_lo_state_update(lower_bound)) return launch(std::true_type{});
  return launch(std::false_type{});
}

// CTAs of 128 / v_split rows, i.e. 8 / v_split warps, and the state update of the call's lower bound.
template <typename Launch>
void with_warps(int v_split, float lower_bound, Launch launch) {
  with_hi_lo(lower_bound, [&](auto hi_lo) { with_warps_and(v_split, hi_lo, launch); });
}

// The caller's initial and final state dtypes as types: launch(StateType<InitT>{}, StateType<FinalT>{}).
template <typename T>
struct StateType {
  using type = T;
};
template <typename Launch>
void with_state_types(const FwdParams& p, Launch launch) {
  auto with_final = [&](auto init) {
    if (p.final_is_fp32) return launch(init, StateType<float>{});
    return launch(init, StateType<__nv_bfloat16>{});
  };
  if (p.initial_is_fp32) return with_final(StateType<float>{});
  return with_final(StateType<__nv_bfloat16>{});
}

// Which CTAs run their products as wgmma: those of two warpgroups, which share an SM's tensor cores and are
// bound by their throughput (wgmma reads each B operand once per warpgroup, mma.sync once per warp). A CTA of
// one warpgroup is bound by the step's dependent chain, which is shorter with mma.sync (three wgmma round
// trips per step); docs/KERNEL.md has the measurements.
template <int kWarps>
constexpr bool kUseWgmma = kWarps == 8;

template <typename InitT, typename FinalT>
void launch_finish(const FwdParams& p, cudaStream_t stream) {
  const int64_t columns = pass_columns(p).finish;
  const dim3 grid = p.longest_first ? dim3(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.num_seqs))
                                    : dim3(static_cast<unsigned>(columns), static_cast<unsigned>(p.heads),
                                           static_cast<unsigned>(p.v_split));
  with_warps(p.v_split, p.lower_bound, [&](auto warps, auto hi_lo) {
    constexpr int kWarps = decltype(warps)::value;
    constexpr bool kHiLo = decltype(hi_lo)::value;
    constexpr bool kWgmma = kUseWgmma<kWarps>;
    if (p.lead_chunks < 0) {
      launch_ring_kernel<kWarps, kda_recurrence_kernel<InitT, FinalT, kWarps, kWgmma, kHiLo>,
                         kFinishThreads<kWarps, kWgmma>>(grid, p, stream);
    } else if constexpr (kWarps == 8) {
      // The overlap: a programmatic dependent of the tail kernel, which lets it launch once every tail CTA holds
      // its SM, so that these CTAs take the others (kda_prepare.cu).
      constexpr auto kKernel = kda_recurrence_kernel<InitT, FinalT, kWarps, kWgmma, kHiLo, true>;
      using Smem = RecurrenceSmem<kWarps>;
      opt_in_dynamic_smem<kKernel>(Smem::kLaunchBytes);
      launch_dependent(kKernel, grid, dim3(kFinishThreads<kWarps, kWgmma>), Smem::kLaunchBytes, stream, p);
    } else {
      throw std::invalid_argument("flash_kda: the overlap runs v_split 1, got v_split " + std::to_string(p.v_split));
    }
  });
  KDA_CHECK_LAUNCH("kda_recurrence_kernel");
}

template <auto kKernel>
void launch_single_pass_kernel(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads));
  opt_in_dynamic_smem<kKernel>(SinglePassSmem::kLaunchBytes);
  kKernel<<<grid, kSinglePassWarps * 32, SinglePassSmem::kLaunchBytes, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_single_pass_kernel");
}

}  // namespace

void launch_recurrence(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_state_types(p, [&](auto init, auto final) {
    launch_finish<typename decltype(init)::type, typename decltype(final)::type>(p, stream);
  });
}

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

void launch_single_pass(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_state_types(p, [&](auto init, auto final) {
    using InitT = typename decltype(init)::type;
    using FinalT = typename decltype(final)::type;
    with_hi_lo(p.lower_bound, [&](auto hi_lo) {
      launch_single_pass_kernel<kda_single_pass_kernel<InitT, FinalT, decltype(hi_lo)::value>>(p, stream);
    });
  });
}

}  // namespace kda
