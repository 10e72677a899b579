// The `tma_ws` tensor-core gather forward (tensor_core_forward.cu): the `tc_*` forward configs.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../common/problem.h"
#include "window_config.h"

namespace mmdeform_tma {
namespace tma_ws {

// Why these inputs cannot feed a tensor-core forward's 16-bit operands (fp16/bf16 heads of 32 channels,
// one 64-byte row), naming `forward` in the reason; empty when they can.
std::string half_heads_of_32_unsupported(const ProblemTensors& problem, const std::string& forward);

// Why these inputs cannot run on the tensor-core gather forward; empty when they can.
std::string tensor_core_forward_unsupported(const ProblemTensors& problem);

// Writes the forward of a non-empty problem into `output` (batch, queries, heads x channels).
void tensor_core_forward(const ProblemTensors& problem, const hopper::window::TensorCoreForwardConfig& config,
                         at::Tensor& output);

}  // namespace tma_ws
}  // namespace mmdeform_tma
