// The stream pass (docs/DESIGN.md, "The stream pass") and its launcher for one (initial, final) state dtype pair,
// instantiated by stream_pass_<initial>_bf16.cu: the chunked arithmetic of the two stages for calls of many
// short sequences, in one persistent kernel that prepares chunks and steps through them side by side. The records
// and the step are the preparation kernel's and the finishing pass's (prepare_chunk.cuh, recurrence_step.cuh), so
// the bits are the chunked plans' and the twin is theirs.
//
// One CTA per SM takes the (sequence, head) items b, b + grid, ... in turn. Warps 0..7 (two warpgroups) hold the item's
// 128 state rows in fp32 registers and run the finishing step of two warpgroups (run_chunks with kPrepFed and
// kRingStages); warps 8..11 prepare the CTA's chunks in stream order (warp r takes positions r, r + 4, ...) straight
// into a ring of 6 shared-memory stages: the record, written where the finishing pass's bulk copy would put it, and the
// chunk's value rows by cp.async. With six stages for four preparing warps, warp r may start position p + 4 once the
// steps have released p - 2 (with four it waited for p itself). The lower-bound gate's chunks are prepared in the
// looped form (prepare_chunk.cuh, kLooped: raw q and k straight into the stage's record, phases 1 and 2b as loops,
// so that the preparing warps' code stays in the instruction cache; the same record bits), and a warp finishes a
// chunk's products only once its next chunk's loads are in flight, so that their memory round trip overlaps work
// (the warp then holds two stages for a while: kRingStages > kPrepWarps). A stage passes from the preparing warp to
// the step warps on its "full" mbarrier and back on its "empty" one. A bf16 initial state arrives two items ahead by
// two tensor-map copies (state_tensor_map.h) that one thread issues, swizzled by 128 bytes so that the step warps'
// 4-byte fragment loads are free of bank conflicts; an fp32 one the step warps load themselves. A final state leaves
// the same way back: each step warp writes its 16 rows into the item's stage and issues two tensor-map stores, and
// the stage takes the item after next only once those have read it.
// Where the two stages cost 3,018 bytes per token-head and the single pass runs preparation and steps in turns,
// this moves 1,282 and keeps both busy at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <type_traits>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/input_checks.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/recurrence_launch.cuh"
#include "kda/csrc/recurrence_ring.cuh"
#include "kda/csrc/recurrence_state_rows.cuh"
#include "kda/csrc/recurrence_step.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/sm_count.h"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"
#include "kda/csrc/state_tensor_map.h"

