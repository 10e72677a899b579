// How the portable kernels spread one item's channels over a team of lanes, and the compiled
// variants ("configs") of that layout.
//
// A thread moves VEC channels per load and holds NV such vectors; vector j of lane t covers
// channels [(j * team + t) * VEC, +VEC), so a team reads each corner as one contiguous run.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../common/problem.h"

namespace mmdeform_tma {
namespace portable {

// 16-byte vectors load best; 8-byte ones make a half-precision team's fp32 gradient reductions
// cover one contiguous 128-byte run per instruction (measured: ~35% faster backward).
enum class VecKind { k16Bytes, k8Bytes, kPair, kSingle };

struct Config {
  const char* name;
  VecKind vec;
  int nv;           // vectors per thread
  int threads;      // block size
  bool head_major;  // consecutive teams take consecutive queries of one head (L1 reuse), else the
                    // heads of one query
};

// The compiled variants, in `config` index order (shared by forward and backward).
inline const std::vector<Config>& configs() {
  static const std::vector<Config> all = {
      {"v16_n1_t256_hm", VecKind::k16Bytes, 1, 256, true}, {"v16_n2_t256_hm", VecKind::k16Bytes, 2, 256, true},
      {"v16_n4_t256_hm", VecKind::k16Bytes, 4, 256, true}, {"v2_n4_t256_hm", VecKind::kPair, 4, 256, true},
      {"v1_n8_t256_hm", VecKind::kSingle, 8, 256, true},   {"v16_n1_t256_qm", VecKind::k16Bytes, 1, 256, false},
      {"v16_n2_t256_qm", VecKind::k16Bytes, 2, 256, false}, {"v16_n1_t128_hm", VecKind::k16Bytes, 1, 128, true},
      {"v16_n2_t128_hm", VecKind::k16Bytes, 2, 128, true}, {"v8_n1_t256_hm", VecKind::k8Bytes, 1, 256, true},
      {"v8_n1_t256_qm", VecKind::k8Bytes, 1, 256, false},  {"v8_n1_t128_hm", VecKind::k8Bytes, 1, 128, true},
  };
  return all;
}

inline std::vector<std::string> config_names() {
  std::vector<std::string> names;
  for (const auto& c : configs()) names.emplace_back(c.name);
  return names;
}

inline int vec_elements(VecKind kind, int element_size) {
  switch (kind) {
    case VecKind::k16Bytes:
      return 16 / element_size;
    case VecKind::k8Bytes:
      return 8 / element_size;
    case VecKind::kPair:
      return 2;
    default:
      return 1;
  }
}

struct TeamLayout {
  Config config;
  int vec;        // elements per vector
  int team_log2;  // lanes per item = 1 << team_log2
};

// The layout a config gives for these channels, or an empty optional-like result (vec == 0) with
// `why` set when the config cannot serve them.
// `alignment` is the largest power of two (at most 16) dividing every tensor address involved.
inline TeamLayout team_layout(const Config& config, int channels, int element_size, int alignment, std::string* why) {
  const int vec = vec_elements(config.vec, element_size);
  TeamLayout layout{config, 0, 0};
  if (channels % vec != 0) {
    *why = "channels are not a multiple of the vector width";
    return layout;
  }
  if (alignment % (vec * element_size) != 0) {
    *why = "the tensors are not aligned to the vector width";
    return layout;
  }
  const int vectors = channels / vec;
  const int per_lane = (vectors + config.nv - 1) / config.nv;
  int team_log2 = 0;
  while ((1 << team_log2) < per_lane) ++team_log2;
  if (team_log2 > 5) {
    *why = "a team would need more than 32 lanes";
    return layout;
  }
  layout.vec = vec;
  layout.team_log2 = team_log2;
  return layout;
}

// The default when no tuned config is given: the widest vectors, the fewest per thread.
inline TeamLayout default_team_layout(int channels, int element_size, int alignment) {
  std::string why;
  for (const auto& config : configs()) {
    if (config.threads != 256 || !config.head_major) continue;
    TeamLayout layout = team_layout(config, channels, element_size, alignment, &why);
    if (layout.vec != 0) return layout;
  }
  TORCH_CHECK(false, "mmdeform_tma cuda: no kernel layout for ", num(channels), " channels");
}

inline TeamLayout choose_team_layout(int64_t config, int channels, int element_size, int alignment) {
  if (config < 0) return default_team_layout(channels, element_size, alignment);
  TORCH_CHECK(config < static_cast<int64_t>(configs().size()), "mmdeform_tma cuda: config ", num(config), " out of range");
  std::string why;
  TeamLayout layout = team_layout(configs()[config], channels, element_size, alignment, &why);
  TORCH_CHECK(layout.vec != 0, "mmdeform_tma cuda: config ", configs()[config].name, " cannot run ", num(channels),
              " channels: ", why);
  return layout;
}

inline int alignment_of(std::initializer_list<const void*> pointers) {
  int alignment = 16;
  for (const void* p : pointers) {
    while (reinterpret_cast<uintptr_t>(p) % alignment != 0) alignment >>= 1;
  }
  return alignment;
}

}  // namespace portable
}  // namespace mmdeform_tma
