// pybind11 module flash_kda._C. Device work takes raw device pointers and a stream handle (integers from
// torch's data_ptr() and its current raw stream), so the extension needs no libtorch and imports on
// machines without a GPU. Argument checking lives in Python (flash_kda/validation.py); this layer only converts.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/kda_launch.h"
#include "kda/csrc/kda_params.h"
#include "kda/csrc/kda_plan.h"
#include "kda/csrc/status_word.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Makes `device` the calling thread's current CUDA device for the launches and restores the previous one. The
// Python layer calls with the device already current (flash_kda._ext.on_device: torch's own context where it is
// not, which restores the previous device without creating a CUDA context there), so this is two runtime calls
// and no switch; it keeps a direct call correct.
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

// ---- fwd's argument: four groups, read straight from Python tuples -------------------------------------------
// One direct flash_kda.fwd call costs about 18 µs of host time, so the groups are plain tuples read with the
// CPython API (a pybind class built per call, or pybind's list/array casters, cost more than the 34 loose
// arguments they would replace; a tuple of four groups costs less). Their layouts, in order:
//   FwdTensors  (q, k, v, g, beta, A_log, A_log_type, dt_bias, dt_bias_type, out, initial_state, initial_is_fp32,
//                final_state, final_is_fp32, cu_seqlens, cu_seqlens_is_int64, state_indices,
//                state_indices_is_int64, num_accepted_tokens, num_accepted_is_int64, checkpoint_indices,
//                checkpoint_indices_is_int64): device addresses as ints (0 for None), ParamType codes (0 fp32,
//                1 bf16, 2 fp16) and bools;
//   FwdShape    (batch, seqlen, num_seqs, heads, scale, lower_bound, pool_slots, key_heads, gate, beta_scale,
//                state_tokens, checkpoint_cols, checkpoint_chunks):
//                ints, then floats, then the pools' slot count P (num_seqs without state_indices), q's and k's
//                heads (GVA: heads is a multiple), the kda::GateKind code, β's scale (1 or 2), L of per-token
//                state_indices [N, L] (0: one index per sequence, or none), and the checkpoints' M (columns of
//                checkpoint_indices [N, M]) and C / 16 (chunks between two checkpoints; 0: none);
//   kda::Plan   the flash_kda.Plan object itself;
//   FwdLaunch   (workspace, workspace_bytes, status, stream, device): ints (status 0: no error word).
struct FwdTensors {
  std::uintptr_t q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens, state_indices,
      num_accepted, checkpoint_indices;
  kda::ParamType A_log_type, dt_bias_type;
  bool initial_is_fp32, final_is_fp32, cu_seqlens_is_int64, state_indices_is_int64, num_accepted_is_int64,
      checkpoint_indices_is_int64;
};
struct FwdShape {
  int64_t batch, seqlen, num_seqs;
  int heads;
  float scale, lower_bound;
  int64_t pool_slots;
  int key_heads, gate;
  float beta_scale;
  int state_tokens;
  int64_t checkpoint_cols;
  int checkpoint_chunks;
};
struct FwdLaunch {
  std::uintptr_t workspace;
  std::size_t workspace_bytes;
  std::uintptr_t status, stream;
  int device;
};

// Reads the items of a tuple of exactly `size` items in order; every read says whether the item has its type
// (then `ok()` stays true). No conversions: an int is an int, a bool a bool, a float a float or an int.
class TupleReader {
 public:
  TupleReader(py::handle src, Py_ssize_t size)
      : tuple_(src.ptr()), ok_(PyTuple_Check(tuple_) && PyTuple_GET_SIZE(tuple_) == size) {}
  bool ok() const { return ok_; }
  template <typename T>
  T integer() {
    PyObject* item = next();
    if (item == nullptr || !PyLong_Check(item) || PyBool_Check(item)) return fail<T>();
    if constexpr (std::is_unsigned_v<T>) {  // addresses and sizes: a negative int is refused
      const unsigned long long value = PyLong_AsUnsignedLongLong(item);
      if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return fail<T>();
      return static_cast<T>(value);
    } else {
      const long long value = PyLong_AsLongLong(item);
      if (value == -1 && PyErr_Occurred()) return fail<T>();
      return static_cast<T>(value);
    }
  }
  bool boolean() {
    PyObject* item = next();
    if (item == nullptr || !PyBool_Check(item)) return fail<bool>();
    return item == Py_True;
  }
  float real() {
    PyObject* item = next();
    if (item == nullptr || !(PyFloat_Check(item) || (PyLong_Check(item) && !PyBool_Check(item)))) return fail<float>();
    const double value = PyFloat_AsDouble(item);
    if (value == -1.0 && PyErr_Occurred()) return fail<float>();
    return static_cast<float>(value);
  }
  kda::ParamType param_type() {
    const int code = integer<int>();
    if (code < 0 || code > 2) return fail<kda::ParamType>();
    return static_cast<kda::ParamType>(code);
  }

