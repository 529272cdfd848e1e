// Device arithmetic shared by the KDA kernels and the elementwise/matmul helpers that the Python numerics
// twin calls. Every floating-point step that affects results goes through an explicitly rounded intrinsic
// (__fadd_rn, __fmul_rn, ...) so the compiler cannot contract it into an FMA: the twin re-enacts these
// exact roundings with PyTorch's IEEE-rounded elementwise ops. The decode kernel's FMAs are explicit too
// (__fmaf_rn, lane_leaf4), and the twin takes them from the helpers (helpers.cu).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace kda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNormEps = 1e-6f;  // inside the square root of the L2 norm (docs/SPEC.md §1).

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / sqrt(x) as two correctly rounded steps, the bits of __frcp_rn(__fsqrt_rn(x)), for x >= 2^-100 (a norm's
// sum of squares plus kNormEps) without the library's branches to its slow paths, which split the code around them
// into regions the compiler cannot schedule across. These are the library's fast paths, which it takes for every
// such x: sqrt = x·r corrected by one Newton step from r = rsqrt.approx; the reciprocal, rcp.approx corrected by one
// Newton step. x = +inf (squares that overflowed) gives 0 as the library does (the fast path would give NaN); NaN
// stays NaN. test_helpers checks every fp32 x from kNormEps up against PyTorch's sqrt and reciprocal.
__device__ __forceinline__ float rcp_sqrt_rn(float x) {
  const float r = rsqrt_approx(x);
  const float y0 = __fmul_rn(x, r);
  const float root = __fmaf_rn(__fmaf_rn(-y0, y0, x), __fmul_rn(r, 0.5f), y0);
  const float z = rcp_approx(root);
  const float inv = __fmaf_rn(z, -__fmaf_rn(z, root, -1.f), z);
  return x == __int_as_float(0x7f800000) ? 0.f : inv;
}

// sigmoid(x) = 0.5 * tanh(x / 2) + 0.5; both scalings by 0.5 are exact.
__device__ __forceinline__ float sigmoid_approx(float x) {
  return __fadd_rn(__fmul_rn(0.5f, tanh_approx(__fmul_rn(0.5f, x))), 0.5f);
}

// Two floats -> one register of two bf16 (round to nearest even), low half = first element.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float bf16_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// The low part of the hi/lo split of two floats whose bf16 pair `hi` = pack_bf16x2(x0, x1) is given, packed:
// bf16(x - float(bf16(x))) (the difference is exact in fp32). x = hi + lo to about 2^-16 relative.
__device__ __forceinline__ uint32_t pack_lo_bf16x2(float x0, float x1, uint32_t hi) {
  const __nv_bfloat162 h2 = *reinterpret_cast<const __nv_bfloat162*>(&hi);
  return pack_bf16x2(__fsub_rn(x0, __low2float(h2)), __fsub_rn(x1, __high2float(h2)));
}

// Two adjacent elements of a row-major state (fp32 or bf16) in memory, widened to fp32 / stored from fp32.
template <typename T>
__device__ __forceinline__ void load_pair(const T* src, float& a, float& b);
template <>
__device__ __forceinline__ void load_pair<float>(const float* src, float& a, float& b) {
  const float2 x = *reinterpret_cast<const float2*>(src);
  a = x.x;
  b = x.y;
}
template <>
__device__ __forceinline__ void load_pair<__nv_bfloat16>(const __nv_bfloat16* src, float& a, float& b) {
  const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(src);
  a = __low2float(x);
  b = __high2float(x);
}
__device__ __forceinline__ void store_pair(float* dst, float a, float b) {
  *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

// A lane's leaf of a sum over 128 channels in the decode kernel: a3·b3 + (a2·b2 + (a1·b1 + a0·b0)), one rounded
// product and three FMAs.
__device__ __forceinline__ float lane_leaf4(const float (&a)[4], const float (&b)[4]) {
  return __fmaf_rn(a[3], b[3], __fmaf_rn(a[2], b[2], __fmaf_rn(a[1], b[1], __fmul_rn(a[0], b[0]))));
}

// D = C + A·B for one m16n8k16 tile: bf16 operands, fp32 accumulators, fragments as the PTX ISA lays them
// out (g = lane / 4, t = lane % 4):
//   a[0]: (row g,   cols 2t..2t+1)  a[1]: (row g+8, cols 2t..2t+1)
//   a[2]: (row g,   cols 2t+8..+9)  a[3]: (row g+8, cols 2t+8..+9)
//   b[0]: (k 2t..2t+1, col g)       b[1]: (k 2t+8..+9, col g)
//   c[0..1]: (row g, cols 2t..2t+1) c[2..3]: (row g+8, cols 2t..2t+1)
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One level of the reduce-scatter of 16 sums (lane l holds a leaf of each): the lane keeps the half of its kCount
// partial sums whose index bit matches its lane bit kOffset, and adds its partner's partial of the same sums.
// Each sum is built from exactly the pairs of the butterfly, so it equals the halving tree bit for bit.
template <int kCount, int kOffset>
__device__ __forceinline__ void scatter_level(float (&v)[16], int lane) {
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int i = 0; i < kCount / 2; ++i) {
    const float lo = v[i], hi = v[i + kCount / 2];
    const float keep = upper ? hi : lo, send = upper ? lo : hi;
    v[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, kOffset));
  }
}
// The 16 sums; lanes 2i and 2i + 1 end with sum i (lane bits 4, 3, 2, 1 pick index bits 3, 2, 1, 0).
__device__ __forceinline__ float reduce_scatter_16(float (&v)[16], int lane) {
  scatter_level<16, 16>(v, lane);
  scatter_level<8, 8>(v, lane);
  scatter_level<4, 4>(v, lane);
  scatter_level<2, 2>(v, lane);
  return __fadd_rn(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
}

// Loads the A fragment of a 16x16 bf16 tile stored row-major (row stride `ld` elements) in shared memory.
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const __nv_bfloat16* tile, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  a[0] = *reinterpret_cast<const uint32_t*>(tile + g * ld + 2 * t);
  a[1] = *reinterpret_cast<const uint32_t*>(tile + (g + 8) * ld + 2 * t);
  a[2] = *reinterpret_cast<const uint32_t*>(tile + g * ld + 2 * t + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(tile + (g + 8) * ld + 2 * t + 8);
}

// Loads the B fragment of a 16(k)x8(n) tile whose columns are stored contiguously: element (k, n) at
// tile[n * ld + k] (i.e. the transposed operand stored row-major, as Kd for Kd·Sᵀ).
__device__ __forceinline__ void load_b_frag(uint32_t (&b)[2], const __nv_bfloat16* tile, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  b[0] = *reinterpret_cast<const uint32_t*>(tile + g * ld + 2 * t);
  b[1] = *reinterpret_cast<const uint32_t*>(tile + g * ld + 2 * t + 8);
}

// Converts the fp32 accumulators of two adjacent n8 tiles (columns 16s..16s+15 of a 16-row block) into
// the bf16 A fragment covering those 16 columns as the k dimension of the next product.
__device__ __forceinline__ void acc_to_a_frag(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

// Sequence boundaries [bos, eos) of sequence n, clamped to [0, total_tokens] so malformed cu_seqlens can
// never send a kernel out of bounds (their results are unspecified, but memory stays safe).
struct SeqBounds {
  int64_t bos;
  int64_t eos;
};

__device__ __forceinline__ int64_t load_cu(const void* cu, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(cu)[i] : static_cast<int64_t>(static_cast<const int32_t*>(cu)[i]);
}

__device__ __forceinline__ SeqBounds seq_bounds(const void* cu, bool is_int64, int64_t n, int64_t seqlen,
                                                int64_t total_tokens) {
  int64_t bos, eos;
  if (cu == nullptr) {
    bos = n * seqlen;
    eos = bos + seqlen;
  } else {
    bos = load_cu(cu, is_int64, n);
    eos = load_cu(cu, is_int64, n + 1);
  }
  bos = bos < 0 ? 0 : (bos > total_tokens ? total_tokens : bos);
  eos = eos < bos ? bos : (eos > total_tokens ? total_tokens : eos);
  return {bos, eos};
}

// First chunk slot of sequence n (see kda_params.h).
__device__ __forceinline__ int64_t first_slot(int64_t bos, int64_t n) { return bos / 16 + n; }

// First segment slot of sequence n for the time split with `segment_chunks` chunks per segment (kda_params.h).
__device__ __forceinline__ int64_t first_segment_slot(int64_t bos, int64_t n, int segment_chunks) {
  return bos / (16 * static_cast<int64_t>(segment_chunks)) + n;
}

// The largest n in [0, num_seqs) with first(bos_n, n) <= slot, for a slot numbering `first` that grows
// strictly with n (chunk slots, segment slots): a binary search over cu_seqlens.
template <typename First>
__device__ int64_t find_sequence(const void* cu, bool is_int64, int64_t num_seqs, int64_t seqlen,
                                 int64_t total_tokens, int64_t slot, First first) {
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    const SeqBounds b = seq_bounds(cu, is_int64, mid, seqlen, total_tokens);
    if (first(b.bos, mid) <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace kda
