#include "problem.h"

#include <c10/util/Exception.h>

namespace mmdeform_tma {

std::string shape_string(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + ")";
}

ProblemTensors check_problem(
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    const std::string& what) {
  TORCH_CHECK(value.dim() == 4, what, ": value must be (bs, num_keys, heads, channels), got ", shape_string(value.sizes()));
  TORCH_CHECK(spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2, what, ": spatial_shapes must be (levels, 2)");
  TORCH_CHECK(level_start_index.dim() == 1, what, ": level_start_index must be (levels,)");
  TORCH_CHECK(
      sampling_locations.dim() == 6 && sampling_locations.size(5) == 2,
      what, ": sampling_locations must be (bs, queries, heads, levels, points, 2)");
  TORCH_CHECK(attention_weights.dim() == 5, what, ": attention_weights must be (bs, queries, heads, levels, points)");

  const int64_t batch = value.size(0), num_keys = value.size(1), heads = value.size(2), channels = value.size(3);
  const int64_t queries = sampling_locations.size(1), levels = spatial_shapes.size(0), points = sampling_locations.size(4);
  TORCH_CHECK(
      sampling_locations.size(0) == batch && sampling_locations.size(2) == heads && sampling_locations.size(3) == levels,
      what, ": sampling_locations ", shape_string(sampling_locations.sizes()), " does not match value ",
      shape_string(value.sizes()), " and spatial_shapes ", shape_string(spatial_shapes.sizes()));
  TORCH_CHECK(
      attention_weights.sizes() == sampling_locations.sizes().slice(0, 5),
      what, ": attention_weights ", shape_string(attention_weights.sizes()), " does not match sampling_locations ",
      shape_string(sampling_locations.sizes()));
  TORCH_CHECK(level_start_index.size(0) == levels, what, ": level_start_index must have one entry per level");
  TORCH_CHECK(num_keys < (int64_t(1) << 31), what, ": num_keys must be below 2^31");
  TORCH_CHECK(channels <= 256, what, ": at most 256 channels per head are supported, got ", num(channels));
  TORCH_CHECK(
      batch * queries * heads < (int64_t(1) << 31), what, ": batch x queries x heads must be below 2^31, got ",
      num(batch * queries * heads));

  const auto scalar = value.scalar_type();
  TORCH_CHECK(
      scalar == at::kFloat || scalar == at::kHalf || scalar == at::kBFloat16 || scalar == at::kDouble,
      what, ": value must be float16, bfloat16, float32 or float64, got ", dtype_string(scalar));
  const auto coord = scalar == at::kDouble ? at::kDouble : at::kFloat;
  for (const auto* t : {&sampling_locations, &attention_weights}) {
    TORCH_CHECK(
        t->scalar_type() == coord || t->scalar_type() == scalar,
        what, ": sampling_locations and attention_weights must be float32 or value's dtype, got ",
        dtype_string(t->scalar_type()));
  }
  TORCH_CHECK(
      spatial_shapes.scalar_type() == at::kLong && level_start_index.scalar_type() == at::kLong,
      what, ": spatial_shapes and level_start_index must be int64");

  const auto device = value.device();
  for (const auto* t : {&spatial_shapes, &level_start_index, &sampling_locations, &attention_weights}) {
    TORCH_CHECK(t->device() == device, what, ": all tensors must be on ", device_string(device), ", found one on ",
                device_string(t->device()));
  }
  for (const auto* t : {&value, &spatial_shapes, &level_start_index, &sampling_locations, &attention_weights}) {
    TORCH_CHECK(t->is_contiguous(), what, ": inputs must be contiguous");
  }

  return ProblemTensors{
      value,
      spatial_shapes,
      level_start_index,
      sampling_locations.to(coord),
      attention_weights.to(coord),
      batch,
      num_keys,
      heads,
      channels,
      levels,
      points,
      queries};
}

}  // namespace mmdeform_tma
