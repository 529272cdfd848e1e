// pybind11 module flash_kda._C. Device work takes raw device pointers and a stream handle (integers from
// torch's data_ptr() and its current raw stream), so the extension needs no libtorch and imports on
// machines without a GPU. Argument checking lives in Python (flash_kda/api.py); this layer only converts.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Makes `device` the calling thread's current CUDA device for the launches and restores the previous one:
// the work of a torch.cuda.device context, without its host time per call (two runtime calls when the
// device is already current, as it usually is).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    KDA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) KDA_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~CurrentDevice() {
    if (switched_) cudaSetDevice(previous_);  // no throw from a destructor; the launches' errors come first
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

kda::ParamType param_type(int code, const char* name) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument(std::string("flash_kda: ") + name + " dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  }
  return static_cast<kda::ParamType>(code);
}

void fwd(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t g, std::uintptr_t beta,
         std::uintptr_t A_log, int A_log_type, std::uintptr_t dt_bias, int dt_bias_type, std::uintptr_t out,
         std::uintptr_t initial_state, bool initial_is_fp32, std::uintptr_t final_state, bool final_is_fp32,
         std::uintptr_t cu_seqlens, bool cu_seqlens_is_int64,
         int64_t batch, int64_t seqlen, int64_t num_seqs, int heads, float scale, float lower_bound,
         std::uintptr_t workspace, std::size_t workspace_bytes, std::uintptr_t status, int v_split, int scan_v_split,
         int segment_chunks, bool single_pass, int lead_chunks, int tail_ctas, bool longest_first,
         std::uintptr_t stream, int device) {
  kda::FwdParams p{};
  p.q = ptr<const void>(q);
  p.k = ptr<const void>(k);
  p.v = ptr<const void>(v);
  p.g = ptr<const void>(g);
  p.beta = ptr<const void>(beta);
  p.A_log = ptr<const void>(A_log);
  p.A_log_type = param_type(A_log_type, "A_log");
  p.dt_bias = ptr<const void>(dt_bias);
  p.dt_bias_type = param_type(dt_bias_type, "dt_bias");
  p.out = ptr<void>(out);
  p.initial_state = ptr<const void>(initial_state);
  p.initial_is_fp32 = initial_is_fp32;
  p.final_state = ptr<void>(final_state);
  p.final_is_fp32 = final_is_fp32;
  p.cu_seqlens = ptr<const void>(cu_seqlens);
  p.cu_seqlens_is_int64 = cu_seqlens_is_int64;
  p.total_tokens = batch * seqlen;
  p.seqlen = seqlen;
  p.num_seqs = num_seqs;
  p.heads = heads;
  p.scale = scale;
  p.lower_bound = lower_bound;
  p.workspace = ptr<void>(workspace);
  p.workspace_bytes = workspace_bytes;
  p.status = ptr<unsigned long long>(status);
  p.v_split = v_split;
  p.scan_v_split = scan_v_split;
  p.segment_chunks = segment_chunks;
  p.single_pass = single_pass;
  p.lead_chunks = lead_chunks;
  p.tail_ctas = tail_ctas;
  p.longest_first = longest_first;
  py::gil_scoped_release release;
  const CurrentDevice on(device);
  kda::fwd(p, stream_of(stream));
}

