// The warp-specialised decode kernel (docs/DESIGN.md, "The warp-specialised decode kernel"): the decode plan's
// token-by-token calls of two or more tokens per sequence on average, bf16 states, no per-token states or
// checkpoints (decode_warp_specialised_runs). Its arithmetic is kda_decode_kernel's (decode.cu), bit for bit:
// the same prepared token, the same token sweeps (decode_token.cuh) and the same halving tree, only laid out over
// more warps.
//
// A CTA holds the states of two heads at once, one per group of 8 state warps: warp w of a group owns rows
// 16w .. 16w + 15, lane 8g + a owns rows g + 4r (r = 0..3) of those, row g + 4(i ^ a/2) in register row i, and, in
// each, the leaves j = 8m + a (m = 0..3; leaf j is columns 4j..4j+3): 64 fp32 state registers per lane, so an SM runs 4
// state warps per scheduler where kda_decode_kernel runs 2, and the state warps do nothing but the state's arithmetic.
// Two preparing warps per group (one per SM sub-partition with the other group's) take turns on the group's tokens,
// item after item, and hand each prepared token (α, k̂, q̃, v, β: 2 KB) to the 8 state warps through a ring of
// shared-memory slots and mbarriers, so a token is prepared once per head instead of once per warp. Each state warp's
// rows of the initial states arrive by one 4 KB bulk copy per head, on the warp's own barrier, into two shared-memory
// stages while the previous head computes (no group barrier between heads, so the warps of a group drift apart by up
// to the token ring); its final states leave through the same stage, each state warp writing its 16 rows there and
// issuing one 4 KB bulk copy, so that a lane's 16 stores to global memory become shared-memory stores the copy engine
// drains. A state warp finds each head's output offset, state offset and token count in its group's table in shared
// memory, which the lanes of one warp fill for 32 heads at once (no division, no memory round trip at a head's start).
// setmaxnreg moves the registers: 20 warps launched at 96 become 112 for the state warps and 32 for the preparing ones.
// The call's input checks (input_checks.cuh) run here too, as in kda_decode_kernel.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/decode_token.cuh"
#include "kda/csrc/device_math.cuh"
#include "kda/csrc/gate.cuh"
#include "kda/csrc/input_checks.cuh"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/prepare_chunk.cuh"
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/sm_count.h"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"

