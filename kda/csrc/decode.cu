// The decode kernel (plan.decode; docs/DESIGN.md, "The decode kernel"): short sequences, token by token, with the
// state in fp32 registers. The arithmetic is docs/NUMERICS.md's "The decode kernel", which
// flash_kda.numerics.decode_twin_forward re-enacts bit for bit: every fp32 step is an explicitly rounded
// intrinsic, the products that feed a sum or the state update are single-rounded FMAs (__fmaf_rn, 4 operations
// per state element and token instead of 6.5: the kernel is bound by them from 4 tokens per sequence on), and
// every sum over the 128 channels is 32 leaves of 4 channels (device_math.cuh, lane_leaf4) followed by the halving
// tree over the leaves (xor 16, 8, 4, 2, 1).
//
// Work items: (sequence n, head h, part) owns state rows part*64 .. part*64+63, a contiguous 64 x 128 block; 2 warps
// of 32 rows. In a warp, lane 4g + a owns rows g, g + 8, g + 16, g + 24 and, in each of them, the leaves j = 4m + a
// (m = 0..7; leaf j is columns 4j..4j+3): 4 x 32 fp32 state registers, twice v21's, so that each warp's token
// preparation is spread over twice the state. The halving tree pairs leaves j ^ 16, j ^ 8, j ^ 4 inside a lane and
// j ^ 2, j ^ 1 between the group's 4 lanes. Register slot k of group g holds leaf m = k ^ g: the tree pairs the
// same leaves (XOR commutes with the pairing), and the 8 groups of a warp read 8 different 32-byte pieces of a
// stage row at once (no bank conflicts). Every warp prepares each token itself (lane l: k̂, scale·q̂, α for channels
// 4l..4l+3, as in the chunked plans) at the end of the token before it, and hands it to its lanes through one of
// two shared-memory buffers, so warps never wait for each other inside an item. A call moves little more than its
// states (32-64 KB per head each way), so the kernel is a memory pipeline: persistent CTAs (as many as fit on the GPU)
// walk the items, and a ring of shared-memory stages holds the initial states of the next items, each brought by one
// bulk copy, while the current item computes. Rows of different items are disjoint and each item reads its rows before
// it writes them, so initial_state may be final_state.
// The call's input checks (input_checks.cuh) run here too: the decode plan launches this kernel alone.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

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
#include "kda/csrc/sm_count.h"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"
#include "kda/csrc/state_types.h"

