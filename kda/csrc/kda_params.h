// KDA forward: launch parameters, compile-time shape constants and the workspace layout shared by the
// preparation kernel (writer) and the recurrence kernel (reader). Plain C++: the pybind binding includes it.
#pragma once

#include <cstddef>
#include <cstdint>

// Functions of this header that kernels call too (constexpr ones need no marking: nvcc runs with
// --expt-relaxed-constexpr).
#ifdef __CUDACC__
#define KDA_HOST_DEVICE __host__ __device__
#else
#define KDA_HOST_DEVICE
#endif

namespace kda {

constexpr int kHeadDim = 128;  // K = V = 128: the only head size the kernel is built for.
constexpr int kChunk = 16;     // tokens per chunk: keeps 2^{±G} inside bf16/fp32 range at lower_bound = -5.

// One (chunk slot, head) record of the workspace, written by the preparation kernel. The records are
// contiguous, and each is stored as the recurrence kernel's shared-memory image of it: one bulk copy moves a
// record into shared memory, where the tiles are wgmma's K-major B operands and every fragment load (ldmatrix)
// is free of bank conflicts thanks to the swizzles below. The swizzles only move 16-byte pieces, so they
// change no value.
struct ChunkRecordLayout {
  static constexpr int kKdQdOffset = 0;                                    // Kd and Qd interleaved (record_kq)
  static constexpr int kKrTOffset = kKdQdOffset + 4 * kChunk * kHeadDim;   // bf16 [kHeadDim][kChunk]: (k̂ ⊙ 2^{Γ-G})ᵀ
  static constexpr int kInvOffset = kKrTOffset + kChunk * kHeadDim * 2;    // bf16 [kChunk][kChunk]: (I + A)⁻¹
  static constexpr int kMqkOffset = kInvOffset + kChunk * kChunk * 2;      // bf16 [kChunk][kChunk]: lower(Qd Kiᵀ)
  static constexpr int kDecayOffset = kMqkOffset + kChunk * kChunk * 2;    // fp32 [kHeadDim]: 2^Γ
  static constexpr int kBetaOffset = kDecayOffset + kHeadDim * 4;          // fp32 [kChunk]: sigmoid(beta)
  static constexpr int kBytes = kBetaOffset + kChunk * 4;                  // 13,888 bytes
};
static_assert(ChunkRecordLayout::kBytes % 16 == 0, "records must stay 16-byte aligned");
static_assert(ChunkRecordLayout::kMqkOffset == ChunkRecordLayout::kInvOffset + 512,
              "the output's second product reads INV and Mqk as one 32-row operand (Mqk = rows 16..31)");

// Kd (tile 0: k̂ ⊙ 2^G) and Qd (tile 1: scale·q̂ ⊙ 2^G), bf16 [kChunk][kHeadDim] each, in two 4,096-byte blocks
// of columns 0..63 and 64..127; a block holds Kd's 16 rows then Qd's, 128 bytes per row, and the 16-byte piece
// (col % 64) / 8 of a row r is stored at piece ((col % 64) / 8) ^ (r % 8). That is wgmma's K-major 128-byte
// swizzle (1024-byte aligned in shared memory), so one product reads both tiles as a 32-row B operand; the
// 8 rows an ldmatrix phase reads hit 8 different banks. Returns the element index.
constexpr int record_kq(int tile, int row, int col) {
  return (col >> 6) * (2 * kChunk * 64) + tile * (kChunk * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) +
         (col & 7);
}

// Element index of (row, col) in a swizzled bf16 [rows][128] matrix (the preparation kernel's scratch tiles):
// the 16-byte piece col / 8 of row r is stored at piece (col / 8) ^ (r % 8), so the 8 rows an ldmatrix phase
// reads hit 8 different banks.
constexpr int swizzle_wide(int row, int col) {
  return row * kHeadDim + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Element index of (row, col) in a swizzled bf16 [rows][16] matrix (Krᵀ, INV, Mqk): rows are 32 bytes, so
// the half col / 8 of row r is stored at half (col / 8) ^ ((r / 4) % 2): wgmma's K-major 32-byte-swizzle
// layout (256-byte aligned in shared memory).
constexpr int swizzle_narrow(int row, int col) {
  return row * kChunk + ((((col >> 3) ^ ((row >> 2) & 1))) << 3) + (col & 7);
}

// Chunk slots: chunk j of sequence n (which starts at token bos_n) lives in slot floor(bos_n/16) + n + j.
// Slots are unique and fewer than floor(total_tokens/16) + num_seqs, computable without reading
// cu_seqlens on the host (so no synchronisation), and each kernel can find its own slots on the device.
constexpr int64_t num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / kChunk + num_seqs;
}

// ---- The time split (docs/DESIGN.md, "The time split") ------------------------------------------------------
// With segment_chunks = L > 0, sequence n is cut into G_n = max(1, ceil(chunks_n / L)) segments of L chunks
// (the last may be shorter). Segment j of sequence n has the segment slot floor(bos_n / (16 L)) + n + j
// (unique for the same reason as chunk slots): the finishing pass runs one CTA row per segment slot.
// Every segment but a sequence's last is "scanned": its affine map S_end = S_start · M + Q is computed from
// the identity (M) and from zero (Q). Windows cut the chunk-slot stream into pieces of L slots; at most one
// scanned segment starts in each window (a scanned segment is followed by L more chunks of its sequence), so
// per-window storage holds its map, and the window table says which segment that is.
constexpr int64_t num_segment_slots(int64_t total_tokens, int64_t num_seqs, int segment_chunks) {
  return total_tokens / (static_cast<int64_t>(kChunk) * segment_chunks) + num_seqs;
}
constexpr int64_t num_windows(int64_t total_tokens, int64_t num_seqs, int segment_chunks) {
  return (num_chunk_slots(total_tokens, num_seqs) + segment_chunks - 1) / segment_chunks;
}
// Segments of a sequence of `len` tokens: at least one, so that an empty sequence still has the CTA that
// writes its final state.
constexpr int64_t segment_count(int64_t len, int segment_chunks) {
  const int64_t chunks = (len + kChunk - 1) / kChunk;
  const int64_t count = (chunks + segment_chunks - 1) / segment_chunks;
  return count > 0 ? count : 1;
}

// One window table entry: the scanned segment (sequence n, segment j) whose first chunk slot lies in the
// window, or n = -1 (the table is set to all ones before the preparation kernel fills it).
struct WindowItem {
  int32_t n;
  int32_t j;
};

// Per (window, head) storage of the scanned segment that starts in the window, in the workspace after the
// window table:
//   M hi, M lo  bf16 128x128 each: the transition map M split as M = hi + lo (lo = bf16(M - hi)), stored in
//               mma B-fragment order for the composition kernel: uint2 {b0, b1} at [n-tile][k-step][lane].
//   Q / S_next  fp32 [128][128] (rows v): first Q, the segment's end state from zero; the composition
//               kernel overwrites it with the true start state of the sequence's next segment.
//   S_first     fp32 [128][128]: the start state of the sequence's first segment (its initial state or
//               zero), written by the composition kernel so that no CTA reads initial_state while another
//               writes final_state (they may be one tensor).
struct WindowLayout {
  static constexpr int kMBytes = kHeadDim * kHeadDim * 2;
  static constexpr int kStateBytes = kHeadDim * kHeadDim * 4;
  static constexpr int kMHiOffset = 0;
  static constexpr int kMLoOffset = kMHiOffset + kMBytes;
  static constexpr int kNextOffset = kMLoOffset + kMBytes;
  static constexpr int kFirstOffset = kNextOffset + kStateBytes;
  static constexpr int kBytes = kFirstOffset + kStateBytes;  // 196,608 bytes
};

constexpr size_t records_bytes(int64_t total_tokens, int64_t num_seqs, int64_t heads) {
  return static_cast<size_t>(num_chunk_slots(total_tokens, num_seqs)) * static_cast<size_t>(heads) *
         static_cast<size_t>(ChunkRecordLayout::kBytes);
}
constexpr size_t window_table_bytes(int64_t total_tokens, int64_t num_seqs, int segment_chunks) {
  const size_t raw = static_cast<size_t>(num_windows(total_tokens, num_seqs, segment_chunks)) * sizeof(WindowItem);
  return (raw + 127) / 128 * 128;
}

// ---- The overlap (docs/DESIGN.md, "The overlap") ------------------------------------------------------------
// Fixed-length batches whose recurrence leaves SMs free, without a time split: the preparation kernel first
// prepares the lead, chunks j < lead_chunks of every (sequence, head), on the whole GPU; then the tail kernel,
// one CTA on each SM the recurrence leaves free, prepares the other chunks in chunk-major order (j, n, h) while the
// recurrence runs, and publishes each record with a ready flag that the recurrence's producer warp waits for
// before copying it. The flags, one uint32 per tail item in that order, follow the records in the workspace and
// are zeroed at the start of every call (by the lead's threads; by a memset where the lead is empty).
constexpr int64_t overlap_tail_items(int64_t seqlen, int64_t num_seqs, int64_t heads, int lead_chunks) {
  if (lead_chunks < 0) return 0;
  const int64_t chunks = (seqlen + kChunk - 1) / kChunk;
  return chunks > lead_chunks ? (chunks - lead_chunks) * num_seqs * heads : 0;
}
// The tail item (and so the flag) of chunk j >= lead_chunks of sequence n, head h.
constexpr int64_t overlap_tail_item(int64_t j, int64_t n, int h, int lead_chunks, int64_t num_seqs, int heads) {
  return ((j - lead_chunks) * num_seqs + n) * heads + h;
}

// ---- Longest first (docs/DESIGN.md, "Longest first") --------------------------------------------------------
// A varlen batch whose finishing pass takes more than one wave of 8-warp CTAs runs them longest sequence first
// (all heads of the longest, then of the next), so that the longest do not start last: the boundary-check kernel
// ranks the sequences by length (ties by index) into an int32 table of N entries after the records.
constexpr int kLongestFirstMaxSeqs = 256;  // one CTA ranks them (kda_checks.cu)

// Workspace: the chunk records, then one of (by plan; they exclude each other): the time split's window table and
// per-(window, head) storage; the overlap's ready flags of the tail items; the longest-first order. Nothing under
// a single-pass plan (its records never leave shared memory) or a decode plan (no records at all).
constexpr size_t workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t heads, int segment_chunks,
                                 bool single_pass = false, int64_t tail_items = 0, bool longest_first = false,
                                 bool decode = false) {
  if (single_pass || decode) return 0;
  size_t bytes = records_bytes(total_tokens, num_seqs, heads) + static_cast<size_t>(tail_items) * sizeof(uint32_t);
  if (longest_first) bytes += static_cast<size_t>(num_seqs) * sizeof(int32_t);
  if (segment_chunks > 0) {
    bytes += window_table_bytes(total_tokens, num_seqs, segment_chunks) +
             static_cast<size_t>(num_windows(total_tokens, num_seqs, segment_chunks)) * static_cast<size_t>(heads) *
                 static_cast<size_t>(WindowLayout::kBytes);
  }
  return bytes;
}

