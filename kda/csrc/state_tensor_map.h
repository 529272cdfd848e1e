// The tensor maps through which the stream pass (stream_pass.cuh) brings a bf16 initial state into shared memory and
// sends a bf16 final state back: states [slots · H][V][K] as boxes of 64 columns (128 bytes) by 128 rows (a whole
// state, one thread's two copies) or 16 (a step warp's rows, its two stores), swizzled by 128 bytes so that the step
// warps' fragment accesses stay free of bank conflicts. Encoded on the host for each launch by the driver's
// cuTensorMapEncodeTiled, found once through the runtime (the extension links no driver library).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "kda/csrc/cuda_check.h"
#include "kda/csrc/kda_params.h"

namespace kda {

constexpr int kStateBoxColumns = 64;  // 128 bytes of bf16: the widest box the 128-byte swizzle takes

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* found = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    KDA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &found, 12000, cudaEnableDefault,
                                                    &status));
    if (status != cudaDriverEntryPointSuccess || found == nullptr) {
      throw std::runtime_error("flash_kda: the CUDA driver offers no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<EncodeTiledFn>(found);
  }();
  return fn;
}

// The map of the bf16 states `name` [slots][heads][V][K] (slots > 0; 16-byte aligned: validation.py): box
// [1][box_rows][64], coordinates (column, row, slot · heads + head), the last one a 32-bit signed int.
inline CUtensorMap bf16_state_tensor_map(const void* states, int64_t slots, int heads, int box_rows, const char* name) {
  const int64_t planes = slots * heads;
  if (planes > std::numeric_limits<int32_t>::max()) {
    throw std::length_error("flash_kda: a state pool of " + std::to_string(slots) + " slots x " +
                            std::to_string(heads) + " heads is beyond the stream pass's 2^31 - 1 (slot, head) pairs");
  }
  CUtensorMap map{};
  const cuuint64_t dims[3] = {kHeadDim, kHeadDim, static_cast<cuuint64_t>(planes)};
  const cuuint64_t strides[2] = {kHeadDim * 2, kHeadDim * kHeadDim * 2};  // bytes, of dimensions 1 and 2
  const cuuint32_t box[3] = {kStateBoxColumns, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(states), dims,
                                         strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error(std::string("flash_kda: cuTensorMapEncodeTiled failed for ") + name + " (CUresult " +
                             std::to_string(static_cast<int>(result)) + ")");
  }
  return map;
}

}  // namespace kda
