// The deterministic backward for sparse sampling (decoders), shared by the compiled backends.
// Sparse half-precision problems take it for the fast backward too (the rule above
// kSortedFastCells in grad_accumulation.cuh): its result is deterministic all the same.
//
// The fixed-point sink (grad_accumulation.cuh) makes every addition an int64 atomic and ends in a
// pass over the whole accumulator: on the fp16 DETR decoder it ran at 3.8x the fast backward, on
// DINO's at 3.9x (H100, 2026-11-26; perf_notes item 70). Where a (batch, head) has few corners per
// key, sorting them is cheaper (1.15-1.4x the fast backward in fp16/bf16, 1.5-1.8x in fp32, on
// those decoders; H100, 2026-11-26, 1e6b27a, perf_notes item 71):
//   1. a team of lanes per sampling point writes its location and attention gradients (as every
//      backward kernel does) and, for each of its four corners, an entry: the corner's pixel and
//      its weight attention x bilinear. The entries are laid out a (batch, head) at a time, then in
//      the points' order. Where step 2 sorts in blocks, and past them where a (batch, head) has
//      under two corners per key and an fp32 grad_value fits the L2, it also zeroes grad_value first;
//   2. a stable radix sort of the entries by pixel: a (batch, pixel, head) cell's entries end up
//      contiguous and in (query, level, point, corner) order, which depends only on the problem's
//      shape; a pixel needs fewer key bits than a cell, hence fewer passes. Where a (batch, head,
//      level)'s entries fit one block, a block sorts each of them in shared memory (one launch);
//      otherwise cub's device sort orders all entries at once;
//   3. a warp per 32 sorted entries stages their output-gradient rows in shared memory, and its teams
//      of lanes sum the chunk's pieces of cells side by side, each weight x row in sorted order, in
//      fp32 (fp64 for fp64 values); a cell that crosses chunks is finished by adding its pieces in
//      chunk order. Rows are written in value's dtype. Where step 1 did not zero grad_value, the
//      untouched cells' rows (the ranks between consecutive sorted ranks) are zeroed here.
// No atomics, so the result is bitwise reproducible, and its rounding is that of the fast path's
// fp32 sums rather than fixed point's quantum. Non-finite contributions propagate as IEEE addition
// does (0 x Inf is NaN, as in the atomic sums).
#pragma once

#include <string>

#include "problem.h"

namespace mmdeform_tma {

// Why the sorted backward cannot run this problem, or empty.
std::string sorted_backward_unsupported(const ProblemTensors& problem, const at::Tensor& grad_output);

// Whether step 2 sorts each (batch, head, level)'s entries in one block (where those entries fit
// it) rather than with cub's device sort over all entries.
bool sorts_level_runs(const ProblemTensors& problem);

// The three gradients, bitwise reproducible. Requires sorted_backward_unsupported to be empty.
Gradients sorted_deterministic_backward(const ProblemTensors& problem, const at::Tensor& grad_output);

}  // namespace mmdeform_tma
