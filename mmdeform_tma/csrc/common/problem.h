// The problem as the kernels see it, and the host-side checks every CUDA entry point shares.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace mmdeform_tma {

// Error messages format numbers, shapes and devices with these (std::to_string), never through an
// ostream: on the GPU image (GCC 13 against torch 2.11's libstdc++) std::ostream's integer
// formatting inside this extension crashed while TORCH_CHECK built its message.
inline std::string num(int64_t v) { return std::to_string(v); }
std::string shape_string(at::IntArrayRef sizes);
inline std::string device_string(const at::Device& device) { return device.str(); }
inline const char* dtype_string(at::ScalarType type) { return c10::toString(type); }

// Locations, weights and all index/weight arithmetic use fp32, or fp64 for an fp64 value (gradcheck).
template <typename scalar_t>
struct CoordTraits {
  using type = float;
};
template <>
struct CoordTraits<double> {
  using type = double;
};
template <typename scalar_t>
using coord_type = typename CoordTraits<scalar_t>::type;

// Kernel arguments. Layouts (all contiguous):
//   value      [batch, num_keys, heads, channels]
//   locations  [batch, queries, heads, levels, points, 2]   (x, y) in [0, 1]
//   weights    [batch, queries, heads, levels, points]
//   output     [batch, queries, heads, channels]
// An "item" is one (batch, query, head); items are numbered (b * queries + q) * heads + h.
template <typename scalar_t>
struct Problem {
  using coord_t = coord_type<scalar_t>;
  const scalar_t* __restrict__ value;
  const int64_t* __restrict__ spatial_shapes;  // [levels, 2] (h, w), on the device
  const int64_t* __restrict__ level_start;     // [levels]
  const coord_t* __restrict__ locations;
  const coord_t* __restrict__ weights;
  int num_items;  // < 2^31, checked by check_problem
  int num_keys;
  int heads;
  int channels;
  int levels;
  int points;
  int queries;
};

// The op's tensors after the common checks; locations and weights already in the coord dtype.
struct ProblemTensors {
  at::Tensor value, spatial_shapes, level_start_index, sampling_locations, attention_weights;
  int64_t batch, num_keys, heads, channels, levels, points, queries;

  template <typename scalar_t>
  Problem<scalar_t> problem() const {
    using coord_t = coord_type<scalar_t>;
    return Problem<scalar_t>{
        reinterpret_cast<const scalar_t*>(value.data_ptr()),  // scalar_t is a CUDA type (__half, ...)
        spatial_shapes.data_ptr<int64_t>(),
        level_start_index.data_ptr<int64_t>(),
        sampling_locations.data_ptr<coord_t>(),
        attention_weights.data_ptr<coord_t>(),
        static_cast<int>(batch * queries * heads),
        static_cast<int>(num_keys),
        static_cast<int>(heads),
        static_cast<int>(channels),
        static_cast<int>(levels),
        static_cast<int>(points),
        static_cast<int>(queries)};
  }
  bool empty_output() const { return batch == 0 || queries == 0 || heads == 0 || channels == 0; }
  int64_t num_items() const { return batch * queries * heads; }
};

// Checks shapes, dtypes, devices and contiguity (never values: that would synchronise), and
// casts fp16/bf16 locations and weights to fp32. `what` names the caller in error messages.
ProblemTensors check_problem(
    const at::Tensor& value,
    const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    const std::string& what);

// The three gradients, each in the dtype of the tensor it belongs to.
using Gradients = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

}  // namespace mmdeform_tma
