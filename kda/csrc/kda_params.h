// KDA forward: launch parameters, compile-time shape constants and the workspace layout shared by the
// preparation kernel (writer) and the recurrence kernel (reader). Plain C++: the pybind binding includes it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kda {

constexpr int kHeadDim = 128;  // K = V = 128: the only head size the kernel is built for.
constexpr int kChunk = 16;     // tokens per chunk: keeps 2^{±G} inside bf16/fp32 range at lower_bound = -5.

// One (chunk slot, head) record of the workspace, written by the preparation kernel. The records are
// contiguous, and each is stored as the recurrence kernel's shared-memory image of it: one bulk copy moves a
// record into shared memory, where every fragment load (ldmatrix) is free of bank conflicts thanks to the
// swizzles below. The swizzles only move 16-byte pieces, so they change no value.
struct ChunkRecordLayout {
  static constexpr int kKdOffset = 0;                                      // bf16 [kChunk][kHeadDim]: k̂ ⊙ 2^G
  static constexpr int kQdOffset = kKdOffset + kChunk * kHeadDim * 2;      // bf16 [kChunk][kHeadDim]: scale·q̂ ⊙ 2^G
  static constexpr int kKrTOffset = kQdOffset + kChunk * kHeadDim * 2;     // bf16 [kHeadDim][kChunk]: (k̂ ⊙ 2^{Γ-G})ᵀ
  static constexpr int kInvOffset = kKrTOffset + kChunk * kHeadDim * 2;    // bf16 [kChunk][kChunk]: (I + A)⁻¹
  static constexpr int kMqkOffset = kInvOffset + kChunk * kChunk * 2;      // bf16 [kChunk][kChunk]: lower(Qd Kiᵀ)
  static constexpr int kDecayOffset = kMqkOffset + kChunk * kChunk * 2;    // fp32 [kHeadDim]: 2^Γ
  static constexpr int kBetaOffset = kDecayOffset + kHeadDim * 4;          // fp32 [kChunk]: sigmoid(beta)
  static constexpr int kBytes = kBetaOffset + kChunk * 4;                  // 13,888 bytes
};
static_assert(ChunkRecordLayout::kBytes % 16 == 0, "records must stay 16-byte aligned");

// Element index of (row, col) in a swizzled bf16 [rows][128] matrix (Kd, Qd): the 16-byte piece col / 8 of
// row r is stored at piece (col / 8) ^ (r % 8), so the 8 rows an ldmatrix phase reads hit 8 different banks.
constexpr int swizzle_wide(int row, int col) {
  return row * kHeadDim + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Element index of (row, col) in a swizzled bf16 [rows][16] matrix (Krᵀ, INV, Mqk): rows are 32 bytes, so
// the half col / 8 of row r is stored at half (col / 8) ^ ((r / 4) % 2).
constexpr int swizzle_narrow(int row, int col) {
  return row * kChunk + ((((col >> 3) ^ ((row >> 2) & 1))) << 3) + (col & 7);
}

// Chunk slots: chunk j of sequence n (which starts at token bos_n) lives in slot floor(bos_n/16) + n + j.
// Slots are unique and fewer than floor(total_tokens/16) + num_seqs, computable without reading
// cu_seqlens on the host (so no synchronisation), and each kernel can find its own slots on the device.
constexpr int64_t num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / kChunk + num_seqs;
}

inline size_t workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t heads) {
  return static_cast<size_t>(num_chunk_slots(total_tokens, num_seqs)) * static_cast<size_t>(heads) *
         static_cast<size_t>(ChunkRecordLayout::kBytes);
}

// Everything one forward call needs. Tensor layouts (all contiguous):
//   q, k, g      bf16 [total_tokens, H, K]     (B*T flattened: token-major)
//   v, out       bf16 [total_tokens, H, V]
//   beta         bf16 [total_tokens, H]
//   A_log        fp32 [H];  dt_bias fp32 [H, K]
//   initial_state, final_state  bf16 or fp32 [N, H, V, K] (either may be null)
//   cu_seqlens   int32 or int64 [N + 1] or null (then sequence n is tokens [n*seqlen, (n+1)*seqlen))
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const float* A_log;
  const float* dt_bias;
  void* out;
  const void* initial_state;
  void* final_state;
  bool state_is_fp32;
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
  int v_split;  // recurrence CTAs per (sequence, head), each owning 128 / v_split state rows; 0: choose
};

}  // namespace kda
