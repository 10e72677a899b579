"""CPU tests of the Hopper backends' own shape limits (the reasons 'auto' logs and a forced call raises)."""

import torch

from mmdeform_tma.backends import BACKENDS
from mmdeform_tma.backends.tma_ws import MAX_POINTS_PER_LEVEL
from mmdeform_tma.inputs import validate
from msda_cases import make_problem


def inputs_with(points: int, channels: int = 32, dtype=torch.float16):
    problem = make_problem([(4, 5), (2, 3)], batch=1, queries=3, heads=2, channels=channels, points=points,
                           dtype=dtype, generator=torch.Generator().manual_seed(0))
    return validate(*problem.args())


def test_tma_ws_holds_at_most_its_points_per_level_in_shared_memory():
    assert not BACKENDS["tma_ws"].shape_reasons(inputs_with(MAX_POINTS_PER_LEVEL))
    (reason,) = BACKENDS["tma_ws"].shape_reasons(inputs_with(MAX_POINTS_PER_LEVEL + 1))
    assert f"{MAX_POINTS_PER_LEVEL + 1} points per level exceed" in reason


def test_hopper_backend_names_the_row_size_it_cannot_lay_out():
    (reason,) = BACKENDS["tma_ws"].shape_reasons(inputs_with(2, channels=6))
    assert "6 x 2 B = 12 B" in reason
