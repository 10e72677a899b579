#include "../common/cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include "../common/dtype_dispatch.cuh"
#include "../common/kernel_catalog.h"
#include "../common/launchers.h"
#include "portable_kernels.cuh"

namespace mmdeform_tma {
namespace portable {

static const KernelConfigRegistration kBackwardConfigs("cuda", "backward", config_names());

Gradients backward(const ProblemTensors& problem, const at::Tensor& grad_output, int64_t config, bool deterministic) {
  const auto coordinate_grads = coordinate_gradients(problem);
  const at::Tensor& grad_locations = coordinate_grads.first;
  const at::Tensor& grad_weights = coordinate_grads.second;
  ValueGradient grad_value(problem, grad_output, deterministic);
  if (problem.empty_output() || problem.levels == 0 || problem.points == 0) {
    grad_locations.zero_();
    grad_weights.zero_();
    return {grad_value.finish(), grad_locations, grad_weights};
  }
  const int element_size = static_cast<int>(problem.value.element_size());
  const TeamLayout layout = choose_team_layout(
      config, static_cast<int>(problem.channels), element_size,
      alignment_of({problem.value.data_ptr(), grad_output.data_ptr()}));
  const int64_t threads_needed = problem.num_items() << layout.team_log2;
  const int threads = layout.config.threads;
  const unsigned blocks = static_cast<unsigned>((threads_needed + threads - 1) / threads);
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma cuda backward", [&] {
    using coord_t = coord_type<scalar_t>;
    const auto* go = reinterpret_cast<const scalar_t*>(grad_output.data_ptr());
    with_vector_shape<scalar_t>(layout, [&](auto vec, auto nv) {
      constexpr int kVec = decltype(vec)::value, kNv = decltype(nv)::value;
      if (deterministic) {
        backward_kernel<scalar_t, kVec, kNv><<<blocks, threads, 0, stream>>>(
            problem.problem<scalar_t>(), go, grad_value.fixed_point_sink<scalar_t>(),
            grad_locations.data_ptr<coord_t>(), grad_weights.data_ptr<coord_t>(), layout.team_log2, layout.config.head_major);
      } else {
        backward_kernel<scalar_t, kVec, kNv><<<blocks, threads, 0, stream>>>(
            problem.problem<scalar_t>(), go, grad_value.atomic_sink<scalar_t>(), grad_locations.data_ptr<coord_t>(),
            grad_weights.data_ptr<coord_t>(), layout.team_log2, layout.config.head_major);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_value.finish(), grad_locations, grad_weights};
}

}  // namespace portable
}  // namespace mmdeform_tma
