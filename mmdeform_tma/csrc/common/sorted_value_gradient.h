// The deterministic backward for sparse sampling (decoders), shared by the compiled backends.
// The fast backward takes it too where it is faster (the rules above kSortedFastCells in
// grad_accumulation.cuh): its result is deterministic all the same.
//
// The fixed-point sink (grad_accumulation.cuh) makes every addition an int64 atomic and ends in a
// pass over the whole accumulator: on the fp16 DETR decoder it ran at 3.8x the fast backward, on
// DINO's at 3.9x (H100, 2026-11-26; perf_notes item 70). Where a (batch, head) has few corners per
// key, sorting them is cheaper:
//   1. a team of lanes per sampling point writes its location and attention gradients (as every
//      backward kernel does) and, for each of its four corners, an entry: the corner's pixel and
//      its weight attention x bilinear. The entries are laid out a (batch, head) at a time, then in
//      the points' order. Where step 2 sorts in blocks, and past them where a (batch, head) has
//      under two corners per key and an fp32 grad_value fits the L2, it also zeroes grad_value first;
//   2. a stable sort of the entries by pixel: a (batch, pixel, head) cell's entries end up
//      contiguous and in (query, level, point, corner) order, which depends only on the problem's
//      shape. Where a (batch, head, level)'s entries (a level run) fit one block and lanes take 8
//      elements, a block sorts each run in shared memory and goes on to step 3 there: a cell lies in
//      one level run, so teams of lanes sum equal ranges of the sorted run, weight x row in sorted
//      order, and a cell that crosses ranges is finished in range order. Runs fewer than the SMs
//      are shared by up to four blocks, each sorting all of the run and summing one part, split at
//      cell boundaries. Otherwise cub's radix sort orders all entries by pixel at once, and
//   3. a warp per 32 sorted entries stages their output-gradient rows in shared memory, and its teams
//      of lanes sum the chunk's pieces of cells side by side, each weight x row in sorted order; a
//      cell that crosses chunks is finished by adding its pieces in chunk order. Where step 1 did
//      not zero grad_value, the untouched cells' rows (the ranks between consecutive sorted ranks)
//      are zeroed here.
// Sums are fp32 (fp64 for fp64 values) and rows are written in value's dtype. No atomics, so the
// result is bitwise reproducible, and its rounding is that of the fast path's fp32 sums rather than
// fixed point's quantum. Non-finite contributions propagate as IEEE addition does (0 x Inf is NaN,
// as in the atomic sums).
#pragma once

#include <string>

#include "problem.h"

namespace mmdeform_tma {

// Why the sorted backward cannot run this problem, or empty.
std::string sorted_backward_unsupported(const ProblemTensors& problem, const at::Tensor& grad_output);

// Whether blocks sort and sum each (batch, head, level)'s entries (where those entries fit a block
// and lanes take 8 elements) rather than cub's device sort and the chunk sums.
bool sorts_level_runs(const ProblemTensors& problem, const at::Tensor& grad_output);

// The three gradients, bitwise reproducible. Requires sorted_backward_unsupported to be empty.
Gradients sorted_deterministic_backward(const ProblemTensors& problem, const at::Tensor& grad_output);

}  // namespace mmdeform_tma