namespace kda {
namespace {

constexpr int kDecodeWarps = 2;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeRowsPerWarp = 32;
constexpr int kDecodeRows = kDecodeWarps * kDecodeRowsPerWarp;  // state rows per CTA
constexpr int kDecodeParts = kHeadDim / kDecodeRows;               // CTAs per (sequence, head)
static_assert(kDecodeParts * kDecodeRows == kHeadDim, "the items of a head cover its 128 rows");
constexpr int kDecodeItemElems = kDecodeRows * kHeadDim;  // one item's state block
constexpr int kLaneRows = 4;    // rows per lane: g + 8r
constexpr int kLaneLeaves = 8;  // leaves per lane and row: j = 4m + a
constexpr int kRowGroups = 8;   // g = lane / 4

// One token as every lane of a warp needs it, written by the lanes that prepared it (channel c at index c).
struct PreparedToken {
  float alpha[kHeadDim];
  float k_hat[kHeadDim];
  float q_tilde[kHeadDim];
};

// Ring stages per CTA: 2 x 16 KB for a bf16 state, 2 x 32 KB for an fp32 one, then each warp's two prepared tokens
// (6 KB): 4 CTAs per SM with a bf16 state (as many as the registers allow), 3 with an fp32 one. A third bf16 stage
// (v25) was no faster, and with the item's small loads issued early and used late, two were faster on one-token
// calls (docs/PERFORMANCE.md, "The token kernel's rounds and its item boundary").
template <typename InitT>
struct DecodeRing {
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = kDecodeItemElems * static_cast<int>(sizeof(InitT));
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kPreparedBytes = kDecodeWarps * 2 * static_cast<int>(sizeof(PreparedToken));
  static constexpr int kSmemBytes = kRingBytes + kPreparedBytes + kStages * static_cast<int>(sizeof(uint64_t));
};

// Item i: part = i % 2, head = (i / 2) % H, sequence = i / (2H) (a dense state's items are in memory order).
struct DecodeItem {
  int64_t n;
  int h;
  int part;
};
__device__ __forceinline__ DecodeItem decode_item(const FwdParams& p, int64_t item) {
  const int64_t pair = item / kDecodeParts;
  return {pair / p.heads, static_cast<int>(pair % p.heads), static_cast<int>(item % kDecodeParts)};
}
__device__ __forceinline__ size_t item_offset(const FwdParams& p, int64_t slot, const DecodeItem& it) {
  return state_offset(p, slot, it.h) + static_cast<size_t>(it.part) * kDecodeRows * kHeadDim;
}

// One thread starts bringing item `item`'s initial state into a ring stage: one bulk copy completing on the
// stage's barrier, or a plain arrival when the item starts from zeros (no state, or a padding slot).
template <typename InitT>
__device__ __forceinline__ void start_state_load(const FwdParams& p, int64_t item, InitT* stage, uint64_t* full) {
  const DecodeItem it = decode_item(p, item);
  const int64_t slot = state_slot(p, it.n);
  if (p.initial_state != nullptr && slot >= 0) {
    mbarrier_arrive_expect_tx(full, DecodeRing<InitT>::kStageBytes);
    bulk_copy_g2s(stage, static_cast<const InitT*>(p.initial_state) + item_offset(p, slot, it),
                  DecodeRing<InitT>::kStageBytes, full);
  } else {
    mbarrier_arrive(full);
  }
}
static_assert(prep::kChannelsPerLane == 4, "lane l owns channels 4l..4l+3");


// The in-lane part of the halving tree over one row's 8 leaves. x[k] is leaf 4m + a with m = k ^ g, so the leaf
// index bits 4, 3, 2 are m's bits 2, 1, 0, and slots k, k ^ 4 (then ^ 2, ^ 1) hold the tree's pairs of leaves.
__device__ __forceinline__ float lane_tree_8(const float (&x)[kLaneLeaves]) {
  const float a0 = __fadd_rn(x[0], x[4]), a1 = __fadd_rn(x[1], x[5]), a2 = __fadd_rn(x[2], x[6]),
              a3 = __fadd_rn(x[3], x[7]);
  return __fadd_rn(__fadd_rn(a0, a2), __fadd_rn(a1, a3));
}

// The group part of the halving tree for the lane's 4 rows (leaf index bits 1, 0 are the lane bits 1, 0), as a
// reduce-scatter: lane 4g + a ends with the sum of its row g + 8a.
__device__ __forceinline__ float group_reduce_scatter_4(const float (&x)[kLaneRows], int lane) {
  return reduce_scatter_4_rows<2, 1>(x, lane);
}

__device__ __forceinline__ void publish(PreparedToken& tok, int ch0, const LanePrep& lp) {
  store4(tok.alpha + ch0, lp.alpha);
  store4(tok.k_hat + ch0, lp.k_hat);
  store4(tok.q_tilde + ch0, lp.q_tilde);
}

// kCheckpoints: the call asks for checkpoints (a separate instantiation: the kernel runs near its register limit,
// and calls without them keep their machine code).
template <typename InitT, typename FinalT, GateKind kGate, bool kCheckpoints>
__global__ void __launch_bounds__(kDecodeThreads, 4) kda_decode_kernel(const FwdParams p) {
  using Ring = DecodeRing<InitT>;
  extern __shared__ __align__(128) unsigned char smem[];
  InitT* ring = reinterpret_cast<InitT*>(smem);
  PreparedToken* prepared = reinterpret_cast<PreparedToken*>(smem + Ring::kRingBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Ring::kRingBytes + Ring::kPreparedBytes);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ch0 = prep::kChannelsPerLane * lane;  // the channels this lane prepares
  const int group = lane >> 2, quarter = lane & 3;
  const int my_row = group + kRowGroups * quarter;  // the row whose sums this lane ends with (group_reduce_scatter_4)
  const int warp_row0 = warp * kDecodeRowsPerWarp;  // this warp's first row within the item's 64
  PreparedToken* my_prepared = prepared + 2 * warp;  // this warp's two buffers (tokens alternate)
  const int64_t items = p.num_seqs * p.heads * kDecodeParts;
  // Register slot k of this lane holds leaf m = k ^ group of its rows: columns col(k) .. col(k) + 3.
  auto col = [&](int k) { return 16 * (k ^ group) + 4 * quarter; };

  const int64_t last_check = last_check_item<kCheckpoints>(p);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kDecodeThreads + threadIdx.x; i <= last_check;
       i += static_cast<int64_t>(gridDim.x) * kDecodeThreads) {
    check_call_inputs<kCheckpoints>(p, i);
  }
  if (threadIdx.x == 0) {
    for (int st = 0; st < Ring::kStages; ++st) mbarrier_init(&full[st], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int st = 0; st < Ring::kStages; ++st) {
      const int64_t item = blockIdx.x + static_cast<int64_t>(st) * gridDim.x;
      if (item < items) start_state_load(p, item, ring + st * kDecodeItemElems, &full[st]);
    }
  }