namespace kda {
namespace stream_pass {

constexpr int kStepWarps = 8;  // two warpgroups
constexpr int kStepRows = kHeadDim / kStepWarps;  // state rows per step warp
constexpr int kPrepWarps = 4;  // one warpgroup
constexpr int kThreads = (kStepWarps + kPrepWarps) * 32;
constexpr int kRingStages = 6;   // prepared chunks in flight
constexpr int kStateStages = 2;  // initial states in flight
static_assert(kStateStages == 2, "an item's stage takes its final state, then the item after next (my_stage ^ 1)");
using Ring = RecurrenceSmem<kStepWarps, kRingStages>;
// A state stage: two halves of 64 columns, each 128 rows of 128 bytes as the tensor map's 128-byte swizzle lays them.
constexpr int kStateHalfRowBytes = kStateBoxColumns * 2;
constexpr int kStateHalfBytes = kHeadDim * kStateHalfRowBytes;
constexpr int kStateStageBytes = 2 * kStateHalfBytes;

struct StreamSmem {
  static constexpr int kStateOffset = (Ring::kBytes + 1023) / 1024 * 1024;  // the swizzle's 1024-byte alignment
  static constexpr int kStateFullOffset = kStateOffset + kStateStages * kStateStageBytes;
  static constexpr int kStateSlotOffset = kStateFullOffset + kStateStages * 8;  // the stage's slot (int64), or -1
  static constexpr int kScratchOffset = (kStateSlotOffset + kStateStages * 8 + 127) / 128 * 128;
  static constexpr int kBytes = kScratchOffset + kPrepWarps * static_cast<int>(sizeof(prep::PrepScratch));
  static constexpr int kLaunchBytes = kBytes + 1024;  // room to align the ring's start
};
static_assert(StreamSmem::kLaunchBytes <= 227 * 1024, "one CTA per SM");
// A preparing warp holds chunk c (its phases 3 and 4 pending) while it waits for the stage of c + kPrepWarps, which
// the steps free once they are done with c + kPrepWarps - kRingStages: that must come before c.
static_assert(kRingStages > kPrepWarps, "a preparing warp would wait for a stage its held chunk blocks");

// Where a stage keeps the bf16 pair (columns 8·nt + 2·ti, +1) of a row r with r % 8 == gi: at the row's lane part
// (staged_row) plus the n-tile's piece (staged_piece). In half nt / 8, the 16-byte piece j = nt % 8 of a row sits at
// piece j ^ (r % 8) (the 128-byte swizzle), so a warp's 4-byte accesses of one n-tile meet 32 different banks.
template <typename Byte>
__device__ __forceinline__ Byte* staged_row(Byte* stage, int row, int ti) {
  return stage + row * kStateHalfRowBytes + 4 * ti;
}
__device__ __forceinline__ int staged_piece(int nt, int gi) {
  return (nt / 8) * kStateHalfBytes + ((nt % 8) ^ gi) * 16;
}

// The plane of (slot, head h) in a state tensor map (slot · H + h < 2^31: bf16_state_tensor_map).
__device__ __forceinline__ int state_plane(const FwdParams& p, int64_t slot, int64_t h) {
  return static_cast<int>(slot * p.heads + h);
}

// Starts loading `item`'s initial state into a stage (one thread): writes the state slot (its sequence's,
// state_slots.cuh) into the stage's word and arrives, expecting a bf16 state's bytes from the two tensor-map copies
// of its halves, or plainly for zeros or an fp32 state the step warps read themselves.
template <typename InitT>
__device__ __forceinline__ void start_state_load(const FwdParams& p, const CUtensorMap& state_map, int64_t item,
                                                 int64_t slot, uint8_t* smem, int stage) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + StreamSmem::kStateFullOffset) + stage;
  reinterpret_cast<int64_t*>(smem + StreamSmem::kStateSlotOffset)[stage] = slot;
  if (std::is_same_v<InitT, __nv_bfloat16> && p.initial_state != nullptr && slot >= 0) {
    mbarrier_arrive_expect_tx(full, kStateStageBytes);
    const int plane = state_plane(p, slot, item % p.heads);
    uint8_t* dst = smem + StreamSmem::kStateOffset + stage * kStateStageBytes;
    tensor_copy_3d_g2s(dst, &state_map, 0, 0, plane, full);
    tensor_copy_3d_g2s(dst + kStateHalfBytes, &state_map, kStateBoxColumns, 0, plane, full);
  } else {
    mbarrier_arrive(full);
  }
}

// This warp's 16 rows of a final state into a stage, laid out as load_staged_rows reads them.
__device__ __forceinline__ void write_staged_rows(uint8_t* stage, const StateRows& s, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint8_t* at = staged_row(stage, v_base + gi + 8 * half, ti);
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      *reinterpret_cast<__nv_bfloat162*>(at + staged_piece(nt, gi)) =
          __floats2bfloat162_rn(s[nt][2 * half], s[nt][2 * half + 1]);
    }
  }
}

// This warp's 16 state rows (StateRows layout) from a stage (staged_row, staged_piece).
__device__ __forceinline__ void load_staged_rows(StateRows& s, const uint8_t* stage, int v_base, int gi, int ti) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint8_t* at = staged_row(stage, v_base + gi + 8 * half, ti);
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      const auto* pair = reinterpret_cast<const __nv_bfloat16*>(at + staged_piece(nt, gi));
      load_pair<__nv_bfloat16>(pair, s[nt][2 * half], s[nt][2 * half + 1]);
    }
  }
}

