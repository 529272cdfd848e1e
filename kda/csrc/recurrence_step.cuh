// The recurrence's step: run_chunks runs a warp's 16 state rows over a range of chunks from the ring, with its
// products as warpgroup wgmma or per-warp mma.sync. Used by the finishing pass (finish_pass.cuh), the time split's
// scan pass (scan_pass.cu), which runs the same step without outputs, and the single pass (single_pass.cuh), which
// prepares its own chunks into the ring (kda_fwd.cu shows the order of the kernels).
//
// Grid (sequence or segment, head, V part): each CTA owns 128 / v_split state rows of one (sequence, head);
// warp w of it owns 16 rows v for its whole chunk range, kept in fp32 mma accumulators laid out as S[v, k]
// (rows v, columns k). The rows of S evolve independently, so warps and CTAs never exchange data and the V split changes no
// bit. Per chunk (docs/SPEC.md §2, transposed so that v is the mma row dimension):
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
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "kda/csrc/device_math.cuh"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/sm90_wgmma.cuh"

namespace kda {

// What run_chunks does with the state after each chunk: nothing (the scan), or the finishing passes' checkpoints
// (CheckpointWriter, checkpoint_writer.cuh).
struct NoChunkEnd {
  __device__ __forceinline__ void operator()(int64_t, const StateRows&) const {}
};

// Runs chunks c0 .. c0 + count - 1 of (sequence `bounds`, head h) over this warp's 16 state rows `s`.
// kOutput: compute and store the chunk outputs (the finishing pass); the scan pass only needs the end state.
// kValues: the value rows enter (state rows); transition rows (the map M of the time split) see v = 0.
// kWgmma: the products as warpgroup wgmma (kWarps a multiple of 4) instead of per-warp mma.sync; the same
// products in the same order, rounded the same way (docs/DESIGN.md, "The step"), so no bit changes. With kOutput
// too (the finishing pass) the CTA has a producer warp for the records (produce_records).
// Each product keeps its own order, so neither the step's schedule nor the ring's synchronisation changes a bit.
// kHiLo: the state update adds bf16(Uᵀ − bf16(Uᵀ))·Kr after bf16(Uᵀ)·Kr (slow decay, kda_plan.h).
// kSelfFed (the single pass): the CTA has already put the chunks' records and value rows into stages 0 .. count - 1
// of a ring of kRingStages >= count stages and synchronised; the steps then neither copy nor wait.
// kPrepFed (the stream pass, stream_pass.cuh): other warps of the CTA prepare each chunk's record and value rows
// straight into the ring and arrive on its "full" mbarrier; the steps wait for it and release the stage on its
// "empty" one, as with a producer warp, and copy nothing. The ring runs on across calls: the step starts at
// ring stage `first_stage` with parity `first_phase`, and the return value is the stage after the last step in
// its low 16 bits and that stage's parity above them.
// chunk_end(c, s) runs after each step with c, the chunks of the sequence done (c0 + step + 1), and the new state.
template <int kWarps, bool kOutput, bool kValues, bool kWgmma, bool kHiLo, int kRingStages = kStages,
          bool kSelfFed = false, typename ChunkEnd = NoChunkEnd, bool kPrepFed = false>
__device__ __forceinline__ uint32_t run_chunks(const FwdParams& p, uint8_t* smem, uint64_t* full, int64_t n, int h,
                                               const SeqBounds& bounds, int64_t c0, int64_t count, int v_base,
                                               StateRows& s, const ChunkEnd& chunk_end = ChunkEnd{},
                                               int first_stage = 0, uint32_t first_phase = 0) {
  using Smem = RecurrenceSmem<kWarps, kRingStages>;
  constexpr int kStages = kRingStages;  // this ring's depth (recurrence_ring.cuh's kStages is the default)
  // CTAs of two warpgroups (the finishing pass) have a producer warp for the records and release each stage on
  // its empty barrier, so the warpgroups never meet at a CTA barrier and their products interleave on the tensor
  // cores; the others refill a stage after a CTA barrier placed while the tensor cores update S. Either way the
  // output product of a wgmma CTA goes first, so that its stores overlap the state update.
  constexpr bool kProducer = kWgmma && kOutput && !kSelfFed && !kPrepFed;
  static_assert(!(kSelfFed && kPrepFed), "a ring is filled one way");
  static_assert(!kPrepFed || (kWgmma && kOutput), "the stream pass runs the finishing step of two warpgroups");
  constexpr bool kOutputFirst = kWgmma && kOutput;
  // The 8-warp scan runs two CTAs per SM on 128 registers: bf16(S) in four parts and S ⊙ 2^Γ after Pᵀ, so that
  // ptxas need not serialise the products (docs/DESIGN.md, "The step").
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
  if constexpr (!kSelfFed && !kPrepFed) {
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
  int stage_index = first_stage;
  uint32_t phase = first_phase;
  for (int i = 0; i < steps; ++i) {
    // Wait for this chunk: its value rows (this warp's own copies, the oldest group in flight) and its record.
    // With a producer warp, this warp first refills its value rows of the stage it used last step (no other
    // warp reads them); without one, every refill happens later in the step, after a CTA barrier.
    if constexpr (kSelfFed || kPrepFed) {
      // nothing of this warp's own in flight (the single pass: the caller's CTA barrier came first)
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
      } else if constexpr (!kSelfFed && !kPrepFed) {
        // While the tensor cores update S: every warp has finished the previous step (it waited for that step's
        // products before this one), so the stage of that step is free to refill.
        __syncthreads();
        fill_next();
      }
      wgmma_wait<0>();
      register_fence(s);
      register_fence(po);
      if constexpr (kProducer || kPrepFed) {
        // The products above were this stage's last readers: release it to the producer (or preparing) warps,
        // every thread for its own reads of the stage (an mbarrier arrival releases the arriving thread's accesses only; with one
        // arrival per warp after __syncwarp, compute-sanitizer's racecheck reported the refill's bulk copy against
        // the other lanes' reads of β and 2^Γ; per-thread arrivals measured the same time on the H200, 2026-12-01).
        // The __syncwarp orders every lane's ldmatrix of this stage's value rows before the next step's refill of
        // them by any lane.
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
      if constexpr (!kSelfFed && !kPrepFed) {
        __syncthreads();
        fill_next();
      }
    }

    if constexpr (kOutput && !kOutputFirst) store_outputs();
    if constexpr (!std::is_same_v<ChunkEnd, NoChunkEnd>) chunk_end(c0 + i + 1, s);
    out_chunk += chunk_stride;
    rows_math -= kChunk;
    stage_index = stage_index + 1 == kStages ? 0 : stage_index + 1;
    phase ^= stage_index == 0 ? 1u : 0u;
  }
  return static_cast<uint32_t>(stage_index) | (phase << 16);
}

}  // namespace kda
