#include "tensor_map.h"

#include "../common/problem.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#ifndef MMDEFORM_TMA_WITH_HOPPER
#define MMDEFORM_TMA_WITH_HOPPER 0
#endif

namespace mmdeform_tma {
namespace hopper {
namespace {

// The driver's encoder, found at run time so the extension does not link libcuda.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr,
                "mmdeform_tma: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

CUtensorMapDataType tma_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf:
      return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case at::kBFloat16:
      return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case at::kFloat:
      return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case at::kDouble:
      return CU_TENSOR_MAP_DATA_TYPE_FLOAT64;
    default:
      TORCH_CHECK(false, "mmdeform_tma: no TMA type for ", c10::toString(type));
  }
}

// A 2-D map over `rows` rows of `columns` elements (contiguous, `element` bytes each) with boxes of
// box_columns x box_rows; `what()` names the tensor in errors, called only for one (a map is encoded
// on every call: the name's formatting would be host cost on each).
template <typename Describe>
CUtensorMap tensor_map_2d(void* data, CUtensorMapDataType type, int64_t element, int64_t rows, int64_t columns,
                          int box_columns, int box_rows, CUtensorMapSwizzle swizzle, const Describe& what) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data) % 16 == 0, "mmdeform_tma: ", what(), " must be 16-byte aligned");
  TORCH_CHECK(rows > 0 && rows < (int64_t(1) << 31), "mmdeform_tma: batch x num_keys must be in [1, 2^31)");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(columns * element)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_columns), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(&map, type, 2, data, dims, strides, box, element_strides,
                                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "mmdeform_tma: cuTensorMapEncodeTiled failed with error ",
              num(static_cast<int>(result)), " for ", what(), " (", num(rows), " x ", num(columns), " elements of ",
              num(element), " B)");
  return map;
}

}  // namespace

namespace {

CUtensorMap value_map(const at::Tensor& value, int box_keys, CUtensorMapSwizzle swizzle) {
  return tensor_map_2d(value.data_ptr(), tma_dtype(value.scalar_type()), value.element_size(),
                       value.size(0) * value.size(1), value.size(2) * value.size(3), static_cast<int>(value.size(3)),
                       box_keys, swizzle, [&] {
                         return "value " + shape_string(value.sizes()) + " " + c10::toString(value.scalar_type());
                       });
}

}  // namespace

CUtensorMap value_tensor_map(const at::Tensor& value, int box_keys) {
  return value_map(value, box_keys, CU_TENSOR_MAP_SWIZZLE_NONE);
}

CUtensorMap value_window_row_map(const at::Tensor& value, int box_keys) {
  TORCH_CHECK(value.size(3) * value.element_size() == 64, "mmdeform_tma: the swizzled window map takes heads of 64 bytes");
  return value_map(value, box_keys, CU_TENSOR_MAP_SWIZZLE_64B);
}

CUtensorMap fixed_point_tensor_map(void* data, int64_t rows, int64_t columns, int box_keys) {
  constexpr int64_t kElement = 8;
  return tensor_map_2d(data, CU_TENSOR_MAP_DATA_TYPE_UINT64, kElement, rows, columns, kFixedPointBoxColumns, box_keys,
                       CU_TENSOR_MAP_SWIZZLE_NONE, [] { return "the value gradient's fixed-point accumulator"; });
}

void require_hopper(const std::string& backend) {
  TORCH_CHECK(MMDEFORM_TMA_WITH_HOPPER, "mmdeform_tma ", backend,
              ": this build has no sm_90a kernels; rebuild with TORCH_CUDA_ARCH_LIST including 9.0");
  int device = 0, major = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major == 9, "mmdeform_tma ", backend, ": sm_90a kernels need a compute capability 9.x GPU, device ",
              num(device), " is ", num(major), ".x");
}

void require_tma_channels(const at::Tensor& value, const std::string& backend) {
  const int64_t bytes = value.size(3) * value.element_size();
  TORCH_CHECK(bytes == 16 || bytes == 32 || bytes == 64 || bytes == 128 || bytes == 256, "mmdeform_tma ", backend,
              ": a head's channels must span 16, 32, 64, 128 or 256 bytes, got ", num(value.size(3)), " x ",
              num(value.element_size()), " B");
}

}  // namespace hopper
}  // namespace mmdeform_tma
