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
  return run_backward(problem, grad_output, deterministic, grad_value_layout(problem, grad_output, deterministic),
                      "mmdeform_tma cuda backward",
                      [&](auto sink, const auto* go, auto* grad_locations, auto* grad_weights) {
    using scalar_t = ScalarOf<decltype(go)>;
    const TeamLayout layout = choose_team_layout(
        config, static_cast<int>(problem.channels), static_cast<int>(problem.value.element_size()),
        alignment_of({problem.value.data_ptr(), grad_output.data_ptr()}));
    const int64_t threads_needed = problem.num_items() << layout.team_log2;
    const int threads = layout.config.threads;
    const unsigned blocks = static_cast<unsigned>((threads_needed + threads - 1) / threads);
    with_vector_shape<scalar_t>(layout, [&](auto vec, auto nv) {
      backward_kernel<scalar_t, decltype(vec)::value, decltype(nv)::value><<<blocks, threads, 0, current_stream()>>>(
          problem.problem<scalar_t>(), go, sink, grad_locations, grad_weights, layout.team_log2,
          layout.config.head_major);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace portable
}  // namespace mmdeform_tma
