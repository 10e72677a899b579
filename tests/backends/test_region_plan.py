"""The region forward's plan (`tma_ws` config `rg_*`), checked on the CPU: hopper/region_plan.h, the
header region_forward.cu runs on the device, compiled here with the host compiler and called through
ctypes. Every query lies in exactly one region, every point within the margin of its query's
reference point lies inside its level's window, windows fit their buffers, and each stage's copy is
issued once, by the stage two before it, into the buffer that stage reads."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOPPER = ROOT / "mmdeform_tma" / "csrc" / "hopper"
SHIM = Path(__file__).with_name("region_plan_shim.cpp")

ROW_BYTES, MAX_LEVELS, REGION_ROWS, REGION_COLS, MARGIN, BOXES = range(6)
LEVEL, EMPTY, NEXT_PASS, NEXT_ITEM, NONE = range(5)  # NextCopy::Kind

DETR = [(100, 152), (50, 76), (25, 38), (13, 19)]
DINO_FIVE = [(100, 152), (50, 76), (25, 38), (13, 19), (7, 10)]
THREE = [(64, 80), (32, 40), (16, 20)]
SHAPE_SETS = {
    "detr": DETR,
    "dino_five_levels": DINO_FIVE,
    "three_levels": THREE,
    "two_levels_finer_second": [(9, 20), (18, 40)],
    "first_smaller_than_a_region": [(5, 7), (3, 4), (2, 2)],
    "odd_ratios": [(37, 53), (19, 27), (10, 14), (5, 7), (3, 4)],
    "one_row": [(1, 40), (1, 20)],
    "one_column": [(30, 1), (15, 1), (8, 1)],
}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler to build hopper/region_plan.h for the host")
    library = tmp_path_factory.mktemp("region_plan") / "region_plan.so"
    subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", f"-I{HOPPER}", str(SHIM),
                    "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.plan_floor_div.restype = ctypes.c_longlong
    lib.plan_floor_div.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
    return lib


def c_shapes(shapes):
    return (ctypes.c_int * (2 * len(shapes)))(*[v for hw in shapes for v in hw])


def call4(fn, *args):
    out = (ctypes.c_int * 4)()
    fn(*args, out)
    return tuple(out)


def constant(plan, which):
    return plan.plan_constant(which)


def grid(plan, shapes):
    return call4(plan.plan_region_grid, c_shapes(shapes), len(shapes))


def regions(plan, shapes, heads=1):
    _, _, rows, cols = grid(plan, shapes)
    return range(rows * cols * heads)


def window(plan, shapes, item, level, capacity=None):
    if capacity is None:
        capacity = plan.plan_buffer_bytes(level & 1)
    return call4(plan.plan_level_window, c_shapes(shapes), len(shapes), item, 1, level, capacity)


def region_pixels(plan, shapes, item, level):
    row, col, cols, count = call4(plan.plan_region_queries, c_shapes(shapes), len(shapes), item, 1, level)
    if count == 0:
        return []
    return [(row + k // cols, col + k % cols) for k in range(count)]


def test_floor_div_is_floor_division_on_32_and_64_bit_operands(plan):
    rng = random.Random(0)
    cases = [(a, b) for a in (-7, -6, -1, 0, 1, 5, 6, 2**31 - 1, -(2**31)) for b in (1, 2, 3, 6, 2**31 - 1)]
    cases += [(rng.randrange(-(2**40), 2**40), rng.randrange(1, 2**20)) for _ in range(2000)]
    cases += [(rng.randrange(-(2**52), 2**52), rng.randrange(1, 2**33)) for _ in range(2000)]
    cases += [(rng.randrange(-(2**31), 2**31), rng.randrange(1, 2**31)) for _ in range(2000)]
    for a, b in cases:
        assert plan.plan_floor_div(a, b) == a // b, (a, b)


@pytest.mark.parametrize("name", sorted(SHAPE_SETS))
def test_every_query_lies_in_exactly_one_region_the_one_holding_its_pixel_centre(plan, name):
    shapes = SHAPE_SETS[name]
    h0, w0, rows, cols = grid(plan, shapes)
    assert (rows, cols) == (-(-h0 // constant(plan, REGION_ROWS)), -(-w0 // constant(plan, REGION_COLS)))
    for level, (height, width) in enumerate(shapes):
        seen = {}
        for item in regions(plan, shapes):
            r, c = item // cols, item % cols
            for pixel in region_pixels(plan, shapes, item, level):
                assert pixel not in seen, (level, pixel, seen.get(pixel), item)
                seen[pixel] = item
                i, j = pixel
                # the pixel centre, in the first level's pixels, lies in the region (the last takes the rest)
                y, x = Fraction(2 * i + 1, 2 * height) * h0, Fraction(2 * j + 1, 2 * width) * w0
                assert r * constant(plan, REGION_ROWS) <= y and (r + 1 == rows or y < (r + 1) * constant(plan, REGION_ROWS))
                assert c * constant(plan, REGION_COLS) <= x and (c + 1 == cols or x < (c + 1) * constant(plan, REGION_COLS))
        assert len(seen) == height * width


def test_regions_partition_random_level_shapes(plan):
    rng = random.Random(1)
    for _ in range(60):
        shapes = [(rng.randrange(1, 90), rng.randrange(1, 90)) for _ in range(rng.randrange(2, 6))]
        for level, (height, width) in enumerate(shapes):
            pixels = [p for item in regions(plan, shapes) for p in region_pixels(plan, shapes, item, level)]
            assert sorted(pixels) == [(i, j) for i in range(height) for j in range(width)], shapes


def window_is_cut(plan, shapes, item, level):
    """Whether the window is narrower or shorter than the region's extent with its margins."""
    uncut = window(plan, shapes, item, level, capacity=1 << 30)
    return window(plan, shapes, item, level) != uncut or plan.plan_box_width(uncut[3]) < needed_columns(plan, shapes, item, level)


