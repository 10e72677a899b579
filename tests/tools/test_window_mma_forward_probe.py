"""tools/window_mma_forward_probe.py: the tiles cover every query once, and the kernel's lane layout
sums the right rows with the right weights through conflict-free ldmatrix phases."""

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import window_mma_forward_probe as probe  # noqa: E402

LEVELS = [(13, 19), (7, 10), (4, 5), (2, 3)]


def test_tiles_hold_every_query_once_in_blocks_of_their_level():
    tiles = probe.encoder_tiles(LEVELS, probe.parse_shapes(["8x8", "4x8", "2x4", "1x2"]))
    ids = tiles[tiles >= 0]
    assert sorted(ids.tolist()) == list(range(sum(h * w for h, w in LEVELS)))
    assert tiles.shape[1] == probe.TILE_QUERIES
    first = tiles[0][tiles[0] >= 0].tolist()  # level 0's first block: rows 0-7, columns 0-7
    assert first == [y * 19 + x for y in range(8) for x in range(8)]


def test_a_tile_larger_than_the_kernel_takes_is_refused():
    with pytest.raises(ValueError, match="more than 64"):
        probe.encoder_tiles(LEVELS, [(8, 9)])


def test_one_step_sums_each_query_s_four_corners_with_hi_plus_lo_weights():
    rng = random.Random(0)
    rows = [[[rng.gauss(0, 1) for _ in range(32)] for _ in range(4)] for _ in range(2)]
    hi = [[rng.gauss(0, 1) for _ in range(4)] for _ in range(2)]
    lo = [[rng.gauss(0, 1e-3) for _ in range(4)] for _ in range(2)]
    out = probe.emulate_step(rows, hi, lo)
    for q in range(2):
        for c in range(32):
            want = sum((hi[q][k] + lo[q][k]) * rows[q][k][c] for k in range(4))
            assert out[q][c] == pytest.approx(want, abs=1e-12)


def test_a_point_s_weights_in_the_wrong_slot_change_the_result():
    rows = [[[float(k * 32 + c) for c in range(32)] for k in range(4)] for _ in range(2)]
    hi = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    out = probe.emulate_step(rows, hi, [[0.0] * 4] * 2)
    assert out[0] == rows[0][0] and out[1] == rows[1][3]


@pytest.mark.parametrize("width", range(2, 49))
def test_every_ldmatrix_phase_reads_eight_distinct_bank_groups(width):
    rng = random.Random(width)
    for _ in range(200):
        points = [(rng.randrange(width - 1), rng.randrange(-3, 40)) for _ in range(2)]  # (x, level row y)
        offsets = []
        for lane in range(32):
            x, y = points[lane >> 4]
            offsets.append(probe.ldmatrix_row(lane, (y + 3) * width + x, y, width)[2])
        for phase in range(4):
            groups = {(offsets[8 * phase + r] // 16) % 8 for r in range(8)}
            assert len(groups) == 8
