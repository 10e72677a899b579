"""Input validation: every malformed argument gets its own clear error."""

import pytest
import torch

import mmdeform_tma
from mmdeform_tma.inputs import validate
from msda_cases import make_problem


@pytest.fixture
def problem(generator):
    return make_problem([(4, 3), (2, 2)], batch=2, queries=3, heads=2, channels=4, points=2, dtype=torch.float32, generator=generator)


def call(problem, **replace):
    args = dict(
        value=problem.value,
        spatial_shapes=problem.spatial_shapes,
        level_start_index=problem.level_start_index,
        sampling_locations=problem.sampling_locations,
        attention_weights=problem.attention_weights,
    )
    args.update(replace)
    return mmdeform_tma.multi_scale_deformable_attn(**args, backend="pytorch")


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("value", lambda p: p.value[0], "value must have 4 dimensions"),
        ("spatial_shapes", lambda p: p.spatial_shapes.flatten(), "spatial_shapes must have 2 dimensions"),
        ("spatial_shapes", lambda p: torch.ones(2, 3, dtype=torch.long), r"spatial_shapes must be \(levels, 2\)"),
        ("level_start_index", lambda p: p.level_start_index[None], "level_start_index must have 1 dimensions"),
        ("sampling_locations", lambda p: p.sampling_locations[..., 0], "sampling_locations must have 6 dimensions"),
        ("sampling_locations", lambda p: torch.zeros(*p.sampling_locations.shape[:-1], 3), "last dimension of sampling_locations must be 2"),
        ("attention_weights", lambda p: p.attention_weights[0], "attention_weights must have 5 dimensions"),
    ],
)
def test_wrong_rank_or_shape(problem, name, bad, message):
    with pytest.raises(ValueError, match=message):
        call(problem, **{name: bad(problem)})


def test_not_a_tensor(problem):
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        call(problem, value=problem.value.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float64])
def test_spatial_shapes_must_be_int64(problem, dtype):
    with pytest.raises(TypeError, match="spatial_shapes must be int64"):
        call(problem, spatial_shapes=problem.spatial_shapes.to(dtype))


def test_level_start_index_must_be_int64(problem):
    with pytest.raises(TypeError, match="level_start_index must be int64"):
        call(problem, level_start_index=problem.level_start_index.int())


def test_level_start_index_must_match_shapes(problem):
    bad = problem.level_start_index.clone()
    bad[1] += 1
    with pytest.raises(ValueError, match=r"level_start_index\[1\] = 13 does not match spatial_shapes"):
        call(problem, level_start_index=bad)


def test_num_keys_must_equal_sum_of_hw(problem):
    with pytest.raises(ValueError, match="cover 16 keys .* num_keys = 15"):
        call(problem, value=problem.value[:, :15])


def test_negative_shapes(problem):
    bad = problem.spatial_shapes.clone()
    bad[1, 0] = -2
    with pytest.raises(ValueError, match="is negative"):
        call(problem, spatial_shapes=bad)


@pytest.mark.parametrize(
    "name, slicer, what",
    [
        ("sampling_locations", lambda t: t[:1], "batch size"),
        ("attention_weights", lambda t: t[:, :, :1], "number of heads"),
        ("attention_weights", lambda t: t[:, :, :, :1], "number of levels"),
        ("sampling_locations", lambda t: t[:, :, :, :, :1], "number of points"),
        ("attention_weights", lambda t: t[:, :2], "number of queries"),
    ],
)
def test_mismatched_sizes(problem, name, slicer, what):
    with pytest.raises(ValueError, match=f"{what} differs between arguments"):
        call(problem, **{name: slicer(getattr(problem, name))})


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool])
def test_value_dtype(problem, dtype):
    with pytest.raises(TypeError, match="value must be float16, bfloat16, float32 or float64"):
        call(problem, value=problem.value.to(dtype))


def test_location_dtype_must_be_float32_or_value_dtype(problem):
    with pytest.raises(TypeError, match="sampling_locations must be"):
        call(problem, sampling_locations=problem.sampling_locations.double())
    with pytest.raises(TypeError, match="attention_weights must be"):
        call(problem, attention_weights=problem.attention_weights.bfloat16())