// Element type of the gate parameters A_log and dt_bias (fla's layers hand them over in the model's dtype).
enum class ParamType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The gate (docs/SPEC.md §1), as the per-channel log decay of token t:
//   kLowerBound: lower_bound · sigmoid(e^A_log · (g_t + dt_bias)), in [lower_bound, 0];
//   kSoftplus:   −e^A_log · softplus(g_t + dt_bias), unbounded below (Kimi Linear's gate).
// A missing A_log counts as e^A_log = 1, a missing dt_bias as 0.
enum class GateKind : int { kLowerBound = 0, kSoftplus = 1 };

// Everything one forward call needs. Tensor layouts (all contiguous):
//   q, k         bf16 [total_tokens, key_heads, K]  (B*T flattened: token-major)
//   g            bf16 [total_tokens, H, K]
//   v, out       bf16 [total_tokens, H, V]
//   beta         bf16 [total_tokens, H]
//   A_log        fp32, bf16 or fp16 [H] or null;  dt_bias fp32, bf16 or fp16 [H, K] or null (widened to fp32)
//   initial_state, final_state  bf16 or fp32 [N, H, V, K], each its own dtype (either may be null)
//   cu_seqlens   int32 or int64 [N + 1] or null (then sequence n is tokens [n*seqlen, (n+1)*seqlen))
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const void* A_log;
  const void* dt_bias;
  ParamType A_log_type;
  ParamType dt_bias_type;
  void* out;
  const void* initial_state;
  void* final_state;
  bool initial_is_fp32;
  bool final_is_fp32;
  const void* cu_seqlens;
  bool cu_seqlens_is_int64;
  int64_t total_tokens;  // B * T
  int64_t seqlen;        // T (used when cu_seqlens is null)
  int64_t num_seqs;      // N
  int heads;             // H
  float scale;
  float lower_bound;
  void* workspace;
  size_t workspace_bytes;
  // The device's error word (or null): the boundary-check kernel (kda_checks.cu) or the decode kernels
  // (input_checks.cuh) atomically lower it to the first malformed index they find (flash_kda.last_error reads
  // and resets it). Untouched by well-formed calls.
  unsigned long long* status;
  // The plan (kda::Plan in kda_plan.h, copied field by field; plan_of reads it back), resolved by the caller:
  int v_split;         // finishing-pass CTAs per (segment, head), each owning 128 / v_split state rows
  int scan_v_split;    // scan-pass CTAs per (scanned segment, head) and map (P or Q)
  int segment_chunks;  // chunks per time segment; 0: no time split
  bool single_pass;    // one kernel prepares and runs each (sequence, head); needs v_split 1 and no time split
  int lead_chunks;     // the overlap: chunks per sequence prepared before the recurrence starts; -1: no overlap
  int tail_ctas;       // the overlap: CTAs of the tail kernel, one per SM the recurrence leaves free
  bool longest_first;  // varlen, v_split 1, no time split: the finishing pass runs the longest sequences first
  // (Fields below were appended after the kernels above were tuned: appending keeps every earlier field's offset,
  // and so the machine code of kernels that do not read them.)
  bool decode;         // the decode plan (kda_fwd.cu): short sequences, the state in fp32 registers, token by token
                       // (decode.cu, decode_warp_specialised.cu), 16 tokens a step (decode_chunk.cu), or the
                       // chunked arithmetic in one persistent kernel (stream_pass.cuh)
  // Pooled states, or null: sequence n's state is entry n of the state tensors. With indices, initial_state and final_state are pools [pool_slots, H, V, K] and sequence n uses slot
  // state_indices[n] (state_slot, state_slots.cuh): a negative index, or one outside [0, pool_slots), means no
  // state (start from zeros, write nothing); an index >= pool_slots is also reported through `status`.
  const void* state_indices;  // int32 or int64 [N] on the device, or null
  bool state_indices_is_int64;
  int64_t pool_slots;  // P, the pools' first dimension (N without indices)
  // The model's options (gate.cuh). Grouped value heads: q and k have key_heads heads, everything else `heads`
  // (a multiple of key_heads); value head h reads key head h / (heads / key_heads).
  int key_heads;
  GateKind gate;
  float beta_scale;  // β = beta_scale · sigmoid(logit): 1, or 2 for negative eigenvalues
  // Per-token states (state_slots.cuh): with state_tokens = L > 0, state_indices is [N, L]; the state after token
  // t < L of sequence n goes to slot state_indices[n, t], and sequence n starts from slot state_indices[n, a - 1],
  // a = num_accepted[n] (1 when null; outside [1, L]: zeros). No other final state is written.
  int state_tokens;
  const void* num_accepted;  // int32 or int64 [N] on the device, or null
  bool num_accepted_is_int64;
  // The per-token pass of a chunked plan (kda_fwd.cu): the decode kernel over each sequence's first state_tokens
  // tokens, writing their states and no output.
  bool states_only;
  // Prefix-cache checkpoints (state_slots.cuh, checkpoint_slot), with pooled states: with checkpoint_chunks = C / 16
  // > 0, the state after the first (m + 1)·C tokens of sequence n (m < checkpoint_cols, (m + 1)·C <= its length)
  // goes to pool slot checkpoint_indices[n, m] of final_state, before the final state; negative or >= pool_slots:
  // none (the latter reported through `status`).
  const void* checkpoint_indices;  // int32 or int64 [N, checkpoint_cols] on the device, or null
  bool checkpoint_indices_is_int64;
  int64_t checkpoint_cols;
  int checkpoint_chunks;
};

