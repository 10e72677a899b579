"""Property tests: random valid problems agree with the loop reference; random malformed ones get a
clear TypeError / ValueError (or BackendUnavailableError), never a crash or a silent answer.
On a GPU the same properties run for every compiled backend that is available."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmdeform_tma
from msda_cases import COMPILED_BACKENDS, backend_skip_reason, gather_reference, loop_reference, make_problem, rel_l2

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# float64 checks the indexing logic exactly. float32 also covers the compiled kernels' float32
# layouts; the reference backend's float32 path (grid_sample) rounds its geometry differently from
# the kernels, and its accuracy is tested on realistic problems in test_reference.py.
CASES = [("cpu", "pytorch", torch.float64)] + [
    ("cuda", b, dtype) for b in COMPILED_BACKENDS if backend_skip_reason(b) is None for dtype in (torch.float64, torch.float32)
]
CASE_IDS = [f"{device}-{backend}-{str(dtype)[6:]}" for device, backend, dtype in CASES]


def tolerance(p, exact, dtype):
    """float64: 1e-10. float32: 1e-5, or 2x the error of the same sum with float32 sampling geometry
    (FA3's rule): a location far from the origin puts a sample on a level's edge with a tiny bilinear
    weight that float32 cannot resolve."""
    if dtype == torch.float64:
        return 1e-10
    geometry32 = gather_reference(*p.args(), coord_dtype=torch.float32)
    finite = torch.isfinite(exact)
    return max(1e-5, 2 * rel_l2(geometry32[finite], exact[finite]))


@st.composite
def problems(draw):
    levels = draw(st.integers(1, 5))
    shapes = [(draw(st.integers(1, 6)), draw(st.integers(1, 6))) for _ in range(levels)]
    return dict(
        shapes=shapes,
        batch=draw(st.integers(1, 2)),
        queries=draw(st.integers(1, 4)),
        heads=draw(st.integers(1, 3)),
        channels=draw(st.sampled_from([1, 2, 3, 8, 16, 32])),
        points=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**16)),
        spread=draw(st.sampled_from([0.0, 0.3, 5.0, 1e6])),
    )


@pytest.mark.parametrize("device, backend, dtype", CASES, ids=CASE_IDS)
@SETTINGS
@given(spec=problems())
def test_random_valid_problems_match_the_loop_reference(device, backend, dtype, spec):
    g = torch.Generator().manual_seed(spec.pop("seed"))
    shapes, spread = spec.pop("shapes"), spec.pop("spread")
    p = make_problem(shapes, **spec, generator=g, spread=spread, dtype=dtype)
    expected = loop_reference(p.value, p.spatial_shapes, p.sampling_locations, p.attention_weights)
    tol = tolerance(p, expected, dtype)
    p = p.to(device=device, dtype=dtype, coord_dtype=dtype)
    if mmdeform_tma.get_backend(backend).not_supported_reasons(mmdeform_tma.inputs.validate(*p.args())):
        with pytest.raises(mmdeform_tma.BackendUnavailableError):
            mmdeform_tma.multi_scale_deformable_attn(*p.args(), backend=backend)
        return
    out = mmdeform_tma.multi_scale_deformable_attn(*p.args(), backend=backend)
    assert rel_l2(out.cpu(), expected) <= tol


def doubled(t, dim):
    return torch.cat([t, t], dim)


# name -> (argument to replace, how to derive the bad value from the valid problem)
MALFORMATIONS = {
    "drop_value_dim": ("value", lambda p: p.value[0]),
    "float_shapes": ("spatial_shapes", lambda p: p.spatial_shapes.float()),
    "int32_shapes": ("spatial_shapes", lambda p: p.spatial_shapes.int()),
    "int32_starts": ("level_start_index", lambda p: p.level_start_index.int()),
    "shift_starts": ("level_start_index", lambda p: p.level_start_index + 1),
    "grow_level": (
        "spatial_shapes",
        lambda p: p.spatial_shapes + torch.tensor([[1, 0]] + [[0, 0]] * (len(p.spatial_shapes) - 1)),
    ),
    "value_int": ("value", lambda p: p.value.long()),
    "loc_float64": ("sampling_locations", lambda p: p.sampling_locations.double()),
    "attn_half_with_float_value": ("attention_weights", lambda p: p.attention_weights.half()),
    "batch_mismatch": ("sampling_locations", lambda p: doubled(p.sampling_locations, 0)),
    "heads_mismatch": ("attention_weights", lambda p: doubled(p.attention_weights, 2)),
    "levels_mismatch": ("sampling_locations", lambda p: doubled(p.sampling_locations, 3)),
    "points_mismatch": ("attention_weights", lambda p: doubled(p.attention_weights, 4)),
    "queries_mismatch": ("attention_weights", lambda p: doubled(p.attention_weights, 1)),
    "loc_last_dim_3": (
        "sampling_locations",
        lambda p: torch.cat([p.sampling_locations, p.sampling_locations[..., :1]], -1),
    ),
    "negative_shape": ("spatial_shapes", lambda p: -p.spatial_shapes),
    "not_a_tensor": ("attention_weights", lambda p: p.attention_weights.tolist()),
    "loc_on_meta": ("sampling_locations", lambda p: p.sampling_locations.to("meta")),
}


def malform(p, how):
    args = dict(value=p.value, spatial_shapes=p.spatial_shapes, level_start_index=p.level_start_index,
                sampling_locations=p.sampling_locations, attention_weights=p.attention_weights)
    name, bad = MALFORMATIONS[how]
    args[name] = bad(p)
    return args


@pytest.mark.parametrize("device, backend", sorted({c[:2] for c in CASES}), ids=lambda x: str(x))
@SETTINGS
@given(spec=problems(), how=st.sampled_from(sorted(MALFORMATIONS)))
def test_malformed_inputs_raise_clear_errors(device, backend, spec, how):
    g = torch.Generator().manual_seed(spec.pop("seed"))
    shapes, spread = spec.pop("shapes"), spec.pop("spread")
    p = make_problem(shapes, **spec, generator=g, spread=spread, dtype=torch.float32)
    p = p.to(device=device, dtype=torch.float32, coord_dtype=torch.float32)
    p.spatial_shapes, p.level_start_index = p.spatial_shapes.cpu(), p.level_start_index.cpu()  # host-checked
    with pytest.raises((TypeError, ValueError, mmdeform_tma.BackendUnavailableError)) as info:
        mmdeform_tma.multi_scale_deformable_attn(**malform(p, how), backend=backend)
    assert str(info.value)


@pytest.mark.parametrize("device, backend, dtype", CASES, ids=CASE_IDS)
@SETTINGS
@given(
    spec=problems(),
    value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    where=st.sampled_from(["value", "loc", "attn"]),
    index=st.integers(0, 2**16),
)
def test_non_finite_inputs_propagate_as_documented(device, backend, dtype, spec, value, where, index):
    """mmdeform_tma.reference's rule: NaN/Inf values and weights propagate, NaN/Inf locations are outside."""
    g = torch.Generator().manual_seed(spec.pop("seed"))
    shapes, spread = spec.pop("shapes"), spec.pop("spread")
    p = make_problem(shapes, **spec, generator=g, spread=spread, dtype=dtype)
    target = {"value": p.value, "loc": p.sampling_locations, "attn": p.attention_weights}[where]
    target.view(-1)[index % target.numel()] = value
    expected = gather_reference(*p.args())
    tol = tolerance(p, expected, dtype)
    p = p.to(device=device, dtype=dtype, coord_dtype=dtype)
    if mmdeform_tma.get_backend(backend).not_supported_reasons(mmdeform_tma.inputs.validate(*p.args())):
        with pytest.raises(mmdeform_tma.BackendUnavailableError):
            mmdeform_tma.multi_scale_deformable_attn(*p.args(), backend=backend)
        return
    out = mmdeform_tma.multi_scale_deformable_attn(*p.args(), backend=backend).cpu()
    # Which outputs are non-finite is the contract; NaN against Inf may differ with the order of
    # operations (the kernels fold the attention into each corner weight: Inf x (+v) + Inf x (-v)).
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(out), finite)
    if backend == "pytorch":
        assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert rel_l2(out[finite], expected[finite]) <= tol