namespace kda {
namespace {

// One-token calls stay on kda_decode_kernel, which was faster there (H200, 2026-12-04, CUDA graphs, B128 T1 H32:
// 0.081 ms against 0.087 for this kernel's first form, docs/PERFORMANCE.md).
constexpr int64_t kMinTokensPerSeq = 2;
constexpr int kGroups = 2;        // heads a CTA holds at once
constexpr int kGroupWarps = 8;    // state warps per head
constexpr int kPrepWarps = 2;     // preparing warps per head
constexpr int kPrepBase = kGroups * kGroupWarps;  // the first preparing warp
constexpr int kThreads = (kPrepBase + kGroups * kPrepWarps) * 32;
constexpr int kTokenSlots = 8;    // prepared tokens in flight per group
constexpr int kStages = 2;        // initial states in flight per group
constexpr int kTableItems = 32;   // heads a group's table describes at once: one per lane of the warp filling it
static_assert(kStages == 2, "an item's stage takes its final state, then the item after next's initial one");
constexpr int kHeadElems = kHeadDim * kHeadDim;
constexpr int kRowsPerWarp = kHeadDim / kGroupWarps;  // 16
constexpr int kLaneRows = 4;      // rows per lane: g + 4r
constexpr int kLaneLeaves = 4;    // leaves per lane and row: j = 8m + a
static_assert(kGroupWarps * kRowsPerWarp == kHeadDim && kLaneRows * 4 == kRowsPerWarp, "a group covers a head");
static_assert(kLaneLeaves * 8 * prep::kChannelsPerLane == kHeadDim, "8 lanes of 4 leaves cover a row");
static_assert(kTokenSlots % kPrepWarps == 0 && (kPrepWarps & (kPrepWarps - 1)) == 0,
              "preparing warp r fills the slots r, r + P, ...");

// Registers: each SM sub-partition (warp i runs on partition i % 4) has 16,384, and setmaxnreg only moves those its
// warps hold at launch: 20 warps of 96 (4 state warps and 1 preparing warp per partition) become 4 x 112 + 1 x 32.
constexpr int kLaunchRegs = 96;
constexpr int kStateRegs = 112;
constexpr int kPrepRegs = 32;
static_assert(kPrepBase % 4 == 0 && kGroups * kPrepWarps == 4, "state warps fill whole warpgroups; one preparing "
              "warp per sub-partition");
static_assert(kPrepBase / 4 * kStateRegs + kPrepRegs <= (kPrepBase / 4 + 1) * kLaunchRegs,
              "the raised limits fit what the warps were launched with (else setmaxnreg.inc waits forever)");
static_assert((kPrepBase / 4 + 1) * 32 * kLaunchRegs <= kSubPartitionRegs, "a sub-partition's registers at launch");
static_assert(kThreads * kLaunchRegs <= 65536, "the CTA's registers at launch");

// One prepared token as every state warp of a group reads it (channel c at index c).
struct PreparedChannels {
  float alpha[kHeadDim], k_hat[kHeadDim], q_tilde[kHeadDim], v[kHeadDim];
  float beta;
  float pad[3];
};
// What a state warp needs of one of its group's heads, found once for 32 heads by the 32 lanes of one warp: the
// output's element offset, the state's element offset in the pools (state_offset; −1: no slot, start from zeros and
// write nothing) and the token count.
struct HeadEntry {
  int64_t out_offset;
  int64_t state_offset;
  int64_t len;
};
struct GroupSmem {
  __nv_bfloat16 stage[kStages][kHeadElems];
  PreparedChannels token[kTokenSlots];
  HeadEntry heads[kTableItems];
  uint64_t stage_full[kStages][kGroupWarps];  // per state warp: its 16 rows of the stage
  uint64_t token_full[kTokenSlots], token_empty[kTokenSlots];
};
constexpr int kSmemBytes = kGroups * static_cast<int>(sizeof(GroupSmem));

// A preparing warp: warp r of group c takes the tokens at positions r, r + P, ... of the group's token stream (its
// heads' tokens in order, head by head), so its k-th token goes to slot (r + kP) mod kTokenSlots.
template <GateKind kGate>
__device__ __forceinline__ void prepare_tokens(const FwdParams& p, GroupSmem& gs, int64_t first_item, int64_t stride,
                                               int r, int lane) {
  const int64_t heads_total = p.num_seqs * p.heads;
  const int ch0 = prep::kChannelsPerLane * lane;
  uint32_t pos = static_cast<uint32_t>(r);  // this warp's next stream position
  uint32_t item_start = 0;                  // the stream position of the head's first token
  for (int64_t item = first_item; item < heads_total; item += stride) {
    const int64_t n = item / p.heads;
    const int h = static_cast<int>(item % p.heads);
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
    const uint32_t len = static_cast<uint32_t>(b.eos - b.bos);
    if (pos - item_start < len) {
      const int hk = key_head_of(p, h);
      const HeadGate hg = head_gate(p, h, ch0);
      for (; pos - item_start < len; pos += kPrepWarps) {
        const RawTokenChannels raw = load_token_channels(p, b.bos + (pos - item_start), h, hk, ch0);
        const LaneKeys lk = prepare_keys<kGate>(p, hg, raw, raw.beta);
        float v[4];
        prep::unpack4(raw.v, v);
        const int slot = static_cast<int>(pos % kTokenSlots);
        mbarrier_wait_parity_warp(&gs.token_empty[slot], ((pos / kTokenSlots) & 1u) ^ 1u);
        PreparedChannels& tok = gs.token[slot];
        store4(tok.alpha + ch0, lk.alpha);
        store4(tok.k_hat + ch0, lk.k_hat);
        store4(tok.q_tilde + ch0, lk.q_tilde);
        store4(tok.v + ch0, v);
        if (lane == 0) tok.beta = lk.beta;
        mbarrier_arrive(&gs.token_full[slot]);
      }
    }
    item_start += len;
  }
}

// The in-lane levels of the halving tree over one row's 4 leaves (leaf bits 4, 3 are m's bits 1, 0; slot k holds
// m = k, so slots k, k ^ 2, then k ^ 1 hold the tree's pairs).
__device__ __forceinline__ float lane_tree_4(const float (&x)[kLaneLeaves]) {
  return __fadd_rn(__fadd_rn(x[0], x[2]), __fadd_rn(x[1], x[3]));
}

// The cross-lane levels (leaf bits 2, 1, 0 are the lane's octant bits) for the lane's 4 rows, as a reduce-scatter:
// lanes 8g + 2i and 8g + 2i + 1 both end with the sum of row g + 4i, which they hold in register row 0.
__device__ __forceinline__ float octet_reduce_scatter(const float (&x)[kLaneRows]) {
  const float z = reduce_scatter_4_own_first<4, 2>(x);
  return __fadd_rn(z, __shfl_xor_sync(0xffffffffu, z, 1));
}

// The 8 state warps of group c meet (named barrier 1 + c; barrier 0 is the CTA's).
__device__ __forceinline__ void group_barrier(int c) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + c), "n"(kGroupWarps * 32) : "memory");
}