  // The lane's rows are warp_row0 + group + 8r of the item.
  auto store_rows = [&](FinalT* item_dst, const float (&s)[kLaneRows][kLaneLeaves][4]) {
    FinalT* dst = item_dst + (warp_row0 + group) * kHeadDim;
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
      for (int k = 0; k < kLaneLeaves; ++k) store4(dst + kRowGroups * r * kHeadDim + col(k), s[r][k]);
    }
  };

  int st = 0;
  uint32_t parity = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const DecodeItem it = decode_item(p, item);
    const int h = it.h;
    const int row0 = it.part * kDecodeRows + warp_row0;  // this warp's first state row in the head
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, it.n, p.seqlen, p.total_tokens);

    // The item's first token, its state index and the gate's per-head parameters are in flight while the warp
    // waits for the state; the index and the parameters are used (widened) only once the state rows are read,
    // so that no instruction before the wait stalls on them.
    const SlotBits slot_bits = load_slot_bits(p, it.n);
    const int hk = key_head_of(p, h);
    RawToken next{};
    if (b.bos < b.eos) next = load_token(p, b.bos, h, hk, ch0, row0 + my_row);
    const HeadGateBits gate_bits = load_head_gate_bits(p, h, ch0);

    // The state rows, fp32 (a bf16 state widened exactly), or zeros; then the stage is free for a later item.
    float s[kLaneRows][kLaneLeaves][4];
    mbarrier_wait_parity_warp(&full[st], parity);
    const int64_t slot = slot_from_bits(p, slot_bits);
    if (p.initial_state != nullptr && slot >= 0) {
      const InitT* src = ring + st * kDecodeItemElems + (warp_row0 + group) * kHeadDim;
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
        for (int k = 0; k < kLaneLeaves; ++k) load4(src + kRowGroups * r * kHeadDim + col(k), s[r][k]);
      }
    } else {
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
        for (int k = 0; k < kLaneLeaves; ++k) s[r][k][0] = s[r][k][1] = s[r][k][2] = s[r][k][3] = 0.f;
      }
    }
    __syncthreads();  // every warp has its rows (and has read its last prepared token): the stage may be refilled
    if (threadIdx.x == 0) {
      const int64_t refill = item + static_cast<int64_t>(Ring::kStages) * gridDim.x;
      if (refill < items) start_state_load(p, refill, ring + st * kDecodeItemElems, &full[st]);
    }
    if (++st == Ring::kStages) st = 0, parity ^= 1u;

    // The per-token pass of a chunked plan stops after the tokens whose states it writes.
    const int64_t end = p.states_only && b.eos - b.bos > p.state_tokens ? b.bos + p.state_tokens : b.eos;
    // The gate's per-head parts (prepare_chunk.cuh's phase 1, the same instructions), then the first token's
    // preparation; each later one is prepared at the end of the token before it.
    const HeadGate hg = head_gate_from(p, gate_bits);
    LanePrep ahead = prepare_token<kGate>(p, hg, next);
    if (b.bos + 1 < end) next = load_token(p, b.bos + 1, h, hk, ch0, row0 + my_row);
    publish(my_prepared[0], ch0, ahead);
    __syncwarp();
    int buf = 0;
    for (int64_t t = b.bos; t < end; ++t) {
      const PreparedToken& tok = my_prepared[buf];
      const float beta = ahead.beta, v_in = ahead.v;
      const RawToken raw = next;  // token t + 1
      if (t + 2 < end) next = load_token(p, t + 2, h, hk, ch0, row0 + my_row);  // in flight during two tokens

      // Decay, then r = v − S·k̂ per row (the lane's 4 rows, one reduce-scatter in its group), u = β·r.
      float leaves[kLaneRows][kLaneLeaves];
      decay_and_key_leaves(s, leaves, tok.alpha, tok.k_hat, col);

      float sums[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_8(leaves[r]);
      const float u_mine = __fmul_rn(beta, __fsub_rn(v_in, group_reduce_scatter_4(sums, lane)));
      float u[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) u[r] = __shfl_sync(0xffffffffu, u_mine, 4 * group + r);

      // S += u·k̂ᵀ; then the output partials o = S·q̃.
      update_and_query_leaves(s, leaves, u, tok.k_hat, tok.q_tilde, col);
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_8(leaves[r]);
      const float o = group_reduce_scatter_4(sums, lane);
      if (!p.states_only) {
        static_cast<__nv_bfloat16*>(p.out)[(t * p.heads + h) * kHeadDim + row0 + my_row] = __float2bfloat16_rn(o);
      }
      // The next token's preparation into the other buffer: every lane read that one for the previous token
      // before the __syncwarp that ended it, and this one's __syncwarp makes the next token visible to all lanes.
      if (t + 1 < end) {
        ahead = prepare_token<kGate>(p, hg, raw);
        publish(my_prepared[buf ^ 1], ch0, ahead);
        __syncwarp();
        buf ^= 1;
      }

      // Per-token states: the state after this token into its slot (state_slots.cuh, token_slot).
      if (p.state_tokens > 0 && p.final_state != nullptr) {
        const int64_t ts = token_slot(p, it.n, t - b.bos);
        if (ts >= 0) store_rows(static_cast<FinalT*>(p.final_state) + item_offset(p, ts, it), s);
      }
      // Checkpoints: the state after every C tokens into its checkpoint slot (state_slots.cuh, checkpoint_slot).
      if (kCheckpoints && ((t - b.bos + 1) & (kChunk - 1)) == 0) {
        const int64_t cs = checkpoint_slot(p, it.n, (t - b.bos + 1) / kChunk, slot);
        if (cs >= 0 && p.final_state != nullptr) {
          store_rows(static_cast<FinalT*>(p.final_state) + item_offset(p, cs, it), s);
        }
      }
    }

    if (p.final_state != nullptr && slot >= 0 && p.state_tokens == 0) {
      store_rows(static_cast<FinalT*>(p.final_state) + item_offset(p, slot, it), s);
    }
  }
}

