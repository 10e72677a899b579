// The `tma_ws` tensor-core gather forward (tensor_core_forward.cu): the `tc_*` forward configs.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../common/problem.h"
#include "window_config.h"

namespace mmdeform_tma {
namespace tma_ws {

// Why these inputs cannot run on the tensor-core gather forward; empty when they can.
std::string tensor_core_forward_unsupported(const ProblemTensors& problem);

// Writes the forward of a non-empty problem into `output` (batch, queries, heads x channels).
void tensor_core_forward(const ProblemTensors& problem, const hopper::window::TensorCoreForwardConfig& config,
                         at::Tensor& output);

}  // namespace tma_ws
}  // namespace mmdeform_tma