 private:
  PyObject* next() { return ok_ ? PyTuple_GET_ITEM(tuple_, index_++) : nullptr; }
  template <typename T>
  T fail() {
    PyErr_Clear();
    ok_ = false;
    return T{};
  }
  PyObject* tuple_;
  bool ok_;
  Py_ssize_t index_ = 0;
};

}  // namespace

namespace pybind11::detail {

template <>
struct type_caster<FwdTensors> {
  PYBIND11_TYPE_CASTER(FwdTensors, const_name("tuple[int, int, int, int, int, int, int, int, int, int, int, bool, "
                                               "int, bool, int, bool, int, bool, int, bool, int, bool]"));
  bool load(handle src, bool) {
    TupleReader r(src, 22);
    FwdTensors& t = value;
    t.q = r.integer<std::uintptr_t>();
    t.k = r.integer<std::uintptr_t>();
    t.v = r.integer<std::uintptr_t>();
    t.g = r.integer<std::uintptr_t>();
    t.beta = r.integer<std::uintptr_t>();
    t.A_log = r.integer<std::uintptr_t>();
    t.A_log_type = r.param_type();
    t.dt_bias = r.integer<std::uintptr_t>();
    t.dt_bias_type = r.param_type();
    t.out = r.integer<std::uintptr_t>();
    t.initial_state = r.integer<std::uintptr_t>();
    t.initial_is_fp32 = r.boolean();
    t.final_state = r.integer<std::uintptr_t>();
    t.final_is_fp32 = r.boolean();
    t.cu_seqlens = r.integer<std::uintptr_t>();
    t.cu_seqlens_is_int64 = r.boolean();
    t.state_indices = r.integer<std::uintptr_t>();
    t.state_indices_is_int64 = r.boolean();
    t.num_accepted = r.integer<std::uintptr_t>();
    t.num_accepted_is_int64 = r.boolean();
    t.checkpoint_indices = r.integer<std::uintptr_t>();
    t.checkpoint_indices_is_int64 = r.boolean();
    return r.ok();
  }
};

template <>
struct type_caster<FwdShape> {
  PYBIND11_TYPE_CASTER(FwdShape, const_name("tuple[int, int, int, int, float, float, int, int, int, float, int, int, int]"));
  bool load(handle src, bool) {
    TupleReader r(src, 13);
    value.batch = r.integer<int64_t>();
    value.seqlen = r.integer<int64_t>();
    value.num_seqs = r.integer<int64_t>();
    value.heads = r.integer<int>();
    value.scale = r.real();
    value.lower_bound = r.real();
    value.pool_slots = r.integer<int64_t>();
    value.key_heads = r.integer<int>();
    value.gate = r.integer<int>();
    value.beta_scale = r.real();
    value.state_tokens = r.integer<int>();
    value.checkpoint_cols = r.integer<int64_t>();
    value.checkpoint_chunks = r.integer<int>();
    return r.ok();
  }
};

template <>
struct type_caster<FwdLaunch> {
  PYBIND11_TYPE_CASTER(FwdLaunch, const_name("tuple[int, int, int, int, int]"));
  bool load(handle src, bool) {
    TupleReader r(src, 5);
    value.workspace = r.integer<std::uintptr_t>();
    value.workspace_bytes = r.integer<std::size_t>();
    value.status = r.integer<std::uintptr_t>();
    value.stream = r.integer<std::uintptr_t>();
    value.device = r.integer<int>();
    return r.ok();
  }
};

}  // namespace pybind11::detail

