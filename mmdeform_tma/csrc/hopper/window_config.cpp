#include "window_config.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "../common/cuda_runtime_utils.h"
#include "../common/kernel_catalog.h"

namespace mmdeform_tma {
namespace hopper {
namespace window {
namespace {

constexpr int kMaxWindowSide = 32;
constexpr int kMinWindowCols = 8;    // 8 cells x 16 bytes: the 128-byte TMA destination alignment

int round128(int bytes) { return (bytes + 127) / 128 * 128; }

int floor_pow2(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

int log2_exact(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

// The default, from the H100 measurements in docs/perf_notes.md: 4 consumer warps, 3 stages,
// 64-query tiles in the forward and 32 in the backward; smaller tiles while the problem would give
// fewer than four tiles per SM slot (decoder shapes), so that every SM is busy. Windows in the
// backward of pixel-block tiles only: there they beat L1 by 4-8 %; in the forward, and for strips
// of unordered queries, loading a window cost more than the L1 hits it replaces. Pixel-block
// backwards that the MMA kernel takes (`mma_kernel`) run it.
Config default_config(const ProblemTensors& problem, int team, bool backward, bool mma_kernel) {
  const bool pixel_tiles = problem.queries == problem.num_keys;
  if (backward && pixel_tiles && mma_kernel) {
    // The MMA backward at 4 CTAs per SM: 0.81 ms against 1.06 for the best plain config on the
    // fp16 DETR encoder at bs 2, 3.14 against 4.20 at bs 8 (H100, 2026-11-24, commit 3366067;
    // perf_notes.md, session 12). fp32 (32 channels, the 3-CTA kernel): 0.879 against 1.011 for
    // the gather config at bs 2 (H100, 2026-11-25, commit 4e77ea3; session 25).
    return Config{"auto", 4, 32, 2, 0, false, 4, true};
  }
  Config c{"auto", 4, backward ? 32 : 64, 3, backward && pixel_tiles ? 16 : 0};
  const int min_slots = std::max(1, c.consumer_warps * 32 / team);
  const int64_t target_tiles = 4LL * multiprocessor_count();
  while (c.slots > min_slots &&
         problem.batch * problem.heads * ((problem.queries + c.slots - 1) / c.slots) < target_tiles) {
    c.slots /= 2;
  }
  return c;
}

// The tile order (LaunchShape::heads_outer). With heads inner, the tiles in flight (about four CTAs
// per SM) cover every head of the batches they are in: with sampling spread over the image, all of
// those batches' value, and in the backward their value gradient too (fp32 or wider). Past 3/4 of
// the L2 that working set thrashes it; heads outer keeps it to about one head's. On the fp32
// forward over 89,023 keys with 90,000 uniformly sampled queries: 0.877 ms at a0acf62, 0.616 at
// 7014f84 (H100, sweep s18; perf_notes.md, item 53). Below the threshold heads inner stays: with
// local sampling, forced heads outer was up to 4 % slower on an fp16 encoder backward.
bool tile_order_heads_outer(const ProblemTensors& problem, int slots, bool backward) {
  const int64_t element = problem.value.element_size();
  const int64_t gradient = backward ? std::max<int64_t>(element, 4) : 0;
  const int64_t bytes_per_batch = problem.num_keys * problem.heads * problem.channels * (element + gradient);
  const int64_t tiles_per_batch = std::max<int64_t>(1, problem.heads * ((problem.queries + slots - 1) / slots));
  const int64_t in_flight = 4LL * multiprocessor_count();
  const int64_t batches = std::min<int64_t>(problem.batch, (in_flight + tiles_per_batch - 1) / tiles_per_batch);
  return 4 * batches * bytes_per_batch > 3LL * current_device_attribute(cudaDevAttrL2CacheSize);
}

LaunchShape shape_for(const ProblemTensors& problem, const Config& config, int chunk_bytes, int meta_size,
                      int max_slots_per_team, int gather_entry_size, bool mma_kernel, int flush_element_bytes) {
  LaunchShape s{};
  const int element = static_cast<int>(problem.value.element_size());
  s.row_bytes = static_cast<int>(problem.channels) * element;
  s.chunk_bytes = chunk_bytes;
  s.team = s.row_bytes / chunk_bytes;
  s.consumer_warps = config.consumer_warps;
  const int teams = s.consumer_warps * 32 / s.team;
  s.slots_per_team = std::clamp(config.slots / teams, 1, max_slots_per_team);
  s.slots = teams * s.slots_per_team;
  s.block_rows = 1 << (log2_exact(s.slots) / 2);
  s.block_cols = s.slots / s.block_rows;
  s.block_cols_log2 = log2_exact(s.block_cols);
  s.pixel_tiles = problem.queries == problem.num_keys;
  s.stages = config.stages;
  s.meta_size = meta_size;
  // The MMA's k-steps take 16 slots each, at most four; its windows pay only where a tile's points
  // cluster, on pixel blocks (strips of unordered queries run without a window).
  s.mma = config.mma && mma_kernel && s.pixel_tiles && s.slots % 16 == 0 && s.slots <= kMmaMaxSlots;
  if (s.mma) {
    s.window_cols = s.window_rows = kMmaWindowSide;
  } else if (config.window_kbytes > 0) {
    const int cells = config.window_kbytes * 1024 / s.row_bytes;
    s.window_cols = std::clamp(floor_pow2(static_cast<int>(std::sqrt(static_cast<double>(cells)))), kMinWindowCols,
                               kMaxWindowSide);
    s.window_rows = std::clamp(cells / s.window_cols, 1, kMaxWindowSide);
  } else {
    s.window_cols = kMinWindowCols;  // still sizes the zero block
    s.window_rows = 0;
  }
  s.window_cols_log2 = log2_exact(s.window_cols);
  s.ctas_per_sm = config.ctas_per_sm;
  s.load_window = s.window_rows > 0 && !s.mma;
  s.window_bytes = s.load_window ? round128(s.window_rows * s.window_cols * s.row_bytes) : 0;
  s.meta_offset = s.window_bytes;
  const int stage_points = s.slots * static_cast<int>(problem.points);
  s.header_offset = s.meta_offset + round128(stage_points * meta_size);
  s.stage_bytes = s.header_offset + 128;
  // The index packs entry starts and cells into 16 bits each.
  s.gather = config.gather && gather_entry_size > 0 && s.window_rows > 0 && 4 * stage_points < (1 << 16);
  s.entry_size = s.gather ? gather_entry_size : 0;
  s.entries_offset = s.touched_offset = s.stage_bytes;
  const int cells = s.window_rows * s.window_cols;
  if (s.gather) {
    s.touched_offset = s.entries_offset + round128(4 * stage_points * gather_entry_size);
    s.stage_bytes = s.touched_offset + round128((std::min(cells, 4 * stage_points) + 1) * 4);
  }
  s.scratch_offset = s.stages * s.stage_bytes;
  s.grad_rows_offset = s.scratch_offset + (s.gather ? round128(cells * 4) : 0);
  s.grad_rows_bytes = s.gather ? round128(s.slots * static_cast<int>(problem.channels) * 4) : 0;
  s.a_offset = s.grad_rows_offset + 2 * s.grad_rows_bytes;
  s.a_stride = s.mma ? (cells + 8) * 2 : 0;  // 16 bytes of padding: ldmatrix rows in distinct banks
  s.a_bytes = s.mma ? round128(s.slots * s.a_stride) : 0;
  s.g_offset = s.a_offset + 2 * s.a_bytes;
  s.g_stride = s.mma ? (static_cast<int>(problem.channels) + 8) * 2 : 0;
  const int g_bytes = s.mma ? round128(s.slots * s.g_stride) : 0;
  s.g_lo_offset = s.mma && element == 4 ? s.g_offset + g_bytes : 0;
  s.barrier_offset = s.g_offset + (s.g_lo_offset > 0 ? 2 : 1) * g_bytes;
  s.weight_scale = 1.0f;
  if (s.mma && problem.value.scalar_type() != at::kBFloat16) {  // fp16 A: the largest power of two <= 2^15 / points
    s.weight_scale = 32768.0f;
    while (s.weight_scale > 1.0f && s.weight_scale * static_cast<float>(problem.points) > 32768.0f) s.weight_scale *= 0.5f;
  }
  s.inverse_weight_scale = 1.0f / s.weight_scale;
  s.total_bytes = s.barrier_offset + round128(2 * s.stages * 8) + 128;  // + alignment slack
  // A window row (kMmaWindowSide cells) of every channel per consumer warp, after the barriers (the
  // slack is then not needed: the kernels check the base's alignment). The fp16 kernel at 4 CTAs
  // per SM stages half a row at a time: a whole one would leave room for 3 CTAs (65,536 bytes at 32
  // slots; 57,344 fit four). bf16's spills at 4 CTAs, and its `_o4` configs run the 3-CTA kernel.
  s.flush_offset = s.flush_bytes = 0;
  if (s.mma && problem.channels == 32 && flush_element_bytes > 0) {
    const bool halves = problem.value.scalar_type() == at::kHalf && config.ctas_per_sm == 4;
    const int cells = halves ? kMmaWindowSide / 2 : kMmaWindowSide;
    s.flush_offset = (s.barrier_offset + round128(2 * s.stages * 8) + 1023) / 1024 * 1024;
    s.flush_bytes = cells * static_cast<int>(problem.channels) * flush_element_bytes;
    s.total_bytes = s.flush_offset + s.consumer_warps * s.flush_bytes;
  }
  return s;
}

}  // namespace

const std::vector<Config>& configs() {
  static const std::vector<Config> all = [] {
    std::vector<Config> list;
    for (int consumer_warps : {4, 2})
      for (int slots : {64, 32, 16})
        for (int stages : {3, 2})
          for (int window_kbytes : {0, 16}) {
            list.push_back({"c" + std::to_string(consumer_warps) + "_t" + std::to_string(slots) + "_s" +
                                std::to_string(stages) + (window_kbytes ? "_w" + std::to_string(window_kbytes) : "_l1"),
                            consumer_warps, slots, stages, window_kbytes});
          }
    // Backward only, after the shared ones so that those keep their indices; not measured yet, so
    // the default never picks them. Two stages keep the 32-query tile at 3 CTAs per SM.
    list.push_back({"c4_t32_s2_w16_g", 4, 32, 2, 16, true});
    list.push_back({"c4_t32_s3_w16_g", 4, 32, 3, 16, true});
    list.push_back({"c4_t64_s2_w16_g", 4, 64, 2, 16, true});
    // Backward only, not measured yet: the best plain configs of the H100 table (encoders,
    // decoders) at 4 CTAs per SM. ncu had the encoder's at 3 CTAs (15 warps) and 83 % of L2
    // throughput where `cuda`'s backward, with twice the warps, reaches 90 % (perf_notes.md).
    list.push_back({"c4_t32_s2_w16_o4", 4, 32, 2, 16, false, 4});
    list.push_back({"c4_t16_s2_l1_o4", 4, 16, 2, 0, false, 4});
    // Backward only: the MMA backward (16 x 16-cell accumulation windows); the table's choice on
    // fp16/bf16 encoders since session 12.
    list.push_back({"c4_t32_s2_m16", 4, 32, 2, 0, false, 3, true});
    list.push_back({"c4_t32_s3_m16", 4, 32, 3, 0, false, 3, true});
    list.push_back({"c4_t64_s2_m16", 4, 64, 2, 0, false, 3, true});
    list.push_back({"c4_t32_s2_m16_o4", 4, 32, 2, 0, false, 4, true});
    return list;
  }();
  return all;
}

const std::vector<TensorCoreForwardConfig>& tensor_core_forward_configs() {
  // Decoder-sized grids want few items per CTA (DETR decoder bs 2: 4,800 items); perf_notes.md,
  // session 29. tc_w8_i1 and tc_w4_i2: the table's picks on the bs 1 and bs 2 DETR decoders
  // (session 30, item 66).
  static const std::vector<TensorCoreForwardConfig> all = {
      {"tc_w8_i2", 8, 2}, {"tc_w8_i4", 8, 4}, {"tc_w4_i8", 4, 8}, {"tc_w4_i16", 4, 16}, {"tc_w8_i1", 8, 1},
      {"tc_w4_i2", 4, 2}};
  return all;
}

const std::vector<RegionForwardConfig>& region_forward_configs() {
  // perf_notes.md, items 142-145.
  // The fallback: the H100 table's windowless pick for the fp16 and bf16 DETR encoders at bs 2.
  static const std::vector<RegionForwardConfig> all = {{"rg_r8x16", "c2_t16_s3_l1"}};
  return all;
}

int64_t config_index(const std::string& name) {
  for (int64_t i = 0; i < static_cast<int64_t>(configs().size()); ++i) {
    if (configs()[i].name == name) return i;
  }
  TORCH_CHECK(false, "mmdeform_tma tma_ws: no config named ", name);
}

int64_t shared_config_count() {
  static const int64_t count = [] {
    int64_t n = 0;
    while (n < static_cast<int64_t>(configs().size()) && !configs()[n].backward_only()) ++n;
    for (int64_t i = n; i < static_cast<int64_t>(configs().size()); ++i) {
      TORCH_CHECK(configs()[i].backward_only(), "mmdeform_tma tma_ws: the backward-only configs must come last");
    }
    return n;
  }();
  return count;
}

std::vector<std::string> config_names() {
  std::vector<std::string> names;
  for (int64_t i = 0; i < shared_config_count(); ++i) names.push_back(configs()[i].name);
  for (const auto& c : tensor_core_forward_configs()) names.push_back(c.name);
  for (const auto& c : region_forward_configs()) names.push_back(c.name);
  return names;
}

std::vector<std::string> backward_config_names() {
  std::vector<std::string> names;
  for (const auto& c : configs()) names.push_back(c.name);
  return names;
}

bool is_mma_config(int64_t config) {
  return config >= 0 && config < static_cast<int64_t>(configs().size()) && configs()[config].mma;
}

LaunchShape launch_shape(const ProblemTensors& problem, int64_t config, int chunk_bytes, int meta_size,
                         int max_slots_per_team, bool backward, int gather_entry_size, bool mma_kernel,
                         int flush_element_bytes) {
  const int row_bytes = static_cast<int>(problem.channels * problem.value.element_size());
  const int limit = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  if (config >= 0) {
    const int64_t count = backward ? static_cast<int64_t>(configs().size()) : shared_config_count();
    TORCH_CHECK(config < count, "mmdeform_tma tma_ws: config ", num(config), " out of range");
    LaunchShape s = shape_for(problem, configs()[config], chunk_bytes, meta_size, max_slots_per_team,
                              backward ? gather_entry_size : 0, backward && mma_kernel, backward ? flush_element_bytes : 0);
    TORCH_CHECK(s.total_bytes <= limit, "mmdeform_tma tma_ws: config ", configs()[config].name, " needs ",
                num(s.total_bytes), " bytes of shared memory for ", num(problem.points), " points per level; the GPU allows ",
                num(limit));
    s.heads_outer = tile_order_heads_outer(problem, s.slots, backward);
    return s;
  }
  // Shrink the default until it fits: fewer stages, then smaller windows, then smaller tiles.
  Config c = default_config(problem, row_bytes / chunk_bytes, backward, mma_kernel);
  for (;;) {
    LaunchShape s = shape_for(problem, c, chunk_bytes, meta_size, max_slots_per_team, 0, mma_kernel, flush_element_bytes);
    if (s.total_bytes <= limit) {
      s.heads_outer = tile_order_heads_outer(problem, s.slots, backward);
      return s;
    }
    if (c.stages > 2) {
      --c.stages;
    } else if (c.window_kbytes > 4) {
      c.window_kbytes /= 2;
    } else if (s.slots_per_team > 1) {
      c.slots = s.slots / 2;
    } else if (c.consumer_warps > 1) {
      c.consumer_warps /= 2;
      c.slots = s.slots / 2;
    } else {
      TORCH_CHECK(false, "mmdeform_tma tma_ws: ", num(problem.points), " points per level need ", num(s.total_bytes),
                  " bytes of shared memory even in the smallest tile; the GPU allows ", num(limit));
    }
  }
}

LaunchShape spread_fallback_shape(const ProblemTensors& problem, const LaunchShape& mma, int chunk_bytes, int meta_size) {
  // No window (the sampling spreads), the MMA tile's slots, 2 stages and 4 CTAs per SM as
  // c4_t16_s2_l1_o4, the plain config that tied `cuda` on uniformly sampled encoders (perf_notes.md,
  // session 26). With the MMA tile's 32 slots (two per team) it is 3-4 % slower than that (item 57).
  const Config plain{"spread", mma.consumer_warps, mma.slots, 2, 0, false, 4, false};
  LaunchShape s = shape_for(problem, plain, chunk_bytes, meta_size, kMaxBackwardSlotsPerTeam, 0, false, 0);
  s.heads_outer = mma.heads_outer;
  return s;
}

namespace {
const KernelConfigRegistration kForward("tma_ws", "forward", config_names());
const KernelConfigRegistration kBackward("tma_ws", "backward", backward_config_names());
}  // namespace

}  // namespace window
}  // namespace hopper
}  // namespace mmdeform_tma
