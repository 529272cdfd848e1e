// The KDA forward: the preparation kernel fills the workspace, then the recurrence kernel consumes it.
// Both are enqueued on the caller's stream; nothing here synchronises or allocates.
#include <stdexcept>
#include <string>

#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"

namespace kda {

void fwd(const FwdParams& p, cudaStream_t stream) {
  const size_t needed = workspace_bytes(p.total_tokens, p.num_seqs, p.heads);
  if (p.workspace_bytes < needed) {
    throw std::invalid_argument("flash_kda: workspace has " + std::to_string(p.workspace_bytes) +
                                " bytes, the call needs " + std::to_string(needed));
  }
  if (p.v_split != 0 && p.v_split != 1 && p.v_split != 2 && p.v_split != 4 && p.v_split != 8) {
    throw std::invalid_argument("flash_kda: v_split must be 0 (choose), 1, 2, 4 or 8, got " +
                                std::to_string(p.v_split));
  }
  if (p.num_seqs == 0 || p.heads == 0) return;
  launch_prepare(p, stream);
  launch_recurrence(p, stream);
}

}  // namespace kda