// Lane j of one warp enters the group's head `first + j·stride` (j < kTableItems) into the table, then the warp
// meets; the other state warps read it after their next group barrier.
__device__ __forceinline__ void fill_head_table(const FwdParams& p, GroupSmem& gs, int64_t first, int64_t stride,
                                                int lane) {
  const int64_t item = first + lane * stride;
  HeadEntry e{0, -1, 0};
  if (item < p.num_seqs * p.heads) {
    const int64_t n = item / p.heads;
    const int h = static_cast<int>(item % p.heads);
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, n, p.seqlen, p.total_tokens);
    const int64_t slot = state_slot(p, n);
    e.out_offset = (b.bos * p.heads + h) * kHeadDim;
    e.state_offset = slot >= 0 ? static_cast<int64_t>(state_offset(p, slot, h)) : -1;
    e.len = b.eos - b.bos;
  }
  gs.heads[lane] = e;
  __syncwarp();
}

// Lane 0 of state warp w starts bringing its 16 rows of a head's initial state (at its table entry's offset) into a
// stage: one 4 KB bulk copy completing on the warp's barrier of that stage, or a plain arrival when the head starts
// from zeros (no state, or a padding slot).
__device__ __forceinline__ void start_rows_load(const FwdParams& p, int64_t offset, GroupSmem& gs, int stage, int w) {
  uint64_t* full = &gs.stage_full[stage][w];
  if (p.initial_state != nullptr && offset >= 0) {
    constexpr uint32_t kBytes = kRowsPerWarp * kHeadDim * sizeof(__nv_bfloat16);
    const int rows = w * kRowsPerWarp * kHeadDim;  // the warp's first element, in the stage and in the state
    mbarrier_arrive_expect_tx(full, kBytes);
    bulk_copy_g2s(gs.stage[stage] + rows, static_cast<const __nv_bfloat16*>(p.initial_state) + offset + rows, kBytes,
                  full);
  } else {
    mbarrier_arrive(full);
  }
}

