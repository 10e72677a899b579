#include "kernel_catalog.h"

#include <map>
#include <utility>

namespace mmdeform_tma {
namespace {

std::map<std::pair<std::string, std::string>, std::vector<std::string>>& catalog() {
  static std::map<std::pair<std::string, std::string>, std::vector<std::string>> entries;
  return entries;
}

}  // namespace

std::vector<std::string> kernel_config_names(const std::string& backend, const std::string& direction) {
  auto it = catalog().find({backend, direction});
  return it == catalog().end() ? std::vector<std::string>{} : it->second;
}

KernelConfigRegistration::KernelConfigRegistration(
    const std::string& backend, const std::string& direction, std::vector<std::string> names) {
  catalog()[{backend, direction}] = std::move(names);
}

}  // namespace mmdeform_tma