// Grid columns (grid.x) of the passes of a call, and so how a CTA column finds its work:
//   fixed-length batches (no cu_seqlens): every sequence has G = segment_count(seqlen) segments, so columns
//     index the work directly: scan n * (G - 1) + j, composition n, finishing pass n * G + j;
//   varlen batches: scan and composition by window (through the window table, n = -1 where nothing starts),
//     the finishing pass by segment slot (a search over cu_seqlens).
// Without a time split the finishing pass has one column per sequence.
struct PassColumns {
  int64_t scan;
  int64_t compose;
  int64_t finish;
};
inline PassColumns pass_columns(const FwdParams& p) {
  const int L = p.segment_chunks;
  if (L <= 0) return {0, 0, p.num_seqs};
  if (p.cu_seqlens == nullptr) {
    const int64_t segments = segment_count(p.seqlen, L);
    return {p.num_seqs * (segments - 1), segments > 1 ? p.num_seqs : 0, p.num_seqs * segments};
  }
  const int64_t windows = num_windows(p.total_tokens, p.num_seqs, L);
  return {windows, windows, num_segment_slots(p.total_tokens, p.num_seqs, L)};
}

// The window in which segment j of the sequence that starts at token bos (sequence n) begins.
constexpr int64_t window_of(int64_t bos, int64_t n, int64_t j, int segment_chunks) {
  return (bos / kChunk + n + j * segment_chunks) / segment_chunks;
}

// Pointers into the workspace of a call (kda_params.h layout). What follows the records depends on the plan, and
// the three kinds exclude each other (workspace_bytes).
KDA_HOST_DEVICE inline uint8_t* after_records(const FwdParams& p) {
  return static_cast<uint8_t*>(p.workspace) + records_bytes(p.total_tokens, p.num_seqs, p.heads);
}
KDA_HOST_DEVICE inline WindowItem* window_table(const FwdParams& p) {
  return reinterpret_cast<WindowItem*>(after_records(p));
}
KDA_HOST_DEVICE inline uint32_t* overlap_flags(const FwdParams& p) {
  return reinterpret_cast<uint32_t*>(after_records(p));
}
KDA_HOST_DEVICE inline int32_t* longest_first_order(const FwdParams& p) {
  return reinterpret_cast<int32_t*>(after_records(p));
}
KDA_HOST_DEVICE inline uint8_t* window_data(const FwdParams& p, int64_t window, int head) {
  return reinterpret_cast<uint8_t*>(window_table(p)) +
         window_table_bytes(p.total_tokens, p.num_seqs, p.segment_chunks) +
         (static_cast<size_t>(window) * p.heads + head) * static_cast<size_t>(WindowLayout::kBytes);
}

}  // namespace kda