template <GateKind kGate>
__global__ void __launch_bounds__(kThreads, 1) kda_decode_ws_kernel(const FwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  GroupSmem* groups = reinterpret_cast<GroupSmem*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t heads_total = p.num_seqs * p.heads;
  // Group c of CTA b takes the heads (sequence n, head h) = item / H, item % H for item = 2b + c, 2b + c + 2·grid...
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroups;

  const int64_t last_check = last_check_item<false>(p);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i <= last_check;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    check_call_inputs<false>(p, i);
  }
  if (threadIdx.x == 0) {
    for (int c = 0; c < kGroups; ++c) {
      for (int st = 0; st < kStages; ++st) {
        for (int w = 0; w < kGroupWarps; ++w) mbarrier_init(&groups[c].stage_full[st][w], 1);
      }
      for (int s = 0; s < kTokenSlots; ++s) {
        mbarrier_init(&groups[c].token_full[s], 32);             // every lane of the preparing warp
        mbarrier_init(&groups[c].token_empty[s], kGroupWarps * 32);  // every lane of every state warp
      }
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (warp >= kPrepBase) {
    setmaxnreg_dec<kPrepRegs>();
    const int pw = warp - kPrepBase;
    const int c = pw / kPrepWarps;
    prepare_tokens<kGate>(p, groups[c], static_cast<int64_t>(blockIdx.x) * kGroups + c, stride, pw % kPrepWarps,
                          lane);
    return;
  }

  setmaxnreg_inc<kStateRegs>();
  const int c = warp / kGroupWarps, group_warp = warp % kGroupWarps;
  GroupSmem& gs = groups[c];
  const int row_group = lane >> 3, octant = lane & 7;
  const int own = octant >> 1;  // which of its 4 rows the lane ends with the sums of (octet_reduce_scatter)
  const int my_row = row_group + 4 * own;
  // Register row i holds row row_group + 4 * (i ^ own): the lane's own row is register row 0.
  auto row_of = [&](int i) { return row_group + 4 * (i ^ own); };
  const int warp_row0 = group_warp * kRowsPerWarp;
  // Register slot k holds leaf k of the lane's rows: the 4 row groups read the same 128 bytes of a token's vectors at
  // once (one broadcast), where a head's stage rows, read and written once, take 4 wavefronts an access, not 2.
  auto col = [&](int k) { return 32 * k + 4 * octant; };

  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * kGroups + c;
  // The heads' table (the first 32; then refilled after every 32nd head), then each warp's rows of the first two
  // initial states.
  if (group_warp == 0) fill_head_table(p, gs, first_item, stride, lane);
  group_barrier(c);
  if (lane == 0) {
    for (int st = 0; st < kStages; ++st) {
      if (first_item + st * stride < heads_total) start_rows_load(p, gs.heads[st].state_offset, gs, st, group_warp);
    }
  }
  int st = 0, slot = 0, entry = 0;
  uint32_t stage_parity = 0, token_parity = 0;
  for (int64_t item = first_item; item < heads_total; item += stride) {
    const HeadEntry head = gs.heads[entry];

    // The state rows, fp32 (bf16 widened exactly), or zeros.
    float s[kLaneRows][kLaneLeaves][4];
    mbarrier_wait_parity_warp(&gs.stage_full[st][group_warp], stage_parity);
    if (p.initial_state != nullptr && head.state_offset >= 0) {
      const __nv_bfloat16* src = gs.stage[st] + warp_row0 * kHeadDim;
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
        for (int k = 0; k < kLaneLeaves; ++k) load4(src + row_of(r) * kHeadDim + col(k), s[r][k]);
      }
    } else {
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
        for (int k = 0; k < kLaneLeaves; ++k) s[r][k][0] = s[r][k][1] = s[r][k][2] = s[r][k][3] = 0.f;
      }
    }
    const int my_stage = st;
    // After this head's last entry every warp meets twice: all have read it, then the table holds the next 32 heads.
    const bool refill = entry == kTableItems - 1 && item + stride < heads_total;
    if (refill) {
      group_barrier(c);
      if (group_warp == 0) fill_head_table(p, gs, item + stride, stride, lane);
      group_barrier(c);
    }
    // The warp has its rows and its previous final state has left the other stage: its rows there take the next
    // item's state, whatever the other warps are doing (the __syncwarp orders the lanes' earlier reads of them).
    __syncwarp();
    if (lane == 0 && item != first_item && item + stride < heads_total) {
      bulk_wait_read_all();
      start_rows_load(p, gs.heads[refill ? 0 : entry + 1].state_offset, gs, my_stage ^ 1, group_warp);
    }
    if (++st == kStages) st = 0, stage_parity ^= 1u;

    // The output element of this lane's sums, token after token (a pointer rather than the token index: registers).
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + head.out_offset + warp_row0 + my_row;
    for (int64_t left = head.len; left > 0; --left) {
      mbarrier_wait_parity_warp(&gs.token_full[slot], token_parity);
      const PreparedChannels& tok = gs.token[slot];
      const float beta = tok.beta, v_in = tok.v[warp_row0 + my_row];

      // Decay, then r = v − S·k̂ per row (the lane's 4 rows, one reduce-scatter in its octet), u = β·r.
      float leaves[kLaneRows][kLaneLeaves];
      decay_and_key_leaves(s, leaves, tok.alpha, tok.k_hat, col);
      float sums[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_4(leaves[r]);
      const float u_mine = __fmul_rn(beta, __fsub_rn(v_in, octet_reduce_scatter(sums)));
      // Register row r's u is that of lane ^ 2r, whose own row it is (both lanes of a pair hold their row's u);
      // r = 0 shuffles too (xor 0): u_mine kept aside cost registers and spills.
      float u[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) u[r] = __shfl_xor_sync(0xffffffffu, u_mine, 2 * r);

      // S += u·k̂ᵀ; then the output partials o = S·q̃.
      update_and_query_leaves(s, leaves, u, tok.k_hat, tok.q_tilde, col);
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_4(leaves[r]);
      // This lane has read the slot: its release to the preparing warps. Every lane arrives (rather than one
      // after a __syncwarp), so that each reader's own arrival orders its reads before the slot's next writes.
      mbarrier_arrive(&gs.token_empty[slot]);
      if (++slot == kTokenSlots) slot = 0, token_parity ^= 1u;
      const float o = octet_reduce_scatter(sums);
      if ((octant & 1) == 0) *out = __float2bfloat16_rn(o);
      out += static_cast<int64_t>(p.heads) * kHeadDim;
    }

    if (p.final_state != nullptr && head.state_offset >= 0) {
      // Through this item's stage (every warp has read its rows) and one bulk copy of the warp's 16 rows.
      __nv_bfloat16* rows = gs.stage[my_stage] + warp_row0 * kHeadDim;
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
        for (int k = 0; k < kLaneLeaves; ++k) store4(rows + row_of(r) * kHeadDim + col(k), s[r][k]);
      }
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) {
        bulk_copy_s2g(static_cast<__nv_bfloat16*>(p.final_state) + head.state_offset + warp_row0 * kHeadDim,
                      rows, kRowsPerWarp * kHeadDim * sizeof(__nv_bfloat16));
        bulk_commit();
      }
    }
    entry = refill ? 0 : entry + 1;
  }
  if (lane == 0) bulk_wait_read_all();  // the stages stay until the last copies have read them
}

// One CTA per SM (its 640 threads hold the SM's registers), never more CTAs than pairs of heads.
template <GateKind kGate>
void launch_gated(const FwdParams& p, cudaStream_t stream) {
  constexpr auto kernel = kda_decode_ws_kernel<kGate>;
  const int sms = current_sm_count();
  opt_in_dynamic_smem<kernel>(kSmemBytes);
  const int64_t heads_total = p.num_seqs * p.heads;
  const int64_t pairs = (heads_total + kGroups - 1) / kGroups;
  const int64_t grid = pairs < sms ? pairs : sms;
  kernel<<<static_cast<unsigned>(grid), kThreads, kSmemBytes, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_decode_ws_kernel");
}

}  // namespace

bool decode_warp_specialised_runs(const FwdParams& p) {
  return !p.initial_is_fp32 && !p.final_is_fp32 && p.checkpoint_chunks == 0 && p.state_tokens == 0 &&
         !p.states_only && p.total_tokens >= kMinTokensPerSeq * p.num_seqs;
}

void launch_decode_warp_specialised(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  with_gate(p.gate, [&](auto gate) { launch_gated<decltype(gate)::value>(p, stream); });
}

}  // namespace kda
