// The KDA forward: the preparation kernel fills the workspace; with a time split the scan pass and the
// composition turn it into every segment's start state; then the recurrence's finishing pass runs. Under a
// single-pass plan one kernel does both stages and the workspace holds nothing; under a decode plan one kernel
// runs the call with no workspace either: the stream pass (stream_pass.cuh, the chunked arithmetic with its
// records in shared memory), the chunk step (decode_chunk.cu, 16 tokens per tensor-core step) or token by token
// (decode_warp_specialised.cu, decode.cu), the state in registers; under an overlap plan the
// preparation kernel does a lead of chunks and its tail kernel the rest beside the finishing pass (both launched
// as programmatic dependents, kda_params.h "The overlap"). All are enqueued on the caller's stream; nothing here
// synchronises or allocates.
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"
#include "kda/csrc/sm_count.h"

namespace kda {
namespace {

// The chunked plans: the boundary check, then the single pass, the overlap or the two stages.
void run_chunked(const FwdParams& p, cudaStream_t stream) {
  const bool overlap = p.lead_chunks >= 0;
  const int64_t tail_items = overlap_tail_items(p.seqlen, p.num_seqs, p.heads, p.lead_chunks);
  launch_boundary_check(p, stream);
  if (p.num_seqs == 0 || p.heads == 0) return;
  if (p.single_pass) {
    launch_single_pass(p, stream);
    return;
  }
  const bool split = p.segment_chunks > 0;
  if (split && p.cu_seqlens != nullptr) {
    // All ones = "no scanned segment starts here"; the preparation kernel fills in the others.
    KDA_CUDA_CHECK(cudaMemsetAsync(window_table(p), 0xFF,
                                   window_table_bytes(p.total_tokens, p.num_seqs, p.segment_chunks), stream));
  }
  if (overlap && tail_items > 0) {
    // The overlap: the lead, which zeroes the ready flags (a memset where there is no lead); the tail and the
    // recurrence, each a programmatic dependent of the kernel before it (kda_params.h, "The overlap").
    if (p.lead_chunks == 0) {
      KDA_CUDA_CHECK(cudaMemsetAsync(overlap_flags(p), 0, static_cast<size_t>(tail_items) * sizeof(uint32_t), stream));
    }
    launch_prepare(p, stream);
    launch_prepare_tail(p, stream);
    launch_recurrence(p, stream);
    return;
  }
  FwdParams plain = p;
  plain.lead_chunks = -1;  // a lead of the whole sequence leaves no tail: the ordinary two stages
  launch_prepare(plain, stream);
  if (split) {
    launch_segment_scan(p, stream);
    launch_segment_compose(p, stream);
  }
  launch_recurrence(plain, stream);
}

}  // namespace

void fwd(const FwdParams& p, cudaStream_t stream) {
  const std::string plan_problem = plan_error(plan_of(p), p.cu_seqlens != nullptr, p.num_seqs, p.gate);
  if (!plan_problem.empty()) throw std::invalid_argument(plan_problem);
  const int64_t tail_items = overlap_tail_items(p.seqlen, p.num_seqs, p.heads, p.lead_chunks);
  const size_t needed = workspace_bytes(p.total_tokens, p.num_seqs, p.heads, p.segment_chunks, p.single_pass,
                                        tail_items, p.longest_first, p.decode);
  if (p.workspace_bytes < needed) {
    throw std::invalid_argument("flash_kda: workspace has " + std::to_string(p.workspace_bytes) +
                                " bytes, the call needs " + std::to_string(needed));
  }
  if (p.decode && p.num_seqs > 0 && p.heads > 0) {
    // Either kernel runs the input checks itself.
    if (stream_pass_runs(p.cu_seqlens != nullptr, p.seqlen, p.state_tokens, p.checkpoint_chunks > 0,
                         p.final_state != nullptr && p.final_is_fp32, p.num_seqs * p.heads, current_sm_count())) {
      launch_stream_pass(p, stream);
    } else if (decode_chunk_runs(p.total_tokens, p.num_seqs, p.state_tokens)) {
      launch_decode_chunk(p, stream);
    } else if (decode_warp_specialised_runs(p)) {
      launch_decode_warp_specialised(p, stream);
    } else {
      launch_decode(p, stream);
    }
    return;
  }
  if (p.state_tokens > 0) {
    // Per-token states under a chunked plan: the plan's kernels compute the output from each sequence's starting
    // slot and write no state; then the per-token pass (the decode kernel over each sequence's first state_tokens
    // tokens) reads the same starting slots and writes the states after those tokens. In that order, so that no
    // starting slot is overwritten before both have read it (a token's slot may be a starting one: in place).
    FwdParams chunked = p;
    chunked.final_state = nullptr;
    run_chunked(chunked, stream);
    if (p.final_state != nullptr && p.num_seqs > 0 && p.heads > 0) {
      FwdParams tokens = p;
      tokens.states_only = true;
      tokens.decode = true;
      launch_decode(tokens, stream);
    }
    return;
  }
  run_chunked(p, stream);
}

}  // namespace kda
