"""tools/gather_emulation.py: the NumPy model of the tma_ws gather backward (the `_g` configs)
agrees with float64 and needs fewer L2 reductions than the plain kernel."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gather_emulation  # noqa: E402


@pytest.mark.parametrize(
    "levels, heads, points, slots, row_bytes, seed",
    [
        ([(9, 13), (5, 7), (3, 4)], 2, 4, 32, 64, 1),  # fp16 rows: a 16 x 16 window
        ([(17, 9), (8, 5), (1, 1)], 2, 2, 32, 128, 3),  # fp32 rows, a 1 x 1 level
    ],
)
def test_gathered_value_gradient_matches_float64(levels, heads, points, slots, row_bytes, seed):
    gather_emulation.check(levels, heads, channels=4, points=points, slots=slots, row_bytes=row_bytes, seed=seed)


def test_gathering_reduces_fewer_times_than_the_plain_kernel():
    rng = np.random.default_rng(0)
    levels = [(30, 44), (15, 22)]
    loc, attn = gather_emulation.local_inputs(levels, 1, 4, rng)
    grad_out = rng.standard_normal((loc.shape[0], 1, 2)).astype(np.float32)
    _, plain, gathered, _ = gather_emulation.emulate(levels, 1, 2, 4, 32, 64, loc, attn, grad_out)
    assert 0 < gathered < plain / 2


@pytest.mark.parametrize(
    "levels, heads, points, seed",
    [
        ([(9, 13), (5, 7), (3, 4)], 2, 4, 1),
        ([(17, 9), (8, 5), (1, 1)], 2, 2, 3),  # a 1 x 1 level: every point has corners outside it
    ],
)
def test_mma_window_with_points_across_level_edges_matches_float64(levels, heads, points, seed):
    """The MMA window's rule since session 48: a point joins when its corners inside the level lie
    in the window, and only those get an entry (a wrong cell or an entry for a corner outside the
    level shows in grad_value, or trips the emulation's range check)."""
    gather_emulation.check(levels, heads, channels=4, points=points, slots=32, row_bytes=64, seed=seed, mma="partial")


def test_mma_window_takes_points_across_level_edges_off_the_direct_path():
    rng = np.random.default_rng(0)
    levels = [(20, 30), (10, 15), (5, 8), (3, 4)]
    loc, attn = gather_emulation.local_inputs(levels, 1, 4, rng)
    grad_out = np.ones((loc.shape[0], 1, 1), np.float32)
    counts = {}
    for rule in ("full", "partial"):
        _, plain, reductions, _ = gather_emulation.emulate(levels, 1, 1, 4, 32, 64, loc, attn, grad_out,
                                                           exact_order=False, mma=rule)
        counts[rule] = reductions
    assert 0 < counts["partial"] < counts["full"] < plain