// A preparing warp: the CTA's items r, r + P, ... (item i of the CTA is blockIdx.x + i·gridDim.x). Every item is
// one whole chunk (stream_pass_runs: fixed-length calls of 16 tokens), so a stream position is an item and no row
// is past the end: the warp visits only its own items, and `rows` is the constant kChunk.
template <GateKind kGate>
__device__ __forceinline__ void prepare_stream(const FwdParams& p, uint8_t* smem, int r, int lane) {
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Ring::kBarrierOffset);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + Ring::kEmptyOffset);
  auto* scratch = reinterpret_cast<prep::PrepScratch*>(smem + StreamSmem::kScratchOffset) + r;
  const uint32_t items = static_cast<uint32_t>(p.num_seqs * p.heads);  // (below 2^31: stream_pass_runs)
  const uint32_t heads = static_cast<uint32_t>(p.heads);
  const int64_t token_stride = static_cast<int64_t>(p.heads) * kHeadDim;
  const auto* v = static_cast<const __nv_bfloat16*>(p.v);
  // The lower-bound gate's looped form leaves a chunk's phases 3 and 4 (prep::chunk_products) until the warp's next
  // chunk has issued its loads: the held stage (or -1) and its β (lanes 0..15).
  int held_stage = -1;
  float held_beta = 0.f;
  auto finish_held = [&]() {
    if constexpr (kGate == GateKind::kLowerBound) {
      if (held_stage < 0) return;
      prep::finish_looped_chunk(smem + held_stage * Ring::kStageBytes, scratch->kd, held_beta, lane);
      fence_proxy_async_shared();  // the record's stores before the step warps' wgmma read it
      mbarrier_arrive(&full[held_stage]);
    }
  };
  uint32_t pos = static_cast<uint32_t>(r);
  for (uint32_t item = blockIdx.x + r * gridDim.x; item < items; item += kPrepWarps * gridDim.x, pos += kPrepWarps) {
    const int64_t n = item / heads;
    const int h = static_cast<int>(item % heads);
    const int stage_index = static_cast<int>(pos % kRingStages);
    mbarrier_wait_parity_warp(&empty[stage_index], ((pos / kRingStages) & 1u) ^ 1u);
    uint8_t* stage = smem + stage_index * Ring::kStageBytes;
    const int64_t t0 = n * kChunk;
    // The value rows, 16 bytes per lane and piece: lane l copies column piece l % 16 of rows l / 16, l / 16 + 2,
    // ...; the preparation's own wait for its copies covers these.
    const int lane_row = lane / (kHeadDim / 8), col = 8 * (lane % (kHeadDim / 8));
    const __nv_bfloat16* v_src = v + (t0 + lane_row) * token_stride + h * kHeadDim + col;
    uint8_t* v_dst = stage + Ring::kValueOffset + lane_row * Ring::kValueStride + 2 * col;
#pragma unroll
    for (int i = 0; i < kChunk * kHeadDim / 8 / 32; ++i) {
      cp_async_16(v_dst + 2 * i * Ring::kValueStride, v_src, 16);
      v_src += 2 * token_stride;
    }
    if constexpr (kGate == GateKind::kLowerBound) {
      // The previous chunk's products run while this one's loads are in flight.
      held_beta = prep::prepare_chunk<true, kGate, true>(p, h, t0, kChunk, stage, scratch->kd, lane, finish_held);
      held_stage = stage_index;
    } else {
      prep::prepare_chunk<false, kGate>(p, h, t0, kChunk, stage, scratch->kd, lane);
      fence_proxy_async_shared();  // the record's stores before the step warps' wgmma read it
      mbarrier_arrive(&full[stage_index]);
    }
  }
  finish_held();
}

}  // namespace stream_pass

