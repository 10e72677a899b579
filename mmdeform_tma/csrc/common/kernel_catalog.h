// A registry of compiled kernel variants, so the CUDA sources can publish their tunable
// configurations to Python (autotuner, info) without the schema file knowing about them.
#pragma once

#include <string>
#include <vector>

namespace mmdeform_tma {

// Variant names of `backend` for `direction` ("forward" / "backward"), in `config` index order.
std::vector<std::string> kernel_config_names(const std::string& backend, const std::string& direction);

// Registers variant names at static-initialisation time; one object per backend and direction.
struct KernelConfigRegistration {
  KernelConfigRegistration(const std::string& backend, const std::string& direction, std::vector<std::string> names);
};

}  // namespace mmdeform_tma
