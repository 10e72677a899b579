// Host side of the window-tiled `tma_ws` kernels: the compiled variants ("configs"), the launch
// geometry a config gives for a problem, and the shared-memory carve-up both roles agree on.
//
// A tile is `slots` queries of one (batch, head). Encoder self-attention (queries == keys, one
// query per pixel in raster order) is tiled in 2-D pixel blocks of one level, so a tile's sampling
// points cluster in every level; other problems are tiled in strips of consecutive queries. Each
// stage is one (tile, level): the producer warp computes the points' geometry, sizes a window over
// them and loads it with one TMA box per window row; the consumer warps interpolate (forward) or
// scatter gradients (backward) from it. Points outside the window read global memory through L1.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "../common/problem.h"

namespace mmdeform_tma {
namespace hopper {
namespace window {

// Queries a consumer team owns in a tile. The forward keeps each one's accumulators in registers
// across the tile's levels (16 per lane at most); the backward reloads a query's output gradient
// per stage, so its limit is only the tile size.
constexpr int max_forward_slots_per_team(int lane_elements) { return lane_elements >= 16 ? 1 : 2; }
constexpr int kMaxBackwardSlotsPerTeam = 4;

struct Config {
  std::string name;
  int consumer_warps;
  int slots;          // queries per tile (a power of two); fewer when the team is too wide for it
  int stages;         // pipeline depth, in (tile, level) stages
  int window_kbytes;  // value-window budget per stage; 0 turns windows off (every point via L1)
  bool gather = false;  // backward only: sum each window cell's contributions before reducing (below)
  // Backward only: CTAs per SM the kernel's registers are budgeted for. 4 (the `_o4` configs)
  // caps them at 96 where ptxas fits that without spills (the fast fp16/bf16 8-byte-lane and
  // fp32 kernels); elsewhere the kernel keeps its usual budget (3; fp64 1).
  int ctas_per_sm = 3;
  // Backward only: sum each tile's value-gradient contributions over a 16 x 16-cell accumulation
  // window on the tensor cores and reduce each touched cell once (window_backward.cu). No value
  // window is loaded: corners come through L1.
  bool mma = false;

