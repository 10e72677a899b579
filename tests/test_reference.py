"""mmdeform_tma.reference (grid_sample) against the independent loop and gather references."""

import pytest
import torch

from mmdeform_tma.reference import ms_deform_attn_reference, ms_deform_attn_reference_backward
from msda_cases import gather_reference, loop_reference, make_problem, rel_l2

SHAPE_SETS = [
    [(3, 4)],
    [(4, 5), (2, 3)],
    [(5, 3), (3, 2), (1, 1)],
    [(6, 7), (3, 4), (2, 2), (1, 2)],
    [(4, 6), (2, 3), (1, 2), (1, 1), (2, 1)],
]


@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=lambda s: f"L{len(s)}")
@pytest.mark.parametrize("points", [1, 3, 8])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_matches_loop_reference(shapes, points, channels, generator):
    problem = make_problem(shapes, batch=2, queries=3, heads=2, channels=channels, points=points, generator=generator)
    expected = loop_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    actual = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert actual.dtype == torch.float64 and actual.shape == expected.shape
    assert rel_l2(actual, expected) < 1e-12


def test_gather_reference_matches_loop_reference(generator):
    problem = make_problem([(5, 4), (3, 2), (1, 1)], batch=2, queries=4, heads=3, channels=5, points=4, generator=generator)
    expected = loop_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert rel_l2(gather_reference(*problem.args()), expected) < 1e-12


def test_encoder_problems_sample_around_each_querys_own_pixel(generator):
    shapes = [(4, 6), (2, 3)]
    problem = make_problem(shapes, batch=1, queries=30, heads=2, channels=3, points=2, generator=generator,
                           locality="encoder", outside_fraction=0.0)
    expected = loop_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert rel_l2(gather_reference(*problem.args()), expected) < 1e-12
    # query 7 is pixel (1, 1) of the 4 x 6 level: its points lie within a few pixels of that centre
    centre = torch.tensor([1.5 / 6, 1.5 / 4], dtype=torch.float64)
    offsets_px = (problem.sampling_locations[0, 7, :, 0] - centre) * torch.tensor([6.0, 4.0], dtype=torch.float64)
    assert offsets_px.abs().max() < 12  # N(0, 2 px): six standard deviations
    with pytest.raises(ValueError, match="one query per key"):
        make_problem(shapes, queries=29, locality="encoder", generator=generator)


def test_points_outside_every_level_give_zero():
    problem = make_problem([(3, 3), (2, 2)], outside_fraction=0.0)
    far = torch.full_like(problem.sampling_locations, 7.5)
    out = ms_deform_attn_reference(problem.value, problem.spatial_shapes, far, problem.attention_weights)
    assert torch.count_nonzero(out) == 0


def test_point_exactly_at_pixel_minus_one_is_outside():
    """x = -1 px reaches column 0 with bilinear weight 0; mmcv and the kernels skip such a point,
    so a NaN there stays out of the output and the location gradient is zero."""
    value = torch.randn(1, 4, 1, 2, dtype=torch.float64)
    value[0, 0] = float("nan")  # column 0 of row 0 in a 2 x 2 level
    shapes, starts = torch.tensor([[2, 2]]), torch.tensor([0])
    loc = torch.tensor([-0.5 / 2, 0.25], dtype=torch.float64).view(1, 1, 1, 1, 1, 2)  # pixel (x, y) = (-1, 0)
    attn = torch.ones(1, 1, 1, 1, 1, dtype=torch.float64)
    out = ms_deform_attn_reference(value, shapes, loc, attn)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(out, gather_reference(value, shapes, starts, loc, attn).to(out.dtype))
    _, grad_loc, _ = ms_deform_attn_reference_backward(torch.ones_like(out), value, shapes, loc, attn)
    assert torch.equal(grad_loc, torch.zeros_like(grad_loc))


@pytest.mark.parametrize("wrt", ["value", "sampling_locations", "attention_weights"])
def test_gradcheck_float64(wrt, generator):
    problem = make_problem([(4, 3), (2, 2)], batch=1, queries=2, heads=2, channels=3, points=2, generator=generator)
    # keep points off exact pixel boundaries, where the bilinear weights have kinks
    problem.sampling_locations = problem.sampling_locations.clamp(-0.2, 1.2) + 1e-3
    inputs = {
        "value": problem.value,
        "sampling_locations": problem.sampling_locations,
        "attention_weights": problem.attention_weights,
    }
    inputs[wrt] = inputs[wrt].clone().requires_grad_()

    def fn(t):
        args = dict(inputs, **{wrt: t})
        return ms_deform_attn_reference(args["value"], problem.spatial_shapes, args["sampling_locations"], args["attention_weights"])

    assert torch.autograd.gradcheck(fn, (inputs[wrt],), eps=1e-6, atol=1e-7)


def test_half_value_with_float_locations_computes_in_float32(generator):
    problem = make_problem([(4, 4), (2, 2)], generator=generator)
    value16 = problem.value.half()
    out = ms_deform_attn_reference(value16, problem.spatial_shapes, problem.sampling_locations.float(), problem.attention_weights.float())
    exact = loop_reference(value16.double(), problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert out.dtype == torch.float16
    assert rel_l2(out, exact) <= 1.5 * rel_l2(exact.half(), exact) + 1e-7


@pytest.mark.parametrize("dim", ["batch", "queries", "levels", "points", "heads", "channels"])
def test_empty_dimensions(dim):
    sizes = dict(batch=2, queries=3, heads=2, channels=4, points=2)
    shapes = [(3, 3), (2, 2)]
    if dim == "levels":
        shapes = []
    else:
        sizes[dim] = 0
    problem = make_problem(shapes, **sizes) if shapes else None
    if problem is None:
        value = torch.zeros(2, 0, 2, 4, dtype=torch.float64)
        loc = torch.zeros(2, 3, 2, 0, 2, 2, dtype=torch.float64)
        attn = torch.zeros(2, 3, 2, 0, 2, dtype=torch.float64)
        out = ms_deform_attn_reference(value, torch.zeros(0, 2, dtype=torch.long), loc, attn)
    else:
        out = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert out.shape == (sizes["batch"], sizes["queries"], sizes["heads"] * sizes["channels"])
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("shapes", SHAPE_SETS[1:4], ids=lambda s: f"L{len(s)}")
def test_explicit_backward_matches_autograd(shapes, generator):
    problem = make_problem(shapes, batch=2, queries=4, heads=2, channels=3, points=3, generator=generator).requires_grad_()
    grad = torch.randn(2, 4, 6, dtype=torch.float64, generator=generator)
    out = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    want = torch.autograd.grad(out, (problem.value, problem.sampling_locations, problem.attention_weights), grad)
    got = ms_deform_attn_reference_backward(
        grad, problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights
    )
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_l2(g, w) < 1e-12


def test_value_gradient_entries_match_autograd(generator):
    from msda_cases import value_gradient_entries

    problem = make_problem([(4, 5), (2, 3)], batch=2, queries=3, heads=2, channels=3, points=4, generator=generator)
    problem.value.requires_grad_()
    grad = torch.randn(2, 3, 6, dtype=torch.float64, generator=generator)
    out = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    (want,) = torch.autograd.grad(out, problem.value, grad)
    b, key, h, entries = value_gradient_entries(grad, *problem.args())
    dense = torch.zeros_like(want)
    dense[b, key, h] = entries
    assert rel_l2(dense, want) < 1e-12