// Persistent CTAs: as many as fit on the device at once (occupancy queried once per kernel and device), never
// more than there are items.
template <typename InitT, typename FinalT, GateKind kGate, bool kCheckpoints>
void launch_gated(const FwdParams& p, cudaStream_t stream) {
  constexpr auto kernel = kda_decode_kernel<InitT, FinalT, kGate, kCheckpoints>;
  constexpr int kSmem = DecodeRing<InitT>::kSmemBytes;
  constexpr int kMaxDevices = 64;
  static int ctas_per_device[kMaxDevices] = {};
  int device = 0;
  KDA_CUDA_CHECK(cudaGetDevice(&device));
  opt_in_dynamic_smem<kernel>(kSmem);
  int resident = device < kMaxDevices ? ctas_per_device[device] : 0;
  if (resident == 0) {
    int per_sm = 0;
    const int sms = current_sm_count();
    KDA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDecodeThreads, kSmem));
    resident = sms * (per_sm > 0 ? per_sm : 1);
    if (device < kMaxDevices) ctas_per_device[device] = resident;
  }
  const int64_t items = p.num_seqs * p.heads * kDecodeParts;
  const int64_t grid = items < resident ? items : resident;
  kernel<<<static_cast<unsigned>(grid), kDecodeThreads, kSmem, stream>>>(p);
  KDA_CHECK_LAUNCH("kda_decode_kernel");
}

template <typename InitT, typename FinalT>
void launch_typed(const FwdParams& p, cudaStream_t stream) {
  with_gate(p.gate, [&](auto gate) {
    if (p.checkpoint_chunks > 0) return launch_gated<InitT, FinalT, decltype(gate)::value, true>(p, stream);
    launch_gated<InitT, FinalT, decltype(gate)::value, false>(p, stream);
  });
}

}  // namespace

void launch_decode(const FwdParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0) return;
  // A missing state takes the bf16 instantiation: its pointer is null, so the kernel never reads or writes it.
  with_state_types(p, [&](auto init, auto fin) {
    launch_typed<typename decltype(init)::type, typename decltype(fin)::type>(p, stream);
  });
}

}  // namespace kda
