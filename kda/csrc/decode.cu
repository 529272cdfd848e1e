// The decode kernel (plan.decode; docs/DESIGN.md, "The decode kernel"): short sequences, token by token, with the
// state in fp32 registers. The arithmetic is docs/NUMERICS.md's "The decode kernel", which
// flash_kda.numerics.decode_twin_forward re-enacts bit for bit: every fp32 step is an explicitly rounded
// intrinsic, the products that feed a sum or the state update are single-rounded FMAs (__fmaf_rn, 4 operations
// per state element and token instead of 6.5: the kernel is bound by them from 4 tokens per sequence on), and
// every sum over the 128 channels is the lane leaf (device_math.cuh, lane_leaf4) followed by the halving tree over
// lanes (xor 16, 8, 4, 2, 1).
//
// Work items: (sequence n, head h, part) owns state rows part*64 .. part*64+63, a contiguous 64 x 128 block; 4 warps
// of 16 rows. Lane l owns columns 4l..4l+3 of each of its warp's rows: 16 x 4 fp32 state registers. Every warp
// prepares each token itself (k̂, scale·q̂, α for its 4 channels, β), so warps never wait for each other inside an
// item. A call moves little more than its states (32-64 KB per head each way), so the kernel is a memory pipeline:
// persistent CTAs (as many as fit on the GPU) walk the items, and a ring of shared-memory stages holds the initial
// states of the next items, each brought by one bulk copy, while the current item computes. Rows of different
// items are disjoint and each item reads its rows before it writes them, so initial_state may be final_state.
// The call's input checks (input_checks.cuh) run here too: the decode plan launches this kernel alone.
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
#include "kda/csrc/sm90_async.cuh"
#include "kda/csrc/smem_opt_in.h"
#include "kda/csrc/state_slots.cuh"

namespace kda {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeRowsPerWarp = 16;
constexpr int kDecodeRows = kDecodeWarps * kDecodeRowsPerWarp;  // state rows per CTA
constexpr int kDecodeParts = kHeadDim / kDecodeRows;               // CTAs per (sequence, head)
static_assert(kDecodeParts * kDecodeRows == kHeadDim, "the items of a head cover its 128 rows");
constexpr int kDecodeItemElems = kDecodeRows * kHeadDim;  // one item's state block

// Ring stages per CTA and CTAs per SM: 3 x 16 KB for a bf16 state, 2 x 32 KB for an fp32 one (192 KB per SM).
template <typename InitT>
struct DecodeRing {
  static constexpr int kStages = sizeof(InitT) == 2 ? 3 : 2;
  static constexpr int kStageBytes = kDecodeItemElems * static_cast<int>(sizeof(InitT));
  static constexpr int kSmemBytes = kStages * kStageBytes + kStages * static_cast<int>(sizeof(uint64_t));
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

// Four consecutive state elements (columns 4l..4l+3 of one row) widened to fp32 / stored from fp32.
__device__ __forceinline__ void load4(const float* src, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* src, float (&x)[4]) {
  prep::unpack4(*reinterpret_cast<const uint2*>(src), x);
}  // (both: from a ring stage in shared memory)
__device__ __forceinline__ void store4(float* dst, const float (&x)[4]) {
  *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* dst, const float (&x)[4]) {
  uint2 raw;
  raw.x = pack_bf16x2(x[0], x[1]);
  raw.y = pack_bf16x2(x[2], x[3]);
  *reinterpret_cast<uint2*>(dst) = raw;
}

// The whole-warp sum of one leaf per lane (the halving tree, as an xor butterfly: every lane gets it).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// One token's raw inputs as this lane reads them: its 4 channels of q, k and g, β's logit and v of row lane / 2.
struct RawToken {
  uint2 q, k, g;
  __nv_bfloat16 beta, v;
};

__device__ __forceinline__ RawToken load_token(const FwdParams& p, int64_t t, int h, int hk, int ch0, int v_row) {
  const int64_t base = (t * p.heads + h) * kHeadDim, key_base = (t * p.key_heads + hk) * kHeadDim;
  RawToken r;
  r.q = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.q) + key_base + ch0);
  r.k = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.k) + key_base + ch0);
  r.g = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.g) + base + ch0);
  r.beta = static_cast<const __nv_bfloat16*>(p.beta)[t * p.heads + h];
  r.v = static_cast<const __nv_bfloat16*>(p.v)[base + v_row];
  return r;
}