namespace {

// The kernels' parameters from fwd's four groups (kda::FwdParams keeps its layout: the kernels take it by value).
kda::FwdParams fwd_params(const FwdTensors& t, const FwdShape& shape, const kda::Plan& plan, const FwdLaunch& launch) {
  kda::FwdParams p{};
  p.q = ptr<const void>(t.q);
  p.k = ptr<const void>(t.k);
  p.v = ptr<const void>(t.v);
  p.g = ptr<const void>(t.g);
  p.beta = ptr<const void>(t.beta);
  p.A_log = ptr<const void>(t.A_log);
  p.A_log_type = t.A_log_type;
  p.dt_bias = ptr<const void>(t.dt_bias);
  p.dt_bias_type = t.dt_bias_type;
  p.out = ptr<void>(t.out);
  p.initial_state = ptr<const void>(t.initial_state);
  p.initial_is_fp32 = t.initial_is_fp32;
  p.final_state = ptr<void>(t.final_state);
  p.final_is_fp32 = t.final_is_fp32;
  p.cu_seqlens = ptr<const void>(t.cu_seqlens);
  p.cu_seqlens_is_int64 = t.cu_seqlens_is_int64;
  p.state_indices = ptr<const void>(t.state_indices);
  p.state_indices_is_int64 = t.state_indices_is_int64;
  p.pool_slots = shape.pool_slots;
  p.total_tokens = shape.batch * shape.seqlen;
  p.seqlen = shape.seqlen;
  p.num_seqs = shape.num_seqs;
  p.heads = shape.heads;
  p.scale = shape.scale;
  p.lower_bound = shape.lower_bound;
  p.key_heads = shape.key_heads;
  p.gate = static_cast<kda::GateKind>(shape.gate);
  p.beta_scale = shape.beta_scale;
  p.state_tokens = shape.state_tokens;
  p.num_accepted = ptr<const void>(t.num_accepted);
  p.num_accepted_is_int64 = t.num_accepted_is_int64;
  p.checkpoint_indices = ptr<const void>(t.checkpoint_indices);
  p.checkpoint_indices_is_int64 = t.checkpoint_indices_is_int64;
  p.checkpoint_cols = shape.checkpoint_cols;
  p.checkpoint_chunks = shape.checkpoint_chunks;
  p.workspace = ptr<void>(launch.workspace);
  p.workspace_bytes = launch.workspace_bytes;
  p.status = ptr<unsigned long long>(launch.status);
  p.v_split = plan.v_split;
  p.scan_v_split = plan.scan_v_split;
  p.segment_chunks = plan.segment_chunks;
  p.single_pass = plan.single_pass;
  p.lead_chunks = plan.lead_chunks;
  p.tail_ctas = plan.tail_ctas;
  p.longest_first = plan.longest_first;
  p.decode = plan.decode;
  return p;
}

void fwd(const FwdTensors& tensors, const FwdShape& shape, const kda::Plan& plan, const FwdLaunch& launch) {
  const kda::FwdParams p = fwd_params(tensors, shape, plan, launch);
  py::gil_scoped_release release;
  const CurrentDevice on(launch.device);
  kda::fwd(p, stream_of(launch.stream));
}

std::string plan_repr(const kda::Plan& p) {
  const auto flag = [](bool b) { return b ? "True" : "False"; };
  return "Plan(v_split=" + std::to_string(p.v_split) + ", scan_v_split=" + std::to_string(p.scan_v_split) +
         ", segment_chunks=" + std::to_string(p.segment_chunks) + ", single_pass=" + flag(p.single_pass) +
         ", lead_chunks=" + std::to_string(p.lead_chunks) + ", tail_ctas=" + std::to_string(p.tail_ctas) +
         ", longest_first=" + flag(p.longest_first) + ", decode=" + flag(p.decode) + ")";
}

// The fields in order, as a NamedTuple has them (tuple(plan), plan._asdict()).
py::tuple plan_fields(const kda::Plan& p) {
  return py::make_tuple(p.v_split, p.scan_v_split, p.segment_chunks, p.single_pass, p.lead_chunks, p.tail_ctas,
                        p.longest_first, p.decode);
}
constexpr const char* kPlanFieldNames[] = {"v_split",   "scan_v_split",  "segment_chunks", "single_pass", "lead_chunks",
                                           "tail_ctas", "longest_first", "decode"};

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
        py::arg("longest_first") = false, py::arg("decode") = false,
        "Bytes of workspace one forward call needs under a plan (its time split, the overlap's tail items, the "
        "longest-first order, or none for the single pass and the decode kernel).");
  m.def("overlap_tail_items", &kda::overlap_tail_items, py::arg("seqlen"), py::arg("num_seqs"), py::arg("heads"),
        py::arg("lead_chunks"), "Records the overlap's tail kernel prepares (each with a ready flag); 0 without one.");
  py::class_<kda::Plan>(m, "Plan",
                        "How fwd runs a call on the GPU (docs/DESIGN.md, \"The plan\"): read-only, compared and hashed "
                        "by value. No choice changes a result bit except the time split, which the numerics twin "
                        "re-enacts.")
      .def(py::init([](int v_split, int scan_v_split, int segment_chunks, bool single_pass, int lead_chunks,
                       int tail_ctas, bool longest_first, bool decode) {
             return kda::Plan{v_split, scan_v_split, segment_chunks, single_pass, lead_chunks, tail_ctas,
                              longest_first, decode};
           }),
           py::arg("v_split") = 1, py::arg("scan_v_split") = 1, py::arg("segment_chunks") = 0,
           py::arg("single_pass") = false, py::arg("lead_chunks") = -1, py::arg("tail_ctas") = 0,
           py::arg("longest_first") = false, py::arg("decode") = false)
      .def_readonly("v_split", &kda::Plan::v_split,
                    "recurrence CTAs per (segment, head), each owning 128 / v_split state rows")
      .def_readonly("scan_v_split", &kda::Plan::scan_v_split, "scan-pass CTAs per (scanned segment, head, map)")
      .def_readonly("segment_chunks", &kda::Plan::segment_chunks,
                    "the time split: chunks (16 tokens) per segment; 0: none")
      .def_readonly("single_pass", &kda::Plan::single_pass,
                    "one kernel prepares and runs each (sequence, head); no workspace")
      .def_readonly("lead_chunks", &kda::Plan::lead_chunks,
                    "the overlap: chunks prepared before the recurrence starts, the rest beside it; -1: none")
      .def_readonly("tail_ctas", &kda::Plan::tail_ctas,
                    "the overlap: CTAs of its tail kernel (one per SM the recurrence leaves free)")
      .def_readonly("longest_first", &kda::Plan::longest_first,
                    "varlen: the finishing pass starts the longest sequences first")
      .def_readonly("decode", &kda::Plan::decode,
                    "the decode kernel: short sequences token by token, the state in fp32 registers")
      .def("__repr__", &plan_repr)
      .def("__eq__", [](const kda::Plan& a, const kda::Plan& b) { return a == b; }, py::is_operator())
      .def("__ne__", [](const kda::Plan& a, const kda::Plan& b) { return a != b; }, py::is_operator())
      .def("__hash__", [](const kda::Plan& p) { return py::hash(plan_fields(p)); })
      .def("__iter__", [](const kda::Plan& p) { return py::iter(plan_fields(p)); })
      .def("__reduce__", [](py::object self) {
        return py::make_tuple(self.attr("__class__"), plan_fields(self.cast<const kda::Plan&>()));
      })
      .def("_asdict",
           [](const kda::Plan& p) {
             py::dict d;
             const py::tuple fields = plan_fields(p);
             for (std::size_t i = 0; i < fields.size(); ++i) d[kPlanFieldNames[i]] = fields[i];
             return d;
           },
           "The fields as a dict, in order.")
      .def(
          "_replace",
          [](const kda::Plan& p, std::optional<int> v_split, std::optional<int> scan_v_split,
             std::optional<int> segment_chunks, std::optional<bool> single_pass, std::optional<int> lead_chunks,
             std::optional<int> tail_ctas, std::optional<bool> longest_first, std::optional<bool> decode) {
            return kda::Plan{v_split.value_or(p.v_split),         scan_v_split.value_or(p.scan_v_split),
                             segment_chunks.value_or(p.segment_chunks), single_pass.value_or(p.single_pass),
                             lead_chunks.value_or(p.lead_chunks), tail_ctas.value_or(p.tail_ctas),
                             longest_first.value_or(p.longest_first), decode.value_or(p.decode)};
          },
          py::kw_only(), py::arg("v_split") = py::none(), py::arg("scan_v_split") = py::none(),
          py::arg("segment_chunks") = py::none(), py::arg("single_pass") = py::none(),
          py::arg("lead_chunks") = py::none(), py::arg("tail_ctas") = py::none(),
          py::arg("longest_first") = py::none(), py::arg("decode") = py::none(), "A copy with the given fields changed.");
  m.attr("STATUS_CLEAR") = kda::kStatusClear;
  m.attr("STATUS_STATE_INDEX_BASE") = kda::kStatusStateIndexBase;
  m.attr("STATUS_CHECKPOINT_INDEX_BASE") = kda::kStatusCheckpointIndexBase;
  m.def("status_word_create", &kda::status_word_create, py::arg("device"),
        "Allocates and clears CUDA device `device`'s error word (outside any memory pool); returns its address.");
  m.def(
      "status_word_take",
      [](std::uintptr_t address, int device) {
        py::gil_scoped_release release;
        return kda::status_word_take(address, device);
      },
      py::arg("address"), py::arg("device"),
      "Waits for all work on `device`, then reads and resets its error word atomically; returns the value read "
      "(1 << 62: no malformed cu_seqlens or state_indices since the last take; below 1 << 40: the first bad "
      "cu_seqlens index; from 1 << 40: 1 << 40 plus the first sequence whose state index is past the pool, or "
      "whose num_accepted_tokens is outside [1, L]; from 1 << 41: 1 << 41 plus the first sequence with a checkpoint "
      "index past the pool).");
  m.def("fwd", &fwd, py::arg("tensors"), py::arg("shape"), py::arg("plan"), py::arg("launch"),
        "Enqueues the KDA forward on CUDA device `device`'s stream `stream` under `plan` (a Plan from choose_plan). "
        "tensors = (q, k, v, g, beta, A_log, A_log_type, dt_bias, dt_bias_type, out, initial_state, "
        "initial_is_fp32, final_state, final_is_fp32, cu_seqlens, cu_seqlens_is_int64, state_indices, "
        "state_indices_is_int64, num_accepted_tokens, num_accepted_is_int64, checkpoint_indices, "
        "checkpoint_indices_is_int64): device addresses (0 for None), dtype codes (0 fp32, 1 bf16, 2 fp16) and bools; "
        "shape = (batch, seqlen, num_seqs, heads, scale, lower_bound, pool_slots, key_heads, gate, beta_scale, "
        "state_tokens, checkpoint_cols, checkpoint_chunks); launch = (workspace, workspace_bytes, status, stream, "
        "device). Validation is the caller's "
        "job: use flash_kda.fwd.");
  m.def(
      "choose_plan",
      [](int64_t total_tokens, int64_t seqlen, int64_t num_seqs, int heads, bool varlen, int sm_count,
         std::optional<int> v_split, std::optional<int> scan_v_split, std::optional<int> segment_chunks,
         std::optional<bool> single_pass, std::optional<int> lead_chunks, std::optional<bool> decode, int gate) {
        const kda::PlanOverrides forced{v_split, scan_v_split, segment_chunks, single_pass, lead_chunks, decode};
        return kda::choose_plan(total_tokens, seqlen, num_seqs, heads, varlen, sm_count, forced,
                                static_cast<kda::GateKind>(gate));
      },
      py::arg("total_tokens"), py::arg("seqlen"), py::arg("num_seqs"), py::arg("heads"), py::arg("varlen"),
      py::arg("sm_count"), py::kw_only(), py::arg("v_split") = py::none(), py::arg("scan_v_split") = py::none(),
      py::arg("segment_chunks") = py::none(), py::arg("single_pass") = py::none(),
      py::arg("lead_chunks") = py::none(), py::arg("decode") = py::none(), py::arg("gate") = 0,
      "The Plan fwd uses for these shapes on a GPU with sm_count SMs (gate: the GateKind code; the softplus gate "
      "never runs the single pass). Each keyword forces one choice (None: the "
      "plan's own): v_split (1, 2, 4, 8; the scan's too unless scan_v_split is given), scan_v_split, "
      "segment_chunks (0: no time split; L: segments of L chunks), single_pass (True / False), lead_chunks (L >= "
      "0: the overlap with that lead on a fixed-length batch; -1: none), decode (True: the decode kernel, whatever the "
      "rest says; False: a chunked plan). A forced V split runs two stages and anything forced runs without the "
      "overlap, unless single_pass or lead_chunks say otherwise; anything forced but decode runs a chunked plan.");
  m.def(
      "plan_error",
      [](const kda::Plan& plan, bool varlen, int64_t num_seqs, int gate) {
        return kda::plan_error(plan, varlen, num_seqs, static_cast<kda::GateKind>(gate));
      },
      py::arg("plan"), py::arg("varlen"), py::arg("num_seqs"), py::arg("gate") = 0,
      "Why fwd refuses to run `plan` for a call of num_seqs sequences (varlen: with cu_seqlens) and this gate "
      "code, or \"\" when it runs it (kda_plan.h, plan_error).");
  m.def("decode_chunk_runs", &kda::decode_chunk_runs, py::arg("total_tokens"), py::arg("num_seqs"),
        py::arg("state_tokens"),
        "Whether a decode plan runs the chunk step (decode_chunk.cu) rather than the token-by-token kernel for a call "
        "of total_tokens tokens over num_seqs sequences with state_tokens per-token states (0: none).");
  m.def("stream_pass_runs", &kda::stream_pass_runs, py::arg("varlen"), py::arg("seqlen"), py::arg("state_tokens"),
        py::arg("checkpoints"), py::arg("fp32_final"), py::arg("items"), py::arg("sm_count"),
        "Whether a decode plan runs the stream pass (stream_pass.cuh: the chunked arithmetic) for a call: fixed-length "
        "sequences of exactly one chunk (seqlen 16), no per-token states (state_tokens 0), no checkpoints, no fp32 "
        "final state, and at least as many (sequence, head) items as the GPU's sm_count SMs.");
  m.def("choose_v_split", &kda::choose_v_split, py::arg("num_seqs"), py::arg("heads"), py::arg("sm_count"),
        "Recurrence CTAs per (sequence, head) that fwd picks for these shapes on a GPU with sm_count SMs.");
  m.def("hi_lo_state_update", &kda::hi_lo_state_update, py::arg("lower_bound"),
        "Whether fwd's state update adds bf16(U - bf16(U))·Kr after bf16(U)·Kr for this lower_bound (slow decay).");
  // The approximate instructions the twin takes from the device (numerics.py): y = op(x) over fp32 arrays.
  const auto def_elementwise = [&m](const char* name, kda::Elementwise op, const char* doc) {
    m.def(
        name,
        [op](std::uintptr_t x, std::uintptr_t y, int64_t n, std::uintptr_t s) { elementwise(op, x, y, n, s); },
        py::arg("x"), py::arg("y"), py::arg("n"), py::arg("stream"), doc);
  };
  def_elementwise("ex2_approx", kda::Elementwise::kEx2Approx, "y = ex2.approx.ftz.f32(x), fp32 arrays.");
  def_elementwise("tanh_approx", kda::Elementwise::kTanhApprox, "y = tanh.approx.f32(x), fp32 arrays.");
  def_elementwise("sigmoid_approx", kda::Elementwise::kSigmoidApprox,
                  "y = 0.5 * tanh.approx.f32(0.5 * x) + 0.5 (each step rounded), fp32 arrays.");
  def_elementwise("softplus_log2", kda::Elementwise::kSoftplusLog2,
                  "y = log2(1 + e^x) as the softplus gate computes it (gate.cuh, softplus_log2), fp32 arrays.");
  def_elementwise("rcp_sqrt_rn", kda::Elementwise::kRcpSqrtRn,
                  "y = 1 / sqrt(x), each step correctly rounded, as the norms compute it (device_math.cuh), fp32 "
                  "arrays.");
  m.def(
      "lane_leaves",
      [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t leaves, int64_t groups, int64_t rows, std::uintptr_t s) {
        py::gil_scoped_release release;
        kda::launch_lane_leaves(ptr<const float>(a), ptr<const float>(b), ptr<float>(leaves), groups, rows,
                                stream_of(s));
      },
      py::arg("a"), py::arg("b"), py::arg("leaves"), py::arg("groups"), py::arg("rows"), py::arg("stream"),
      "The decode kernel's lane leaves of a[g, r, :]·b[g, :] (fp32 [G, R, 128], [G, 128] -> [G, R, 32]).");
  m.def(
      "row_fma",
      [](std::uintptr_t u, std::uintptr_t k, std::uintptr_t st, std::uintptr_t out, int64_t groups, int64_t rows,
         std::uintptr_t s) {
        py::gil_scoped_release release;
        kda::launch_row_fma(ptr<const float>(u), ptr<const float>(k), ptr<const float>(st), ptr<float>(out), groups,
                            rows, stream_of(s));
      },
      py::arg("u"), py::arg("k"), py::arg("s"), py::arg("out"), py::arg("groups"), py::arg("rows"), py::arg("stream"),
      "out[g, r, c] = fma(u[g, r], k[g, c], s[g, r, c]) rounded once (fp32 [G, R], [G, 128], [G, R, 128]).");
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