  bool backward_only() const { return gather || ctas_per_sm != 3 || mma; }
};

const std::vector<Config>& configs();

// Forward only: the tensor-core gather forward (tensor_core_forward.cu), which has no tiles,
// window or pipeline: one warp per (batch, query, head) item, `warps` per CTA, each taking
// `items_per_warp` items.
struct TensorCoreForwardConfig {
  std::string name;
  int warps;
  int items_per_warp;
};
const std::vector<TensorCoreForwardConfig>& tensor_core_forward_configs();

// Forward only: the region forward (region_forward.cu) for encoder self-attention, a region of the
// first level's pixels and every query whose pixel centre lies in it a work item, its windows copied
// by TMA for all of them. `fallback`: the windowless configs() entry that runs instead where the
// sampling leaves the windows.
struct RegionForwardConfig {
  std::string name;
  std::string fallback;
};
const std::vector<RegionForwardConfig>& region_forward_configs();

// The index of configs() entry `name`; throws if there is none.
int64_t config_index(const std::string& name);

// configs() entries that both directions run: the forward's index i < shared_config_count() is
// configs()[i], as the backward's.
int64_t shared_config_count();
// The forward's configs: the shared ones, then the tensor-core gather ones (forward index
// shared_config_count() + i is tensor_core_forward_configs()[i]), then the region ones.
std::vector<std::string> config_names();
std::vector<std::string> backward_config_names();  // all of configs(): the shared ones, then the backward-only ones

// kRunIfSpread (forward): the windowless forward runs only where the region forward, before it on the
// stream, set spread_flags[0] (sampling that leaves its windows; region_forward.cu); otherwise it returns.
enum class SpreadRole : int { kNone = 0, kBailWhereSpread = 1, kRunFlaggedCtas = 2, kRunIfSpread = 3 };

// What both roles need to agree on; computed on the host, passed by value.
struct LaunchShape {
  int row_bytes;       // one cell: a head's channels of one key
  int chunk_bytes;     // bytes of a cell per lane: 16, or 8 in the half-precision backward
  int team;            // lanes per query slot: row_bytes / chunk_bytes
  int consumer_warps;
  int slots_per_team;  // query slots each team owns in a tile
  int slots;           // query slots per tile
  int block_rows, block_cols;  // pixel-block tiles: block_rows x block_cols = slots
  int block_cols_log2;
  bool pixel_tiles;
  int stages;
  int window_cols, window_rows;  // cells; window_rows == 0: no windows
  int meta_size;       // bytes of one point's metadata
  // Shared memory, byte offsets from a 128-byte aligned base.
  int stage_bytes;     // window + metadata + header of one stage
  int window_bytes;    // of one stage
  int meta_offset;     // within a stage
  int header_offset;   // within a stage
  int barrier_offset;
  int total_bytes;
  // Gather (backward configs with `gather`, when the kernel for the dtype is built): per stage, an
  // index from window cells to the tile's corners; consumers sum each cell in registers and reduce
  // once per touched cell. Per stage after the header: entries (4 per point, entry_size bytes each,
  // grouped by cell) and the touched cells ((start << 16) | cell, then a sentinel start).
  bool gather;
  // Tile order (window_pipeline.cuh, tile_at): heads outer, where the value of every head at once
  // would not stay in the L2 (tile_order_heads_outer). In gather's padding, so that every field the
  // windowless forward reads lies in the first 84 bytes (launch_persistent_without_map). Placed in
  // pixel_tiles' padding instead, it changed an unrelated backward kernel's code into a spill.
  bool heads_outer;
  int window_cols_log2;
  int entry_size;
  int entries_offset;  // within a stage
  int touched_offset;  // within a stage
  int scratch_offset;  // the producer's per-cell counters (window_rows x window_cols ints)
  // The tile's output-gradient rows in fp32, which the cell walk reads per entry: two buffers of
  // slots x channels floats, alternating by tile (written at a tile's first level).
  int grad_rows_offset;
  int grad_rows_bytes;  // of one buffer
  int ctas_per_sm;     // the config's register budget (Config::ctas_per_sm)
  // The window is loaded (TMA) for the consumers' corner reads; false for the MMA backward, whose
  // window only places the accumulation cells.
  bool load_window;
  // MMA backward (configs with `mma`, for fp16/bf16 rows of 32-128 channels, fp32 rows of 32,
  // and tiles of 16, 32 or 64 slots): the tile's weights per (slot, window cell) as hi and lo 16-bit
  // arrays (rows of a_stride bytes, a_bytes each), and its output-gradient rows (g_stride bytes):
  // in value's dtype, or for fp32 as fp16 hi parts at g_offset and lo parts at g_lo_offset (last).
  bool mma;
  int a_offset, a_stride, a_bytes;
  int g_offset, g_stride;
  // Deterministic MMA backward for rows of 32 channels: each warp stages a window
  // row's fixed-point sums in shared memory (flush_bytes at flush_offset + warp x flush_bytes,
  // 1024-byte aligned) and the TMA adds them to the value gradient (window_backward.cu). 0: the warps
  // reduce their sums through the sink.
  int flush_offset, flush_bytes;
  // fp16 (and fp32, whose A is fp16): a (slot, cell) entry of A sums at most `points` weights of
  // |a| <= 1 (larger ones take the direct path), so 2^15 / points keeps it finite and its lo part
  // normal down to weights of about points x 2^-18. bf16 has fp32's range: 1. Read from the
  // parameter bank, not a register.
  float weight_scale, inverse_weight_scale;
  // fp32 MMA: the lo parts of the staged rows; 0 otherwise. Last, so that adding it moved no field
  // the older kernels read (their machine code stayed byte-identical: tools/kernel_code_diff.py).
  int g_lo_offset;
  // Spread sampling (window_backward.cu, backward): the fast 32-channel MMA kernel runs with
  // kBailWhereSpread. Each MMA CTA whose first stage's points spread past the accumulation windows
  // (uniform sampling) records that in spread_flags[CTA] (0 otherwise) and leaves its tiles to the
  // fallback that follows: in fp16/bf16 a plain kernel on the same tiles and grid (kRunFlaggedCtas),
  // in fp32 the portable kernel's teams (spread_fallback.cuh).
  SpreadRole spread_role;
  int* spread_flags;
};

// The geometry `config` gives for this problem (-1: the default heuristic); throws with the reason
// when it cannot fit an SM. `gather_entry_size` > 0: the caller has a gather kernel, whose entries
// take that many bytes; a gather config then lays out its index (otherwise it runs without one).
// `mma_kernel`: the caller has an MMA kernel for this problem; an `mma` config then lays out its
// arrays when the tile allows (LaunchShape::mma), and otherwise runs without a window.
// `flush_element_bytes` > 0: the caller's MMA kernel stages its sums for TMA reductions, in elements
// of that size (8: fixed point), where the tile takes MMA dots (LaunchShape::flush_bytes).
LaunchShape launch_shape(const ProblemTensors& problem, int64_t config, int chunk_bytes, int meta_size,
                         int max_slots_per_team, bool backward, int gather_entry_size = 0, bool mma_kernel = false,
                         int flush_element_bytes = 0);

// The plain (direct) backward's geometry over the same tiles as `mma` (an MMA launch shape): the
// kernel that takes the tiles of MMA CTAs whose sampling spreads (LaunchShape::spread_role). Its
// `slots` differ from mma's where the team layout cannot hold them; the caller then runs the MMA
// kernel alone.
LaunchShape spread_fallback_shape(const ProblemTensors& problem, const LaunchShape& mma, int chunk_bytes, int meta_size);

// The MMA backward's accumulation window (cells a side) and its slot limit (four k-steps).
constexpr int kMmaWindowSide = 16;
// A point's cell in the MMA window is its top-left corner's plus this bias, so that it stays >= 0
// (in the window) for a point whose top-left corner lies at x or y = -1, outside its level.
constexpr int kMmaCellBias = kMmaWindowSide + 1;
constexpr int kMmaMaxSlots = 64;
// Whether backward config `config` (-1: the default) is an MMA config.
bool is_mma_config(int64_t config);

}  // namespace window
}  // namespace hopper
}  // namespace mmdeform_tma