def test_half_locations_with_half_value_are_accepted(problem):
    out = call(problem, value=problem.value.half(), sampling_locations=problem.sampling_locations.half())
    assert out.dtype == torch.float16


def test_mixed_devices(problem):
    meta = problem.sampling_locations.to("meta")
    with pytest.raises(ValueError, match="sampling_locations is on meta but value is on cpu"):
        call(problem, sampling_locations=meta)
    with pytest.raises(ValueError, match="spatial_shapes is on meta; it must be on the CPU or on value's device"):
        call(problem, spatial_shapes=problem.spatial_shapes.to("meta"))


def test_non_contiguous_and_expanded_inputs_are_accepted(problem):
    expected = call(problem)
    value_t = problem.value.transpose(0, 1).contiguous().transpose(0, 1)
    assert not value_t.is_contiguous()
    weights = problem.attention_weights[:, :, :, :, :1].expand_as(problem.attention_weights)
    assert weights.stride(-1) == 0
    torch.testing.assert_close(call(problem, value=value_t), expected)
    torch.testing.assert_close(
        call(problem, attention_weights=weights), call(problem, attention_weights=weights.contiguous())
    )


def test_im2col_step_is_accepted_but_checked(problem):
    expected = call(problem)
    torch.testing.assert_close(
        mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend="pytorch", im2col_step=7), expected
    )
    with pytest.raises(ValueError, match="im2col_step must be a positive int"):
        mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend="pytorch", im2col_step=0)


def test_value_checks_run_for_cpu_shapes_and_in_strict_mode(problem):
    # `validate` reads shape values only when they are on the CPU or strict mode is on; with the
    # metadata on the meta device (a stand-in for a GPU here) it must not read them.
    bad = problem.spatial_shapes.clone()
    bad[0, 0] = 9
    with pytest.raises(ValueError):
        validate(problem.value, bad, problem.level_start_index, problem.sampling_locations, problem.attention_weights)
    meta_args = [t.to("meta") for t in problem.args()]
    validate(*meta_args)  # no value check, no error
    with mmdeform_tma.strict_validation_enabled(True):
        assert mmdeform_tma.strict_validation()
        with pytest.raises((NotImplementedError, RuntimeError)):  # meta tensors have no values to read
            validate(*meta_args)
    assert not mmdeform_tma.strict_validation()


def test_cpu_shapes_are_checked_when_the_starts_live_on_the_device(problem):
    """CPU spatial_shapes are read (no synchronisation); device-resident starts are not."""
    on_meta = dict(value=problem.value.to("meta"), sampling_locations=problem.sampling_locations.to("meta"), attention_weights=problem.attention_weights.to("meta"))
    starts = problem.level_start_index.to("meta")
    validate(on_meta["value"], problem.spatial_shapes, starts, on_meta["sampling_locations"], on_meta["attention_weights"])
    bad = problem.spatial_shapes.clone()
    bad[0, 0] = 9
    with pytest.raises(ValueError, match="cover 31 keys"):
        validate(on_meta["value"], bad, starts, on_meta["sampling_locations"], on_meta["attention_weights"])


def test_size_checks_relate_symbolic_sizes_without_pinning_them():
    """A set of symbolic sizes would hash them, pinning each to its value under dynamic shapes."""
    from mmdeform_tma.inputs import _require_same_size
    from msda_cases import guards, symbolic_sizes

    (a, b), env = symbolic_sizes(a=300, b=300)
    x, y = a.node.expr, b.node.expr  # before the check: equal symbols are merged after it
    _require_same_size("number of queries", {"sampling_locations": a, "attention_weights": b})
    assert guards(env) in ([f"Eq({x}, {y})"], [f"Eq({y}, {x})"])
    with pytest.raises(ValueError, match="number of queries differs"):
        _require_same_size("number of queries", {"sampling_locations": 3, "attention_weights": 4})
