// C entry points into hopper/region_plan.h for tests/backends/test_region_plan.py (loaded by ctypes).
#include "region_plan.h"

using namespace mmdeform_tma::tma_ws::region_plan;

namespace {

// Levels from (height, width) pairs, starts accumulated as the package's level_start_index.
void read_levels(const int* shapes, int levels, LevelShape* out) {
  int start = 0;
  for (int l = 0; l < levels; ++l) {
    out[l] = LevelShape{shapes[2 * l], shapes[2 * l + 1], start};
    start += shapes[2 * l] * shapes[2 * l + 1];
  }
}

}  // namespace

extern "C" {

long long plan_floor_div(long long a, long long b) { return floor_div(a, b); }

int plan_box_width(int box) { return box_width(box); }
int plan_buffer_bytes(int buffer) { return buffer_bytes(buffer); }
int plan_stages_a_pass(int levels) { return stages_a_pass(levels); }
int plan_constant(int which) {
  const int values[] = {kRowBytes, kMaxLevels, kRegionRows, kRegionCols, kMargin, kBoxes};
  return values[which];
}

// grid: height, width, rows, cols.
void plan_region_grid(const int* shapes, int levels, int* grid) {
  LevelShape lv[kMaxLevels];
  read_levels(shapes, levels, lv);
  const RegionGrid g = region_grid(lv);
  grid[0] = g.height, grid[1] = g.width, grid[2] = g.rows, grid[3] = g.cols;
}

// item: batch, head, row, col.
void plan_item_at(const int* shapes, int levels, int item, int heads, int* out) {
  LevelShape lv[kMaxLevels];
  read_levels(shapes, levels, lv);
  const Item it = item_at(item, heads, region_grid(lv));
  out[0] = it.batch, out[1] = it.head, out[2] = it.row, out[3] = it.col;
}

// queries: row, col, cols, count of level `level` in item `item`.
void plan_region_queries(const int* shapes, int levels, int item, int heads, int level, int* out) {
  LevelShape lv[kMaxLevels];
  read_levels(shapes, levels, lv);
  const RegionGrid g = region_grid(lv);
  const RegionQueries r = region_queries(item_at(item, heads, g), g, lv[level]);
  out[0] = r.row, out[1] = r.col, out[2] = r.cols, out[3] = r.count;
}

// window: x, y, rows, box of level `level` in item `item` for a buffer of `capacity` bytes.
void plan_level_window(const int* shapes, int levels, int item, int heads, int level, int capacity, int* out) {
  LevelShape lv[kMaxLevels];
  read_levels(shapes, levels, lv);
  const RegionGrid g = region_grid(lv);
  const Window w = level_window(item_at(item, heads, g), g, lv[level], capacity);
  out[0] = w.x, out[1] = w.y, out[2] = w.rows, out[3] = w.box;
}

// Returns next_copy's kind (NextCopy::Kind's order) and its level in *level.
int plan_next_copy(int s, int levels, int pass, int passes, int next_item_exists, int* level) {
  const NextCopy next = next_copy(s, levels, pass, passes, next_item_exists != 0);
  *level = next.level;
  return static_cast<int>(next.kind);
}

}  // extern "C"