// kCheckpoints: the call asks for checkpoints (a separate instantiation: the kernel runs at its register limit, and
// calls without them keep their machine code).
template <typename InitT, typename FinalT, GateKind kGate, bool kCheckpoints>
__global__ void __launch_bounds__(kDecodeThreads, 4) kda_decode_kernel(const FwdParams p) {
  using Ring = DecodeRing<InitT>;
  extern __shared__ __align__(128) unsigned char smem[];
  InitT* ring = reinterpret_cast<InitT*>(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Ring::kStages * Ring::kStageBytes);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ch0 = prep::kChannelsPerLane * lane;
  const int my_row = lane >> 1;  // the row whose sums this lane ends with (reduce_scatter_16)
  const int warp_row0 = warp * kDecodeRowsPerWarp;  // this warp's first row within the item's 64
  const int64_t items = p.num_seqs * p.heads * kDecodeParts;

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

  int st = 0;
  uint32_t parity = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const DecodeItem it = decode_item(p, item);
    const int h = it.h;
    const int row0 = it.part * kDecodeRows + warp_row0;  // this warp's first state row in the head
    const SeqBounds b = seq_bounds(p.cu_seqlens, p.cu_seqlens_is_int64, it.n, p.seqlen, p.total_tokens);
    const int64_t slot = state_slot(p, it.n);

    // The item's first token and the gate's per-head parts (prepare_chunk.cuh's phase 1, the same instructions)
    // are in flight while the warp waits for the state.
    const int hk = key_head_of(p, h);
    RawToken next{};
    if (b.bos < b.eos) next = load_token(p, b.bos, h, hk, ch0, row0 + my_row);
    const HeadGate hg = head_gate(p, h, ch0);

    // The state rows, fp32 (a bf16 state widened exactly), or zeros; then the stage is free for a later item.
    float s[kDecodeRowsPerWarp][4];
    mbarrier_wait_parity_warp(&full[st], parity);
    if (p.initial_state != nullptr && slot >= 0) {
      const InitT* src = ring + st * kDecodeItemElems + warp_row0 * kHeadDim + ch0;
#pragma unroll
      for (int i = 0; i < kDecodeRowsPerWarp; ++i) load4(src + i * kHeadDim, s[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kDecodeRowsPerWarp; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    }
    __syncthreads();  // every warp has its rows: the stage may be refilled
    if (threadIdx.x == 0) {
      const int64_t refill = item + static_cast<int64_t>(Ring::kStages) * gridDim.x;
      if (refill < items) start_state_load(p, refill, ring + st * kDecodeItemElems, &full[st]);
    }
    if (++st == Ring::kStages) st = 0, parity ^= 1u;

    // The per-token pass of a chunked plan stops after the tokens whose states it writes.
    const int64_t end = p.states_only && b.eos - b.bos > p.state_tokens ? b.bos + p.state_tokens : b.eos;
    for (int64_t t = b.bos; t < end; ++t) {
      const RawToken cur = next;
      if (t + 1 < end) next = load_token(p, t + 1, h, hk, ch0, row0 + my_row);  // in flight during this token

      // The token's preparation: k̂ = k / ‖k‖, q̃ = (q / ‖q‖)·scale, α = 2^γ, β (gate.cuh).
      float kh[4], qt[4], alpha[4], gf[4];
      prep::unpack4(cur.k, kh);
      prep::unpack4(cur.q, qt);
      prep::unpack4(cur.g, gf);
      const float inv_k = prep::inv_norm(warp_sum(prep::sum_squares_4(kh)));
      const float inv_q = prep::inv_norm(warp_sum(prep::sum_squares_4(qt)));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        kh[c] = __fmul_rn(kh[c], inv_k);
        qt[c] = __fmul_rn(__fmul_rn(qt[c], inv_q), p.scale);
        alpha[c] = ex2_approx(gate_log2<kGate>(hg, c, gf[c]));
      }
      const float beta = beta_of(p, bf16_to_float(cur.beta));

      // Decay, then r = v − S·k̂ per row (16 sums in one reduce-scatter), u = β·r on lanes 2i, 2i + 1.
      float part[kDecodeRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kDecodeRowsPerWarp; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] = __fmul_rn(s[i][c], alpha[c]);
        part[i] = lane_leaf4(s[i], kh);
      }
      const float u_mine = __fmul_rn(beta, __fsub_rn(bf16_to_float(cur.v), reduce_scatter_16(part, lane)));

      // S += u·k̂ᵀ, u of row i from lane 2i; then the output partials o = S·q̃.
#pragma unroll
      for (int i = 0; i < kDecodeRowsPerWarp; ++i) {
        const float u = __shfl_sync(0xffffffffu, u_mine, 2 * i);
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] = __fmaf_rn(u, kh[c], s[i][c]);
        part[i] = lane_leaf4(s[i], qt);
      }
      const float o = reduce_scatter_16(part, lane);
      if ((lane & 1) == 0 && !p.states_only) {
        static_cast<__nv_bfloat16*>(p.out)[(t * p.heads + h) * kHeadDim + row0 + my_row] = __float2bfloat16_rn(o);
      }
      // Per-token states: the state after this token into its slot (state_slots.cuh, token_slot).
      if (p.state_tokens > 0 && p.final_state != nullptr) {
        const int64_t ts = token_slot(p, it.n, t - b.bos);
        if (ts >= 0) {
          FinalT* dst = static_cast<FinalT*>(p.final_state) + item_offset(p, ts, it) + warp_row0 * kHeadDim + ch0;
#pragma unroll
          for (int i = 0; i < kDecodeRowsPerWarp; ++i) store4(dst + i * kHeadDim, s[i]);
        }
      }
      // Checkpoints: the state after every C tokens into its checkpoint slot (state_slots.cuh, checkpoint_slot).
      if (kCheckpoints && ((t - b.bos + 1) & (kChunk - 1)) == 0) {
        const int64_t cs = checkpoint_slot(p, it.n, (t - b.bos + 1) / kChunk);
        if (cs >= 0 && p.final_state != nullptr) {
          FinalT* dst = static_cast<FinalT*>(p.final_state) + item_offset(p, cs, it) + warp_row0 * kHeadDim + ch0;
#pragma unroll
          for (int i = 0; i < kDecodeRowsPerWarp; ++i) store4(dst + i * kHeadDim, s[i]);
        }
      }
    }

    if (p.final_state != nullptr && slot >= 0 && p.state_tokens == 0) {
      FinalT* dst = static_cast<FinalT*>(p.final_state) + item_offset(p, slot, it) + warp_row0 * kHeadDim + ch0;
#pragma unroll
      for (int i = 0; i < kDecodeRowsPerWarp; ++i) store4(dst + i * kHeadDim, s[i]);
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
    int sms = 0, per_sm = 0;
    KDA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
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
  if (p.initial_is_fp32) {
    if (p.final_is_fp32) return launch_typed<float, float>(p, stream);
    return launch_typed<float, __nv_bfloat16>(p, stream);
  }
  if (p.final_is_fp32) return launch_typed<__nv_bfloat16, float>(p, stream);
  return launch_typed<__nv_bfloat16, __nv_bfloat16>(p, stream);
}

}  // namespace kda
