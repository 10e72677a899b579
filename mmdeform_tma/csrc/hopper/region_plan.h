// The region forward's plan (region_forward.cu): which queries a region holds in each level, the
// window each level's stage copies, and what the last warp out of a stage copies next. Integer
// arithmetic only, and host-callable, so that tests/backends/test_region_plan.py checks the code the
// kernel runs on the CPU (every query in one region, every point near its query inside its window,
// every stage's copy issued once into the buffer that stage reads).
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MMDEFORM_REGION_PLAN_FN __host__ __device__ __forceinline__
#else
#define MMDEFORM_REGION_PLAN_FN inline
#endif

namespace mmdeform_tma {
namespace tma_ws {
namespace region_plan {

constexpr int kRowBytes = 64;  // a head's 32 channels of 2 bytes
constexpr int kMaxLevels = 5;
constexpr int kRegionRows = 8, kRegionCols = 16;  // of the first level's pixels
constexpr int kMargin = 6;  // pixels each side: 0.02 % of DETR's points fall outside (item 142)
// Window widths (TMA boxes, 2 mod 4): the least of them that holds a level's window is used. The
// region's 16 columns and the margins need 30 in the first level, 22 in one of half its width, 18 below.
constexpr int kBoxes = 3;
MMDEFORM_REGION_PLAN_FN constexpr int box_width(int box) { return box == 0 ? 18 : box == 1 ? 22 : 30; }
// Buffer b holds the windows of levels b, b + 2, ...: 30 x 22 and 22 x 18 rows on DETR's levels. A
// window that does not fit is cut to its middle rows (the rest of its points through global memory).
MMDEFORM_REGION_PLAN_FN constexpr int buffer_bytes(int buffer) { return buffer == 0 ? 43008 : 25600; }  // 1024 x k

struct LevelShape {
  int height, width, start;
};

// The regions tile the first level (taken as 1 x 1 when it is empty, so that every query still has one).
struct RegionGrid {
  int height, width;  // the first level's
  int rows, cols;
};

struct Item {
  int batch, head, row, col;  // row, col: the region's
};

// A level's window: origin (level pixels), rows and which box.
struct Window {
  int x, y, rows, box;
};

// A level's queries in a region: pixel rows [row, row + count / cols) x columns [col, col + cols).
struct RegionQueries {
  int row, col, cols, count;
};

// floor(a / b) for b > 0 and |a| < 2^53: a 32-bit division where both fit (every level of up to 32k
// pixels a side), else one double division and a correction; a 64-bit integer division is a long
// subroutine on the device.
MMDEFORM_REGION_PLAN_FN int64_t floor_div(int64_t a, int64_t b) {
  if (a >= INT32_MIN && a <= INT32_MAX && b <= INT32_MAX) {
    const int a32 = static_cast<int>(a), b32 = static_cast<int>(b);
    const int q = a32 / b32;
    return q * b32 > a32 ? q - 1 : q;  // truncation rounds negative quotients up
  }
  int64_t q = static_cast<int64_t>(floor(static_cast<double>(a) / static_cast<double>(b)));
  if (q * b > a) {
    --q;
  } else if ((q + 1) * b <= a) {
    ++q;
  }
  return q;
}

MMDEFORM_REGION_PLAN_FN RegionGrid region_grid(const LevelShape* levels) {
  const bool empty = levels[0].height <= 0 || levels[0].width <= 0;
  const int h0 = empty ? 1 : levels[0].height, w0 = empty ? 1 : levels[0].width;
  return RegionGrid{h0, w0, (h0 + kRegionRows - 1) / kRegionRows, (w0 + kRegionCols - 1) / kRegionCols};
}

MMDEFORM_REGION_PLAN_FN Item item_at(int item, int heads, const RegionGrid& grid) {
  const int head = item % heads, rest = item / heads, regions = grid.rows * grid.cols;
  const int region = rest % regions;
  return Item{rest / regions, head, region / grid.cols, region % grid.cols};
}

// The first of a level's `extent` pixel rows (or columns) whose centre lies in region row r of
// `size`-pixel regions over the first level's `first` rows: (i + 0.5) / extent >= r size / first,
// that is 2 i + 1 >= 2 r size extent / first. The last region takes the rest.
MMDEFORM_REGION_PLAN_FN int region_begin(int r, int regions, int size, int extent, int first) {
  if (r >= regions) return extent;
  const int64_t twice = -floor_div(-2LL * r * size * extent, first);  // ceil(2 r size extent / first)
  return twice / 2 < extent ? static_cast<int>(twice / 2) : extent;
}

MMDEFORM_REGION_PLAN_FN RegionQueries region_queries(const Item& it, const RegionGrid& grid, const LevelShape& lv) {
  const int y = region_begin(it.row, grid.rows, kRegionRows, lv.height, grid.height);
  const int x = region_begin(it.col, grid.cols, kRegionCols, lv.width, grid.width);
  const int rows = region_begin(it.row + 1, grid.rows, kRegionRows, lv.height, grid.height) - y;
  const int cols = region_begin(it.col + 1, grid.cols, kRegionCols, lv.width, grid.width) - x;
  return RegionQueries{y, x, cols, rows * cols};
}

// The level's window for the region: its extent in the first level, [y0, y1) x [x0, x1), in this
// level's pixel coordinates (u * extent / first - 0.5), widened by kMargin, plus the bottom-right
// corner. Integer arithmetic: the lanes that fill the records and the lane that issues the copy
// get the same window.
MMDEFORM_REGION_PLAN_FN Window level_window(const Item& it, const RegionGrid& grid, const LevelShape& lv, int capacity) {
  const int64_t y0 = static_cast<int64_t>(it.row) * kRegionRows, x0 = static_cast<int64_t>(it.col) * kRegionCols;
  const int64_t y1 = y0 + kRegionRows < grid.height ? y0 + kRegionRows : grid.height;
  const int64_t x1 = x0 + kRegionCols < grid.width ? x0 + kRegionCols : grid.width;
  const int64_t h0 = grid.height, w0 = grid.width;
  int oy = static_cast<int>(floor_div(2 * y0 * lv.height - h0 - 2 * kMargin * h0, 2 * h0));
  int ox = static_cast<int>(floor_div(2 * x0 * lv.width - w0 - 2 * kMargin * w0, 2 * w0));
  int rows = static_cast<int>(floor_div(2 * y1 * lv.height - h0 + 2 * kMargin * h0, 2 * h0)) + 2 - oy;
  const int cols = static_cast<int>(floor_div(2 * x1 * lv.width - w0 + 2 * kMargin * w0, 2 * w0)) + 2 - ox;
  int box = 0;
  while (box + 1 < kBoxes && box_width(box) < cols) ++box;
  const int width = box_width(box);
  if (cols > width) ox += (cols - width) / 2;  // wider than the widest box: its middle
  const int fit = capacity / (width * kRowBytes);
  if (rows > fit) {
    oy += (rows - fit) / 2;
    rows = fit;
  }
  return Window{ox, oy, rows, box};
}

// A pass of an item is one stage a level, plus an empty stage after an odd level count, so that level
// l is always read from buffer l & 1 and its window is always sized for that buffer (the first level's
// 30 x 22 rows would not fit the odd buffer: cut to 13 rows, most of its points would be summed
// from global memory on every other item).
MMDEFORM_REGION_PLAN_FN int stages_a_pass(int levels) { return levels + (levels & 1); }

// What the last warp out of a pass's stage `s` copies into that stage's buffer: stage s + 2, which is
// a level of the same pass, the empty stage (an arrival only), or a level of the next pass or item.
struct NextCopy {
  enum Kind { kLevel, kEmpty, kNextPass, kNextItem, kNone } kind;
  int level;
};

MMDEFORM_REGION_PLAN_FN NextCopy next_copy(int s, int levels, int pass, int passes, bool next_item_exists) {
  const int target = s + 2, per_pass = stages_a_pass(levels);
  if (target < per_pass) return NextCopy{target < levels ? NextCopy::kLevel : NextCopy::kEmpty, target};
  const int level = target - per_pass;  // 0 or 1
  if (pass + 1 < passes) return NextCopy{NextCopy::kNextPass, level};
  return NextCopy{next_item_exists ? NextCopy::kNextItem : NextCopy::kNone, level};
}

}  // namespace region_plan
}  // namespace tma_ws
}  // namespace mmdeform_tma