void elementwise(kda::Elementwise op, std::uintptr_t x, std::uintptr_t y, int64_t n, std::uintptr_t stream) {
  py::gil_scoped_release release;
  kda::launch_elementwise(op, ptr<const float>(x), ptr<float>(y), n, stream_of(stream));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "FlashKDA CUDA extension: KDA forward for sm_90a and the numerics helpers its twin uses.";
  m.attr("CHUNK") = kda::kChunk;
  m.attr("HEAD_DIM") = kda::kHeadDim;
  m.attr("CHUNK_RECORD_BYTES") = kda::ChunkRecordLayout::kBytes;

  m.def("build_info", &kda::build_info, "Toolkit version and GPU archs this extension was compiled for.");
  m.def("device_info", &kda::device_info, py::arg("device"),
        "Name, compute capability, SM count, L2 size, driver and runtime versions of a CUDA device.");
  m.def("workspace_bytes", &kda::workspace_bytes, py::arg("total_tokens"), py::arg("num_seqs"), py::arg("heads"),
        py::arg("segment_chunks") = 0, py::arg("single_pass") = false, py::arg("tail_items") = 0,
        py::arg("longest_first") = false,
        "Bytes of workspace one forward call needs under a plan (its time split, the overlap's tail items, the "
        "longest-first order, or none for the single pass).");
  m.def("overlap_tail_items", &kda::overlap_tail_items, py::arg("seqlen"), py::arg("num_seqs"), py::arg("heads"),
        py::arg("lead_chunks"), "Records the overlap's tail kernel prepares (each with a ready flag); 0 without one.");
  m.def("fwd", &fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"),
        py::arg("A_log_type"), py::arg("dt_bias"), py::arg("dt_bias_type"), py::arg("out"),
        py::arg("initial_state"), py::arg("initial_is_fp32"), py::arg("final_state"), py::arg("final_is_fp32"),
        py::arg("cu_seqlens"), py::arg("cu_seqlens_is_int64"), py::arg("batch"),
        py::arg("seqlen"), py::arg("num_seqs"), py::arg("heads"), py::arg("scale"), py::arg("lower_bound"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("status"), py::arg("v_split"), py::arg("scan_v_split"),
        py::arg("segment_chunks"), py::arg("single_pass"), py::arg("lead_chunks"), py::arg("tail_ctas"),
        py::arg("longest_first"), py::arg("stream"), py::arg("device"),
        "Enqueues the KDA forward on `stream` of CUDA device `device` (device pointers as integers, 0 for None) "
        "under the plan "
        "(v_split, scan_v_split, segment_chunks, single_pass, lead_chunks, tail_ctas, longest_first) from "
        "choose_plan. Validation "
        "is the caller's job: use flash_kda.fwd.");
  m.def(
      "choose_plan",
      [](int64_t total_tokens, int64_t seqlen, int64_t num_seqs, int heads, bool varlen, int sm_count,
         int segment_chunks, int single_pass, int lead_chunks) {
        const kda::Plan plan = kda::choose_plan(total_tokens, seqlen, num_seqs, heads, varlen, sm_count,
                                                segment_chunks, single_pass, lead_chunks);
        return py::make_tuple(plan.v_split, plan.scan_v_split, plan.segment_chunks, plan.single_pass,
                              plan.lead_chunks, plan.tail_ctas, plan.longest_first);
      },
      py::arg("total_tokens"), py::arg("seqlen"), py::arg("num_seqs"), py::arg("heads"), py::arg("varlen"),
      py::arg("sm_count"), py::arg("segment_chunks") = -1, py::arg("single_pass") = -1, py::arg("lead_chunks") = -2,
      "The plan fwd uses for these shapes on a GPU with sm_count SMs: (v_split, scan_v_split, segment_chunks, "
      "single_pass, lead_chunks, tail_ctas, longest_first); segment_chunks >= 0 fixes the time split (0: none) "
      "and chooses the V splits for it; single_pass 1 forces the single pass, 0 forbids it, -1 leaves it to the "
      "plan; lead_chunks >= 0 forces the overlap with that lead (fixed-length batches), -1 forbids it, -2 leaves it "
      "to the plan.");
  m.def("choose_v_split", &kda::choose_v_split, py::arg("num_seqs"), py::arg("heads"), py::arg("sm_count"),
        "Recurrence CTAs per (sequence, head) that fwd picks for these shapes on a GPU with sm_count SMs.");
  m.def("hi_lo_state_update", &kda::hi_lo_state_update, py::arg("lower_bound"),
        "Whether fwd's state update adds bf16(U - bf16(U))·Kr after bf16(U)·Kr for this lower_bound (slow decay).");
  m.def(
      "ex2_approx",
      [](std::uintptr_t x, std::uintptr_t y, int64_t n, std::uintptr_t s) {
        elementwise(kda::Elementwise::kEx2Approx, x, y, n, s);
      },
      py::arg("x"), py::arg("y"), py::arg("n"), py::arg("stream"), "y = ex2.approx.ftz.f32(x), fp32 arrays.");
  m.def(
      "tanh_approx",
      [](std::uintptr_t x, std::uintptr_t y, int64_t n, std::uintptr_t s) {
        elementwise(kda::Elementwise::kTanhApprox, x, y, n, s);
      },
      py::arg("x"), py::arg("y"), py::arg("n"), py::arg("stream"), "y = tanh.approx.f32(x), fp32 arrays.");
  m.def(
      "sigmoid_approx",
      [](std::uintptr_t x, std::uintptr_t y, int64_t n, std::uintptr_t s) {
        elementwise(kda::Elementwise::kSigmoidApprox, x, y, n, s);
      },
      py::arg("x"), py::arg("y"), py::arg("n"), py::arg("stream"),
      "y = 0.5 * tanh.approx.f32(0.5 * x) + 0.5 (each step rounded), fp32 arrays.");
  m.def(
      "mma_bf16",
      [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, std::uintptr_t d, int64_t batch, int m_, int n_,
         int k_, std::uintptr_t s) {
        py::gil_scoped_release release;
        kda::launch_mma_bf16(ptr<const void>(a), ptr<const void>(b), ptr<const float>(c), ptr<float>(d), batch, m_,
                             n_, k_, stream_of(s));
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"), py::arg("batch"), py::arg("m"), py::arg("n"),
      py::arg("k"), py::arg("stream"),
      "D = C + A·B per batch entry via mma.sync m16n8k16 (bf16 in, fp32 accumulate), k-steps in order.");
}