template <typename InitT, typename FinalT, GateKind kGate, bool kHiLo>
__global__ void __launch_bounds__(stream_pass::kThreads, 1)
    kda_stream_pass_kernel(const FwdParams p, const __grid_constant__ CUtensorMap state_map,
                           const __grid_constant__ CUtensorMap final_map) {
  using namespace stream_pass;
  static_assert(std::is_same_v<FinalT, __nv_bfloat16>, "final states leave by the bf16 tensor map");
  extern __shared__ __align__(128) uint8_t dynamic_smem[];
  uint8_t* smem = aligned_ring(dynamic_smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t items = p.num_seqs * p.heads;

  const int64_t last_check = last_check_item<false>(p);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i <= last_check;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    check_call_inputs<false>(p, i);
  }
  uint64_t* ring_full = reinterpret_cast<uint64_t*>(smem + Ring::kBarrierOffset);
  uint64_t* state_full = reinterpret_cast<uint64_t*>(smem + StreamSmem::kStateFullOffset);
  if (threadIdx.x == 0) {
    for (int st = 0; st < kRingStages; ++st) {
      mbarrier_init(&ring_full[st], 32);                        // every lane of the preparing warp
      mbarrier_init(&ring_full[kRingStages + st], kStepWarps * 32);  // every step thread (Ring::kEmptyOffset)
    }
    for (int st = 0; st < kStateStages; ++st) mbarrier_init(&state_full[st], 1);
    mbarrier_init_fence();
  }
  __syncthreads();

  if (warp >= kStepWarps) {
    prepare_stream<kGate>(p, smem, warp - kStepWarps, lane);
    return;
  }

  const int gi = lane >> 2, ti = lane & 3;
  const int v_base = warp * kStepRows;
  const int64_t stride = gridDim.x;
  if (warp == 0 && lane == 0) {
    for (int st = 0; st < kStateStages; ++st) {
      const int64_t first = blockIdx.x + st * stride;
      if (first < items) start_state_load<InitT>(p, state_map, first, state_slot(p, first / p.heads), smem, st);
    }
  }
  int state_stage = 0;
  uint32_t state_phase = 0;
  uint32_t ring = 0;  // run_chunks's ring position: stage | parity << 16
  SlotBits refill_bits{0, 0};  // warp 0: the state index of the item the next item's start loads
  for (int64_t item = blockIdx.x; item < items; item += stride) {
    const int64_t n = item / p.heads;
    const int h = static_cast<int>(item % p.heads);
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
    const int64_t chunks = (b.eos - b.bos + kChunk - 1) / kChunk;

    mbarrier_wait_parity_warp(&state_full[state_stage], state_phase);
    const int64_t slot = reinterpret_cast<const int64_t*>(smem + StreamSmem::kStateSlotOffset)[state_stage];
    StateRows s;
    if (p.initial_state != nullptr && slot >= 0) {
      if constexpr (std::is_same_v<InitT, __nv_bfloat16>) {
        load_staged_rows(s, smem + StreamSmem::kStateOffset + state_stage * kStateStageBytes, v_base, gi, ti);
      } else {
        load_rows<InitT>(s, static_cast<const InitT*>(p.initial_state) + state_offset(p, slot, h), v_base, gi, ti);
      }
    } else {
      fill_rows(s, 0.f);
    }
    if (lane == 0) bulk_wait_read_all();  // this warp's last final state has left its stage
    // Every step warp has its rows and the previous item's final state has left the other stage (named barrier 1):
    // that stage takes the next item's state, whose index warp 0 loaded during the previous item.
    asm volatile("bar.sync 1, %0;" ::"n"(kStepWarps * 32) : "memory");
    const int my_stage = state_stage;
    if (item != blockIdx.x && item + stride < items && warp == 0 && lane == 0) {
      start_state_load<InitT>(p, state_map, item + stride, slot_from_bits(p, refill_bits), smem, my_stage ^ 1);
    }
    if (warp == 0 && item + 2 * stride < items) refill_bits = load_slot_bits(p, (item + 2 * stride) / p.heads);
    if (++state_stage == kStateStages) state_stage = 0, state_phase ^= 1u;

    ring = run_chunks<kStepWarps, true, true, true, kHiLo, kRingStages, false, NoChunkEnd, true>(
        p, smem, ring_full, n, h, b, 0, chunks, v_base, s, NoChunkEnd{}, static_cast<int>(ring & 0xFFFFu),
        ring >> 16);

    if (p.final_state != nullptr && slot >= 0) {
      // Through this item's stage (every warp has read its rows) and two tensor-map copies per warp.
      uint8_t* stage = smem + StreamSmem::kStateOffset + my_stage * kStateStageBytes;
      write_staged_rows(stage, s, v_base, gi, ti);
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) {
        const int plane = state_plane(p, slot, h);
        tensor_copy_3d_s2g(&final_map, 0, v_base, plane, stage + v_base * kStateHalfRowBytes);
        tensor_copy_3d_s2g(&final_map, kStateBoxColumns, v_base, plane,
                           stage + kStateHalfBytes + v_base * kStateHalfRowBytes);
        bulk_commit();
      }
    }
  }
  if (lane == 0) bulk_wait_read_all();  // the stages stay until the last copies have read them
}

template <typename InitT, typename FinalT>
void launch_stream_pass_typed(const FwdParams& p, cudaStream_t stream) {
  with_gate(p.gate, [&](auto gate) {
    with_hi_lo(p.lower_bound, [&](auto hi_lo) {
      constexpr auto kernel = kda_stream_pass_kernel<InitT, FinalT, decltype(gate)::value, decltype(hi_lo)::value>;
      const int sms = current_sm_count();
      opt_in_dynamic_smem<kernel>(stream_pass::StreamSmem::kLaunchBytes);
      const int64_t items = p.num_seqs * p.heads;
      const int64_t grid = items < sms ? items : sms;
      CUtensorMap state_map{};
      // (An empty pool has no slot to read: every index is out of it.)
      if (std::is_same_v<InitT, __nv_bfloat16> && p.initial_state != nullptr && p.pool_slots > 0) {
        state_map = bf16_state_tensor_map(p.initial_state, p.pool_slots, p.heads, kHeadDim, "initial_state");
      }
      CUtensorMap final_map{};  // one step warp's 16 rows a box
      if (p.final_state != nullptr && p.pool_slots > 0) {
        final_map = bf16_state_tensor_map(p.final_state, p.pool_slots, p.heads, stream_pass::kStepRows, "final_state");
      }
      kernel<<<static_cast<unsigned>(grid), stream_pass::kThreads, stream_pass::StreamSmem::kLaunchBytes, stream>>>(
          p, state_map, final_map);
      KDA_CHECK_LAUNCH("kda_stream_pass_kernel");
    });
  });
}

}  // namespace kda
