// Host-side entry points of the KDA forward and of the numerics helpers. Plain C++ declarations (no CUDA
// syntax) so the pybind11 binding compiles with the host compiler alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>

#include "kda/csrc/kda_params.h"

namespace kda {

// The stages of the forward: preparation (prepare.cu), the time split's scan pass (scan_pass.cu) and
// composition (segment_compose.cu), the recurrence's finishing pass (finish_pass.cuh, recurrence_dispatch.cu).
void launch_prepare(const FwdParams& p, cudaStream_t stream);
// The overlap's tail preparation (prepare_tail.cu), a programmatic dependent of launch_prepare's kernel.
void launch_prepare_tail(const FwdParams& p, cudaStream_t stream);
void launch_segment_scan(const FwdParams& p, cudaStream_t stream);
void launch_segment_compose(const FwdParams& p, cudaStream_t stream);
void launch_recurrence(const FwdParams& p, cudaStream_t stream);
// The single pass (plan.single_pass): preparation and recurrence in one kernel, no workspace (single_pass.cuh).
void launch_single_pass(const FwdParams& p, cudaStream_t stream);
// The decode kernel (plan.decode): token by token, the state in fp32 registers, no workspace; it also runs the
// input checks of launch_boundary_check (decode.cu).
void launch_decode(const FwdParams& p, cudaStream_t stream);
// The warp-specialised decode kernel (decode_warp_specialised.cu): kda_decode_kernel's arithmetic bit for bit, for
// the calls decode_warp_specialised_runs accepts (bf16 states, two or more tokens per sequence on average, no
// per-token states or checkpoints); it runs the same input checks.
bool decode_warp_specialised_runs(const FwdParams& p);
void launch_decode_warp_specialised(const FwdParams& p, cudaStream_t stream);
// The decode plan's chunk step (decode_chunk.cu): up to 16 tokens of a sequence per step on the tensor cores, with
// fp32-grade operands, checkpoints included; it runs the same input checks (kda_plan.h, decode_chunk_runs, says
// when).
void launch_decode_chunk(const FwdParams& p, cudaStream_t stream);

// The stream pass (stream_pass.cuh): the chunked arithmetic for calls of many one-chunk sequences in one persistent
// kernel that prepares and steps side by side, no workspace (kda_plan.h, stream_pass_runs, says when: never with an
// fp32 final state); it runs the decode kernels' input checks.
void launch_stream_pass(const FwdParams& p, cudaStream_t stream);

// Records a malformed CUDA cu_seqlens or state index in the device's error word and, for longest first, ranks the
// sequences (kda_checks.cu); no-op without either.
void launch_boundary_check(const FwdParams& p, cudaStream_t stream);

// Whole forward: checks the plan and the workspace size, then enqueues the stages on `stream` (kda_fwd.cu).
void fwd(const FwdParams& p, cudaStream_t stream);

// Elementwise helpers on fp32 device arrays, the same instructions the kernels use (helpers.cu).
enum class Elementwise { kEx2Approx, kTanhApprox, kSigmoidApprox, kSoftplusLog2, kRcpSqrtRn };
void launch_elementwise(Elementwise op, const float* x, float* y, int64_t n, cudaStream_t stream);

// The decode kernel's fused steps on fp32 device arrays (helpers.cu), for G groups of R rows of 128 channels:
// leaves[g, r, l] = lane_leaf4(a[g, r, 4l..4l+3], b[g, 4l..4l+3]) and s_out[g, r, c] = fma(u[g, r], k[g, c], s[g, r, c]).
void launch_lane_leaves(const float* a, const float* b, float* leaves, int64_t groups, int64_t rows,
                        cudaStream_t stream);
void launch_row_fma(const float* u, const float* k, const float* s, float* s_out, int64_t groups, int64_t rows,
                    cudaStream_t stream);

// D = C + A·B per batch entry through mma.sync m16n8k16 (bf16 in, fp32 accumulate), k-steps in order.
// A [batch, m, k] bf16, B [batch, k, n] bf16, C (may be null = zeros), D [batch, m, n] fp32; row-major.
void launch_mma_bf16(const void* a, const void* b, const float* c, float* d, int64_t batch, int m, int n, int k,
                     cudaStream_t stream);

// Build and device facts (device_info.cu).
std::map<std::string, std::string> build_info();
std::map<std::string, std::string> device_info(int device);

}  // namespace kda
