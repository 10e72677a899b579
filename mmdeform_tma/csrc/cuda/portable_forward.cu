#include "../common/cuda_runtime_utils.h"
#include <c10/cuda/CUDAException.h>

#include "../common/dtype_dispatch.cuh"
#include "../common/kernel_catalog.h"
#include "../common/launchers.h"
#include "portable_kernels.cuh"

namespace mmdeform_tma {
namespace portable {

static const KernelConfigRegistration kForwardConfigs("cuda", "forward", config_names());

at::Tensor forward(const ProblemTensors& problem, int64_t config) {
  at::Tensor output = uninitialized({problem.batch, problem.queries, problem.heads * problem.channels}, problem.value.options());
  if (problem.empty_output()) return output;
  const int element_size = static_cast<int>(problem.value.element_size());
  const TeamLayout layout = choose_team_layout(
      config, static_cast<int>(problem.channels), element_size,
      alignment_of({problem.value.data_ptr(), output.data_ptr()}));
  const int64_t threads_needed = problem.num_items() << layout.team_log2;
  const int threads = layout.config.threads;
  const int64_t blocks = (threads_needed + threads - 1) / threads;
  const auto stream = current_stream();
  MMDEFORM_TMA_DISPATCH_VALUE_TYPES(problem.value.scalar_type(), "mmdeform_tma cuda forward", [&] {
    with_vector_shape<scalar_t>(layout, [&](auto vec, auto nv) {
      forward_kernel<scalar_t, decltype(vec)::value, decltype(nv)::value>
          <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
              problem.problem<scalar_t>(), reinterpret_cast<scalar_t*>(output.data_ptr()), layout.team_log2, layout.config.head_major);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return output;
}

}  // namespace portable
}  // namespace mmdeform_tma