def needed_columns(plan, shapes, item, level):
    h0, w0, _, cols = grid(plan, shapes)
    x0 = (item % cols) * constant(plan, REGION_COLS)
    x1 = min(x0 + constant(plan, REGION_COLS), w0)
    width, margin = shapes[level][1], constant(plan, MARGIN)
    first = Fraction(x0 * width, w0) - Fraction(1, 2) - margin
    last = Fraction(x1 * width, w0) - Fraction(1, 2) + margin
    return int(last // 1) + 2 - int(first // 1)


@pytest.mark.parametrize("name", sorted(SHAPE_SETS))
def test_points_within_the_margin_of_their_reference_fall_inside_uncut_windows(plan, name):
    shapes = SHAPE_SETS[name]
    h0, w0, _, cols = grid(plan, shapes)
    margin = constant(plan, MARGIN)
    offsets = [Fraction(-margin), Fraction(-margin, 3), Fraction(0), Fraction(margin, 2), Fraction(margin)]
    for item in regions(plan, shapes):
        for level, (height, width) in enumerate(shapes):
            if window_is_cut(plan, shapes, item, level):
                continue
            x0, y0, rows, box = window(plan, shapes, item, level)
            for query_level, (qh, qw) in enumerate(shapes):
                for i, j in region_pixels(plan, shapes, item, query_level):
                    # the query's reference point in this level's pixel coordinates (align_corners=False)
                    cy = Fraction(2 * i + 1, 2 * qh) * height - Fraction(1, 2)
                    cx = Fraction(2 * j + 1, 2 * qw) * width - Fraction(1, 2)
                    for dy in offsets:
                        for dx in offsets:
                            top, left = int((cy + dy) // 1) - y0, int((cx + dx) // 1) - x0
                            assert 0 <= top < rows - 1 and 0 <= left < plan.plan_box_width(box) - 1, (
                                item, level, query_level, (i, j), (dy, dx))


@pytest.mark.parametrize("name", sorted(SHAPE_SETS))
def test_windows_fit_the_buffer_of_their_level(plan, name):
    shapes = SHAPE_SETS[name]
    for item in regions(plan, shapes):
        for level in range(len(shapes)):
            _, _, rows, box = window(plan, shapes, item, level)
            assert 0 < rows and rows * plan.plan_box_width(box) * constant(plan, ROW_BYTES) <= plan.plan_buffer_bytes(level & 1)


@pytest.mark.parametrize("name", ["detr", "dino_five_levels", "three_levels"])
def test_no_window_is_cut_on_encoder_pyramids_of_halving_levels(plan, name):
    """Each level of a halving pyramid fits its buffer whole: the first level's 30 x 22 rows the even
    buffer, the second's 22 x 18 the odd one, at any level count (an odd one pads its passes)."""
    shapes = SHAPE_SETS[name]
    cut = [(item, level) for item in regions(plan, shapes) for level in range(len(shapes))
           if window_is_cut(plan, shapes, item, level)]
    assert cut == []


def test_the_first_level_would_be_cut_in_the_odd_buffer(plan):
    """Why a pass of an odd level count has an empty stage: without it, the first level's stage would
    land in the odd buffer on every other item."""
    item = 20  # an inner region of DETR's first level
    uncut = window(plan, DETR, item, 0, capacity=1 << 30)
    odd = window(plan, DETR, item, 0, capacity=plan.plan_buffer_bytes(1))
    assert odd[2] < uncut[2] - 2 * constant(plan, MARGIN) + 4


@pytest.mark.parametrize("levels", [2, 3, 4, 5])
def test_every_stage_is_copied_once_into_the_buffer_its_level_reads(plan, levels):
    """A CTA's stages over items of 1-3 passes: the prologue copies the first item's first two; after
    that the last warp out of stage n issues stage n + 2 (next_copy), which must be the stage that
    follows, into the same buffer, and level l's stage is always in buffer l & 1."""
    rng = random.Random(levels)
    items = [rng.randrange(1, 4) for _ in range(7)]
    per_pass = plan.plan_stages_a_pass(levels)
    assert per_pass % 2 == 0 and levels <= per_pass <= levels + 1
    stages = [(item, p, s) for item, passes in enumerate(items) for p in range(passes) for s in range(per_pass)]
    issued = {0: ("level", 0, 0, 0), 1: ("level", 0, 0, 1)}  # the prologue
    level = ctypes.c_int()
    for n, (item, p, s) in enumerate(stages):
        expected = ("level", item, p, s) if s < levels else ("empty", item, p, s)
        assert issued.pop(n) == expected, (n, item, p, s)
        if s < levels:
            assert n % 2 == s % 2  # buffer n & 1 holds level s
        kind = plan.plan_next_copy(s, levels, p, items[item], int(item + 1 < len(items)), ctypes.byref(level))
        if kind == LEVEL:
            issued[n + 2] = ("level", item, p, level.value)
        elif kind == EMPTY:
            issued[n + 2] = ("empty", item, p, level.value)
        elif kind == NEXT_PASS:
            issued[n + 2] = ("level", item, p + 1, level.value)
        elif kind == NEXT_ITEM:
            issued[n + 2] = ("level", item + 1, 0, level.value)
        else:
            assert kind == NONE and n >= len(stages) - 2
    assert issued == {}
