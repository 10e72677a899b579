"""tools/window_tma_forward_probe.py: region tiles hold every query once and windows hold every point within
the margin; the swizzled corner addresses and the record slots make every shared-memory phase conflict-free."""

import math
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import window_tma_forward_probe as probe  # noqa: E402

LEVELS = [(13, 19), (7, 10), (4, 5), (2, 3)]
DETR_LEVELS = [(100, 152), (50, 76), (25, 38), (13, 19)]


def corner_word(row: int) -> int:
    """The kernel's record word of a window row at shared address `row` (a multiple of 64)."""
    return row ^ ((row >> 3) & 0x30)


def lane_chunk(lane: int) -> int:
    return 2 * ((lane >> 2) & 1) + ((lane >> 3) & 1)


@pytest.mark.parametrize("width", range(1, 40))
def test_window_widths_are_rounded_up_to_2_mod_4(width):
    w = probe.round_to_conflict_free(width)
    assert w % 4 == 2 and width <= w < width + 4


@pytest.mark.parametrize("width", [6, 10, 14, 18, 22, 26, 30, 34])
@pytest.mark.parametrize("buffer", [0, 38912])
def test_swizzled_corner_addresses_read_their_chunks_in_conflict_free_phases(width, buffer):
    rng = random.Random(width * 7 + buffer)
    pitch = width * probe.ROW_BYTES
    for _ in range(300):
        points = [(rng.randrange(width - 1), rng.randrange(30)) for _ in range(2)]  # window (x, y) of top-left
        addresses = []
        for lane in range(32):
            x, y = points[lane >> 4]
            dy, dx = (lane >> 1) & 1, lane & 1
            row = buffer + (y + dy) * pitch + (x + dx) * probe.ROW_BYTES
            address = corner_word(row) ^ (lane_chunk(lane) << 4)
            # SWIZZLE_64B on the shared address: chunk c of a row lives at c ^ (address bits 7-8)
            assert address == row + ((lane_chunk(lane) ^ ((row >> 7) & 3)) << 4)
            addresses.append(address)
        for phase in range(4):
            assert len({(addresses[8 * phase + r] // 16) % 8 for r in range(8)}) == 8


def test_an_even_width_of_0_mod_4_would_conflict():
    pitch = 32 * probe.ROW_BYTES  # rows of a point's top and bottom corners in the same bank groups
    rows = [y * pitch + x * probe.ROW_BYTES for y in (0, 1) for x in (0, 1)]
    groups = [((corner_word(r) ^ (c << 4)) // 16) % 8 for r in rows for c in (0, 2)]
    assert len(set(groups)) < 8


def test_record_slots_are_conflict_free_to_write_and_to_read():
    unit = lambda lane, slot: lane + probe.SLOT_STRIDE * slot  # noqa: E731
    for slot in range(4):  # a 16-byte store: four phases of 8 lanes
        for phase in range(4):
            assert len({unit(lane, slot) % 8 for lane in range(8 * phase, 8 * phase + 8)}) == 8
    for pair in range(16):  # a pair's read: the lanes' (point of pair, slot) units
        units = {unit(2 * pair + (lane >> 4), 2 * ((lane & 3) & 1) + ((lane >> 2) & 1)) for lane in range(32)}
        units |= {unit(2 * pair + (lane >> 4), lane & 3) for lane in range(32)}
        assert len({u % 8 for u in {unit(2 * pair + pn, s) for pn in (0, 1) for s in range(4)}}) == 8
        assert all(0 <= u < (31 + 3 * probe.SLOT_STRIDE + 1) for u in units)
    every = {unit(lane, slot) for lane in range(32) for slot in range(4)}
    assert len(every) == 128  # no two slots share a unit


def test_region_tiles_hold_every_query_once():
    plan = probe.region_tiles(LEVELS, (4, 8), 2, 3)
    ids = plan["tiles"][plan["tiles"] >= 0]
    assert sorted(ids.tolist()) == list(range(sum(h * w for h, w in LEVELS)))
    assert plan["tiles"].shape[1] == 64 and plan["windows"].shape == (plan["tiles"].shape[0], len(LEVELS), 3)


@pytest.mark.parametrize("margin", [2, 4])
def test_every_point_within_the_margin_of_its_reference_is_inside_its_window(margin):
    plan = probe.region_tiles(LEVELS, (4, 8), 2, margin)
    refs = probe.reference_points(LEVELS)
    for cta, tile in enumerate(plan["tiles"].tolist()):
        for q in (q for q in tile if q >= 0):
            for level, (h, w) in enumerate(LEVELS):
                ox, oy, rows = plan["windows"][cta, level].tolist()
                for dx in (-margin, 0, margin):
                    for dy in (-margin, 0, margin):
                        x = float(refs[q, 0]) * w - 0.5 + dx
                        y = float(refs[q, 1]) * h - 0.5 + dy
                        xr, yr = math.floor(x) - ox, math.floor(y) - oy
                        assert 0 <= xr and xr + 1 < plan["box_widths"][level]
                        assert 0 <= yr and yr + 1 < rows


def test_outside_share_counts_points_beyond_the_margin():
    plan = probe.region_tiles(LEVELS, (4, 8), 2, 2)
    refs = probe.reference_points(LEVELS).float()
    q = refs.shape[0]
    loc = refs.view(1, q, 1, 1, 1, 2).expand(1, q, 1, len(LEVELS), 2, 2).clone()
    assert probe.outside_share(LEVELS, plan, loc) == 0.0
    wh = torch.tensor([[w, h] for h, w in LEVELS], dtype=torch.float32).view(1, 1, 1, len(LEVELS), 1, 2)
    within = loc.clone()
    within[..., 1, :] += 2.0 / wh[..., 0, :]  # point 1 two pixels (the margin) right and down
    assert probe.outside_share(LEVELS, plan, within) == 0.0
    loc[..., 1, :] += 5.0 / wh[..., 0, :]  # five pixels: outside some windows (widths are rounded up)
    assert 0.0 < probe.outside_share(LEVELS, plan, loc) <= 0.5


def test_detr_launch_geometry_fits_two_ctas_a_sm():
    plan = probe.region_tiles(DETR_LEVELS, (8, 16), 6, 6)
    geometry, buffers, shared = probe.launch_geometry(DETR_LEVELS, plan, 6)
    assert all(bw % 4 == 2 for bw in plan["box_widths"])
    assert buffers[0] % 1024 == 0 and 2 * (shared + 1024) <= 228 * 1024
    assert geometry[2::5] == [0, 15200, 19000, 19950]  # first keys
    assert plan["tiles"].shape == (130, 192)


def test_the_two_swizzle_models_disagree_at_a_128_byte_offset():
    models = probe.swizzle_models(30, 128)
    assert models["address"] != models["box"]
    assert probe.swizzle_models(30, 0)["address"] == probe.swizzle_models(30, 0)["box"]


def shuffle_address(word: int, corner: int, pitch: int, zero: int) -> int:
    """The shuffle version's address of `corner` from its point's top-left word (row | corners in the level)."""
    row = (word & ~63) + (corner >> 1) * pitch + (corner & 1) * probe.ROW_BYTES
    return corner_word(row) if (word >> corner) & 1 else zero


@pytest.mark.parametrize("width", [18, 30])
def test_the_shuffle_version_forms_the_records_corner_addresses(width):
    rng = random.Random(width)
    pitch, zero = width * probe.ROW_BYTES, 128
    for _ in range(500):
        top_left = 1024 + rng.randrange(20) * pitch + rng.randrange(width - 1) * probe.ROW_BYTES
        inside = rng.randrange(16)  # which corners lie in the level
        for corner in range(4):
            row = top_left + (corner >> 1) * pitch + (corner & 1) * probe.ROW_BYTES
            want = corner_word(row) if (inside >> corner) & 1 else zero
            assert shuffle_address(top_left | inside, corner, pitch, zero) == want
    assert all(shuffle_address(0, corner, pitch, zero) == zero for corner in range(4))  # a point not summed
