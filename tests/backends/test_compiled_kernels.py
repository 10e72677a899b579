"""GPU tests of the compiled backends (cuda, tma_ws) against float64 references.

Accuracy rules (relative L2 against float64 on the same rounded inputs):
  - float32 results: at most 1e-5;
  - float16 / bfloat16 results: at most 1.5x the error of rounding the exact result to that dtype;
  - gradients of locations and weights may also reach 2x the error of the same computation with
    float32 sampling geometry (FA3's rule): with levels thousands of pixels wide, a float32
    location only resolves ~1e-4 of a pixel, which no float32 kernel can beat.
"""

from __future__ import annotations

import re

import pytest
import torch

import mmdeform_tma
from mmdeform_tma._extension import extension, kernel_configs
from mmdeform_tma.backends import BACKENDS
from mmdeform_tma.inputs import validate
from msda_cases import (
    COMPILED_BACKENDS,
    Problem,
    backend_skip_reason,
    gather_reference,
    make_problem,
    region_forward_reason,
    rel_l2,
    rounding_error,
    tensor_core_forward_reason,
    value_gradient_entries,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (name, level shapes, batch, queries, heads, channels, points, locality)
CASES = [
    ("detr_like", [(20, 30), (10, 15), (5, 8), (3, 4)], 2, 300, 8, 32, 4, "local"),
    ("uniform_outside", [(13, 17), (7, 9), (4, 5)], 2, 200, 4, 32, 4, "uniform"),
    ("one_level_p1", [(9, 11)], 3, 50, 2, 16, 1, "uniform"),
    ("five_levels_p8", [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)], 1, 120, 8, 64, 8, "local"),
    ("c128_h16_p16", [(10, 12), (5, 6)], 1, 40, 16, 128, 16, "uniform"),
    ("c256_h1", [(6, 7), (3, 4)], 2, 30, 1, 256, 2, "uniform"),
    ("c6_odd_levels", [(5, 7), (3, 1), (1, 9)], 2, 60, 3, 6, 3, "uniform"),
    ("c3_odd_channels", [(5, 4), (2, 3)], 2, 40, 2, 3, 2, "uniform"),
    ("seven_levels", [(6, 6), (5, 5), (4, 4), (3, 3), (2, 2), (1, 2), (1, 1)], 1, 50, 2, 32, 2, "uniform"),
    # Encoder self-attention (one query per pixel): tma_ws tiles these in pixel blocks with windows.
    ("encoder_4_levels", [(24, 36), (12, 18), (6, 9), (3, 5)], 2, 1149, 8, 32, 4, "encoder"),
    ("encoder_c64_odd", [(17, 23), (9, 12), (5, 6)], 1, 529, 4, 64, 2, "encoder"),
    ("encoder_c8_p8", [(20, 13), (10, 7)], 2, 330, 2, 8, 8, "encoder"),
]
# One query per key, sampled uniformly: pixel-block tiles whose points spread over a level larger
# than a 16 x 16 window, so the MMA backward has stages without a window (every point direct)
# beside windowed ones (the smaller levels).
ENCODER_UNIFORM = ("encoder_uniform", [(24, 36), (12, 18), (6, 9), (3, 5)], 2, 1149, 8, 32, 4, "uniform")


def skip_unless_supported(name: str, inputs):
    if reason := backend_skip_reason(name, inputs.dtype):
        pytest.skip(reason)
    reasons = BACKENDS[name].not_supported_reasons(inputs)
    if reasons:
        pytest.skip(f"{name}: " + "; ".join(reasons))


def tolerance(dtype: torch.dtype, exact: torch.Tensor) -> float:
    if dtype in (torch.float16, torch.bfloat16):
        return 1.5 * rounding_error(exact, dtype) + 1e-12
    return 1e-5


def check(actual: torch.Tensor, exact: torch.Tensor, what: str, same_dtype_reference: torch.Tensor | None = None) -> None:
    assert actual.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err, tol = rel_l2(actual, exact), tolerance(actual.dtype, exact)
    if same_dtype_reference is not None:
        tol = max(tol, 2 * rel_l2(same_dtype_reference, exact))
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.3e}"


def float32_geometry_grads(problem, grad_output):
    """Gradients from the float64 gather reference with float32 sampling geometry."""
    inputs = [t.detach().double().requires_grad_() for t in (problem.value, problem.sampling_locations, problem.attention_weights)]
    out = gather_reference(inputs[0], problem.spatial_shapes, problem.level_start_index, inputs[1], inputs[2], coord_dtype=torch.float32)
    return torch.autograd.grad(out, inputs, grad_output.double())


def cuda_problem(case, dtype, seed=0):
    name, shapes, batch, queries, heads, channels, points, locality = case
    g = torch.Generator().manual_seed(seed)
    p = make_problem(shapes, batch, queries, heads, channels, points, dtype=dtype, generator=g, locality=locality)
    return p.to(device="cuda", dtype=dtype, coord_dtype=p.sampling_locations.dtype)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_forward_and_backward_against_float64(backend, dtype, case):
    problem = cuda_problem(case, dtype)
    skip_unless_supported(backend, validate(*problem.args()))
    problem.requires_grad_()
    out = mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend=backend)
    exact_inputs = [t.detach().double().requires_grad_() for t in (problem.value, problem.sampling_locations, problem.attention_weights)]
    exact = gather_reference(exact_inputs[0], problem.spatial_shapes, problem.level_start_index, exact_inputs[1], exact_inputs[2])
    assert out.shape == exact.shape and out.dtype == dtype
    check(out, exact, "output")

    grad_output = torch.randn_like(out)
    grads = torch.autograd.grad(out, (problem.value, problem.sampling_locations, problem.attention_weights), grad_output)
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad_output.double())
    geometry32 = float32_geometry_grads(problem, grad_output)
    for i, (name, got, want, source) in enumerate(zip(
        ("grad_value", "grad_locations", "grad_weights"), grads, exact_grads,
        (problem.value, problem.sampling_locations, problem.attention_weights),
    )):
        assert got.dtype == source.dtype and got.shape == source.shape
        check(got, want, name, geometry32[i] if i > 0 else None)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_half_locations_are_upcast_not_truncated(backend, dtype):
    problem = cuda_problem(CASES[0], dtype, seed=3)
    skip_unless_supported(backend, validate(*problem.args()))
    loc16 = problem.sampling_locations.to(dtype)
    out = mmdeform_tma.multi_scale_deformable_attn(problem.value, problem.spatial_shapes, problem.level_start_index, loc16, problem.attention_weights, backend=backend)
    exact = gather_reference(problem.value, problem.spatial_shapes, problem.level_start_index, loc16, problem.attention_weights)
    check(out, exact, "output")


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_gradcheck_float64(backend):
    problem = cuda_problem(("small", [(4, 5), (2, 3)], 1, 3, 2, 4, 2, "uniform"), torch.float64, seed=5)
    problem.sampling_locations = problem.sampling_locations.clamp(-0.2, 1.2) + 1e-3
    skip_unless_supported(backend, validate(*problem.args()))
    problem.requires_grad_()

    def fn(value, locations, weights):
        return mmdeform_tma.multi_scale_deformable_attn(value, problem.spatial_shapes, problem.level_start_index, locations, weights, backend=backend)

    assert torch.autograd.gradcheck(fn, (problem.value, problem.sampling_locations, problem.attention_weights), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deterministic_backward_is_bitwise_repeatable(backend, dtype):
    problem = cuda_problem(CASES[0], dtype, seed=7)
    skip_unless_supported(backend, validate(*problem.args()))
    problem.requires_grad_()
    torch.use_deterministic_algorithms(True)
    grad_output = torch.randn(problem.value.shape[0], problem.sampling_locations.shape[1], problem.value.shape[2] * problem.value.shape[3], device="cuda", dtype=dtype)
    runs = []
    for _ in range(3):
        out = mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend=backend)
        runs.append(torch.autograd.grad(out, (problem.value, problem.sampling_locations, problem.attention_weights), grad_output))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    exact_inputs = [t.detach().double().requires_grad_() for t in (problem.value, problem.sampling_locations, problem.attention_weights)]
    exact = gather_reference(exact_inputs[0], problem.spatial_shapes, problem.level_start_index, exact_inputs[1], exact_inputs[2])
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad_output.double())
    for got, want in zip(runs[0], exact_grads):
        check(got, want, "deterministic gradient")


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30], ids=["1e-30", "1", "1e30"])
def test_deterministic_backward_fixed_point_scale_at_any_gradient_scale(backend, magnitude):
    """The fixed-point scale is a power of two 2^e applied as two fp32 factors: at 1e-30 e is past
    float's exponent range (both factors are needed), at 1e30 it is negative. fp32 accuracy holds
    at every scale, and the result is bitwise the same twice."""
    problem = cuda_problem(CASES[0], torch.float32, seed=41)
    skip_unless_supported(backend, validate(*problem.args()))
    value, shapes, starts, loc, attn = problem.args()
    exact_inputs = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    exact = gather_reference(exact_inputs[0], shapes, starts, exact_inputs[1], exact_inputs[2])
    g = torch.Generator(device="cuda").manual_seed(43)
    grad_output = (torch.randn(exact.shape, device="cuda", generator=g) * magnitude).float()
    (want,) = torch.autograd.grad(exact, exact_inputs[0], grad_output.double())
    runs = [torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, value, shapes, starts, loc, attn, backend, -1, True)[0]
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert torch.isfinite(runs[0]).all()
    err = rel_l2(runs[0], want)
    assert err <= 1e-5, f"relative L2 error {err:.3e}"


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_empty_dimensions(backend):
    for batch, queries in ((0, 5), (2, 0)):
        problem = cuda_problem(("empty", [(3, 4)], max(batch, 1), max(queries, 1), 2, 16, 2, "uniform"), torch.float32)
        value = problem.value[:batch]
        loc = problem.sampling_locations[:batch, :queries].clone().requires_grad_()
        attn = problem.attention_weights[:batch, :queries].clone().requires_grad_()
        out = mmdeform_tma.multi_scale_deformable_attn(value, problem.spatial_shapes, problem.level_start_index, loc, attn, backend=backend)
        assert out.shape == (batch, queries, 32)
        out.sum().backward()
        assert loc.grad.shape == loc.shape


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_inconsistent_device_geometry_poisons_output(backend):
    problem = cuda_problem(CASES[1], torch.float32)
    skip_unless_supported(backend, validate(*problem.args()))
    bad = problem.spatial_shapes.clone()
    bad[0, 1] += 1  # the GPU copy disagrees with value's num_keys; not checked on the host
    out = mmdeform_tma.multi_scale_deformable_attn(problem.value, bad, problem.level_start_index, problem.sampling_locations, problem.attention_weights, backend=backend)
    assert torch.isnan(out).all()
    with mmdeform_tma.strict_validation_enabled(True), pytest.raises(ValueError, match="does not match spatial_shapes"):
        mmdeform_tma.multi_scale_deformable_attn(problem.value, bad, problem.level_start_index, problem.sampling_locations, problem.attention_weights, backend=backend)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_non_finite_inputs_propagate_like_the_reference(backend):
    problem = cuda_problem(CASES[0], torch.float32, seed=11)
    skip_unless_supported(backend, validate(*problem.args()))
    value = problem.value.clone()
    value[0, 5] = float("nan")
    value[1, 40] = float("inf")
    loc = problem.sampling_locations.clone()
    loc[0, 0, 0, 0, 0] = float("nan")
    loc[0, 1, 0, 0, 0] = float("inf")
    loc[1, 2, 0, 0, 0] = -1e30
    args = (value, problem.spatial_shapes, problem.level_start_index, loc, problem.attention_weights)
    out = mmdeform_tma.multi_scale_deformable_attn(*args, backend=backend)
    expected = mmdeform_tma.multi_scale_deformable_attn(*args, backend="pytorch")
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert rel_l2(out[finite], expected[finite]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_more_than_2_pow_31_elements(backend):
    """value and its gradient hold more than 2^31 elements; the sampled keys lie beyond 2^31."""
    if reason := backend_skip_reason(backend, torch.float16):
        pytest.skip(reason)
    side = 2900  # 2900 * 2900 keys x 8 heads x 32 channels = 2.15e9 elements
    shapes = torch.tensor([[side, side]], device="cuda")
    starts = torch.tensor([0], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    value = torch.randn(1, side * side, 8, 32, device="cuda", dtype=torch.float16, generator=g)
    assert value.numel() > 2**31
    queries, points = 64, 4
    loc = torch.rand(1, queries, 8, 1, points, 2, device="cuda", generator=g)
    loc[..., 1] = 0.97 + 0.03 * loc[..., 1]  # bottom rows: element offsets beyond 2^31
    attn = torch.rand(1, queries, 8, 1, points, device="cuda", generator=g)
    loc.requires_grad_()
    value.requires_grad_()
    out = mmdeform_tma.multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend=backend)
    exact = gather_reference(value.detach(), shapes, starts, loc.detach(), attn)
    check(out, exact, "output")
    grad_output = torch.randn_like(out)
    grad_value, grad_loc = torch.autograd.grad(out, (value, loc), grad_output)
    b, key, h, entries = value_gradient_entries(grad_output, value, shapes, starts, loc.detach(), attn)
    assert key.max().item() * 8 * 32 > 2**31
    check(grad_value[b, key, h], entries, "grad_value at touched entries")
    untouched = torch.randint(0, side * side, (4096,), device="cuda", generator=g)
    untouched = untouched[~torch.isin(untouched, key)]
    assert torch.count_nonzero(grad_value[0, untouched]) == 0
    loc_exact = loc.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(gather_reference(value.detach(), shapes, starts, loc_exact, attn), loc_exact, grad_output.double())
    loc32 = loc.detach().double().requires_grad_()
    out32 = gather_reference(value.detach(), shapes, starts, loc32, attn, coord_dtype=torch.float32)
    (geometry32,) = torch.autograd.grad(out32, loc32, grad_output.double())
    check(grad_loc, want, "grad_locations", geometry32)


@pytest.mark.slow
@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_dino_5scale_batch_16_persistent_loop(backend):
    """bs 16 on DINO's 5-scale encoder (S = 89k): many tiles per persistent CTA, a partial last
    tile; the loop must finish (the earlier prototype hung here) and agree with float64."""
    if reason := backend_skip_reason(backend, torch.float16):
        pytest.skip(reason)
    levels = [(200, 334), (100, 167), (50, 84), (25, 42), (13, 21)]
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = torch.tensor(levels, device="cuda")
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    keys = int((shapes[:, 0] * shapes[:, 1]).sum())
    assert keys == 89023
    value = torch.randn(16, keys, 8, 32, device="cuda", dtype=torch.float16, generator=g)
    loc = torch.rand(16, keys, 8, 5, 4, 2, device="cuda", generator=g)
    attn = torch.rand(16, keys, 8, 5, 4, device="cuda", generator=g)
    value.requires_grad_()
    out = mmdeform_tma.multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend=backend)
    grad_value, = torch.autograd.grad(out, value, torch.ones_like(out))
    torch.cuda.synchronize()
    rows = torch.randint(0, keys, (256,), device="cuda", generator=g)
    exact = gather_reference(value.detach(), shapes, starts, loc[:, rows], attn[:, rows])
    check(out[:, rows], exact, "output on sampled queries")
    assert torch.isfinite(grad_value).all()


def test_kernel_side_checks_raise_instead_of_crashing():
    """The C++ checks behind the Python ones: a direct op call the TMA layout cannot serve raises a
    RuntimeError with its reason (this once segfaulted while formatting the message), and so does a
    kernel family the build no longer has."""
    if reason := backend_skip_reason("tma_ws"):
        pytest.skip(reason)
    value = torch.randn(1, 20, 2, 128, device="cuda")  # 128 fp32 channels: 512-byte rows
    shapes, starts = torch.tensor([[4, 5]], device="cuda"), torch.tensor([0], device="cuda")
    loc, attn = torch.rand(1, 3, 2, 1, 2, 2, device="cuda"), torch.rand(1, 3, 2, 1, 2, device="cuda")
    with pytest.raises(RuntimeError, match="channels must span 16, 32, 64, 128 or 256 bytes, got 128 x 4 B"):
        torch.ops.mmdeform_tma.ms_deform_attn_forward(value, shapes, starts, loc, attn, "tma_ws", -1)
    with pytest.raises(RuntimeError, match="the CUDA kernels are 'cuda' and 'tma_ws', not 'tma'"):
        torch.ops.mmdeform_tma.ms_deform_attn_forward(value, shapes, starts, loc, attn, "tma", -1)


WINDOW_CASES = [CASES[0], CASES[9], CASES[10]]  # a decoder, and two encoders (pixel-block tiles)


def float64_answers(problem, dtype):
    """The float64 output, a random grad_output of `dtype`, the float64 gradients for it and the
    gradients with float32 sampling geometry."""
    exact_inputs = [t.detach().double().requires_grad_() for t in (problem.value, problem.sampling_locations, problem.attention_weights)]
    exact = gather_reference(exact_inputs[0], problem.spatial_shapes, problem.level_start_index, exact_inputs[1], exact_inputs[2])
    grad_output = torch.randn(exact.shape, device="cuda", dtype=dtype)
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad_output.double())
    return exact, grad_output, exact_grads, float32_geometry_grads(problem, grad_output)


def check_backward_config(problem, answers, config: int, name: str, deterministic: bool) -> None:
    """One tma_ws backward config through the op against float64; deterministic: bitwise twice."""
    _, grad_output, exact_grads, geometry32 = answers
    args = problem.args()
    grads = torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, *args, "tma_ws", config, deterministic)
    if deterministic:
        again = torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, *args, "tma_ws", config, True)
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), name
    for i, (what, got, want) in enumerate(zip(("grad_value", "grad_locations", "grad_weights"), grads, exact_grads)):
        check(got, want, f"{name} deterministic={deterministic} {what}", geometry32[i] if i > 0 else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c[0])
def test_every_tma_ws_config_against_float64(case, dtype):
    """Each compiled tma_ws variant (tile size, stages, window budget or no window; the backward's
    gather and MMA variants also deterministic), forward and backward through the ops directly,
    against float64: the autotuner may pick any of them."""
    problem = cuda_problem(case, dtype, seed=13)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    answers = float64_answers(problem, dtype)
    names = kernel_configs("tma_ws", "forward")
    assert len(names) >= 8
    for config, name in enumerate(names):
        if reason := tensor_core_forward_reason(name, problem) or region_forward_reason(name, problem):
            with pytest.raises(RuntimeError, match=reason):
                torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", config)
            continue
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", config)
        check(out, answers[0], f"{name} output")
    backward_names = kernel_configs("tma_ws", "backward")
    shared = [name for name in names if not name.startswith(("tc_", "rg_"))]
    assert list(names) == shared + tensor_core_forward_configs() + region_forward_configs()  # forward-only last
    assert list(backward_names[: len(shared)]) == shared  # the backward-only configs come last
    for config, name in enumerate(backward_names):
        for deterministic in (False, True) if name.endswith("_g") or "_m16" in name else (False,):
            check_backward_config(problem, answers, config, name, deterministic)


def tensor_core_forward_configs() -> list[str]:
    return [name for name in kernel_configs("tma_ws", "forward") if name.startswith("tc_")]


def region_forward_configs() -> list[str]:
    return [name for name in kernel_configs("tma_ws", "forward") if name.startswith("rg_")]


# Decoders and encoders of 32-channel heads: 16 points per item (two unrolled steps), 12 (padding
# lanes in the second step), 14 (seven levels of two), 40 (more than the four unrolled steps: the
# step loop), and uniform sampling with points outside every level.
TENSOR_CORE_FORWARD_CASES = [
    CASES[0],
    CASES[1],
    CASES[8],
    ("p8_five_levels_c32", [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)], 2, 70, 4, 32, 8, "local"),
    CASES[9],
    ENCODER_UNIFORM,
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TENSOR_CORE_FORWARD_CASES, ids=lambda c: c[0])
def test_tma_ws_tensor_core_forward_against_float64(case, dtype):
    """Every tensor-core gather forward config (`tc_*`) against float64 (FA3's rule: at most 1.5x
    the output's own rounding error)."""
    problem = cuda_problem(case, dtype, seed=37)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in problem.args()])
    names = kernel_configs("tma_ws", "forward")
    assert len(tensor_core_forward_configs()) >= 2
    for name in tensor_core_forward_configs():
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", names.index(name))
        check(out, exact, f"{name} output")


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 3e5])
@pytest.mark.parametrize("family", ["tc_", "rg_"])
def test_tma_ws_forward_only_configs_weight_scale(family, magnitude):
    """Attention weights far from softmax's range keep the fp16 accuracy rule through the tensor-core
    gather (`tc_*`, on a decoder) and region (`rg_*`, on an encoder) forwards: the kernels scale each
    slot's, or query's, weights by a power of two before splitting them into fp16 hi and lo parts
    (unscaled, fp16 would lose corner weights of 1e-3 / 16 to subnormals and turn 3e5 into Inf)."""
    problem = cuda_problem(CASES[0] if family == "tc_" else CASES[9], torch.float16, seed=41)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    value = problem.value / 64 if magnitude > 1e4 else problem.value  # outputs stay finite in fp16
    weights = problem.attention_weights * magnitude
    args = (value, problem.spatial_shapes, problem.level_start_index, problem.sampling_locations, weights)
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in args])
    assert torch.isfinite(exact.to(torch.float16)).all()
    names = kernel_configs("tma_ws", "forward")
    configs = [name for name in names if name.startswith(family)]
    assert configs
    for name in configs:
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*args, "tma_ws", names.index(name))
        check(out, exact, f"{name} output at weights x {magnitude:g}")


def test_tma_ws_tensor_core_forward_non_finite_inputs():
    """NaN and +-Inf in value, in the weights and in the locations reach exactly the outputs the
    reference's do through every tensor-core gather forward config (an Inf value is not turned into
    NaN by a zero lo weight)."""
    problem = cuda_problem(CASES[0], torch.float16, seed=43)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    value = problem.value.clone()
    value[0, 100, 3] = float("nan")
    value[1, 300, 5] = float("inf")
    value[1, 780, 2] = -float("inf")  # the coarsest level
    weights = problem.attention_weights.clone()
    weights[0, 7, 1, 0, 2] = float("nan")
    weights[1, 9, 4, 2, 1] = float("inf")
    loc = problem.sampling_locations.clone()
    loc[0, 3, 0, 1, 0] = float("nan")
    loc[1, 4, 2, 0, 3] = float("inf")
    check_non_finite_propagation((value, problem.spatial_shapes, problem.level_start_index, loc, weights),
                                 tensor_core_forward_configs())


def check_non_finite_propagation(args, configs: list[str]) -> None:
    """Each named tma_ws forward config puts NaN and Inf exactly where the float64 reference does, and
    meets the accuracy rule on the finite outputs."""
    expected = gather_reference(*[t.double() if t.is_floating_point() else t for t in args])
    finite = torch.isfinite(expected)
    assert (~finite).any() and finite.any()
    names = kernel_configs("tma_ws", "forward")
    for name in configs:
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*args, "tma_ws", names.index(name))
        assert torch.equal(torch.isnan(out), torch.isnan(expected)), name
        assert torch.equal(torch.isinf(out), torch.isinf(expected)), name
        check(out[finite], expected[finite], f"{name} finite output")


@pytest.mark.parametrize("family", ["tc_", "rg_"])
def test_tma_ws_forward_only_configs_poison_inconsistent_geometry(family):
    """A GPU copy of level_start_index that disagrees with spatial_shapes: every output of the
    tensor-core gather (`tc_*`, on a decoder) and region (`rg_*`, on an encoder) forwards is NaN, and
    nothing outside value is read."""
    problem = cuda_problem(CASES[0] if family == "tc_" else CASES[9], torch.float16, seed=47)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    starts = problem.level_start_index.clone()
    starts[1] += 7
    names = kernel_configs("tma_ws", "forward")
    configs = [name for name in names if name.startswith(family)]
    assert configs
    for name in configs:
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(
            problem.value, problem.spatial_shapes, starts, problem.sampling_locations, problem.attention_weights,
            "tma_ws", names.index(name))
        assert torch.isnan(out).all(), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tma_ws_windowless_forward_poisons_inconsistent_geometry(dtype):
    """Every windowless forward config (`_l1`), the one-slot kernel's among them, with a GPU copy of
    level_start_index that disagrees with spatial_shapes: every output is NaN."""
    problem = cuda_problem(CASES[0], dtype, seed=53)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    starts = problem.level_start_index.clone()
    starts[2] -= 3
    configs = lean_forward_configs()
    assert configs
    for config, name in configs:
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(
            problem.value, problem.spatial_shapes, starts, problem.sampling_locations, problem.attention_weights,
            "tma_ws", config)
        assert torch.isnan(out).all(), name


def mma_configs() -> list[tuple[int, str]]:
    return [(i, n) for i, n in enumerate(kernel_configs("tma_ws", "backward")) if "_m16" in n]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [CASES[9], CASES[10], ENCODER_UNIFORM, CASES[0]], ids=lambda c: c[0])
def test_tma_ws_mma_backward_against_float64(case, dtype):
    """The tensor-core backward (`_m16` configs) in its three dtypes (fp32 on fp16 hi + lo
    operands): on encoders (pixel-block tiles with windows: 32 and 64 channels; uniformly sampled,
    with stages that have none) and a decoder (strips: the configs run without a window), fast and
    deterministic, the deterministic one bitwise the same twice."""
    problem = cuda_problem(case, dtype, seed=19)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    answers = float64_answers(problem, dtype)
    assert len(mma_configs()) >= 2
    for config, name in mma_configs():
        for deterministic in (False, True):
            check_backward_config(problem, answers, config, name, deterministic)


def border_encoder_problem(dtype, edge: str):
    """An encoder sampled around its pixels, with every point moved into the band of half a pixel
    past one edge of its level (`left`: x0 = -1, `top`: y0 = -1) or past the bottom-right corner
    (only the top-left corner inside). The points keep their other coordinate, so each tile's
    points cluster along the edge: the MMA window takes them with the corners outside the level,
    which it must never add (window_pipeline.cuh, kMmaCellBias)."""
    shapes, batch, heads = [(48, 64), (24, 32), (12, 16), (6, 8)], 2, 8
    keys = sum(h * w for h, w in shapes)
    g = torch.Generator().manual_seed(31)
    p = make_problem(shapes, batch, keys, heads, 32, 4, generator=g, locality="encoder", outside_fraction=0)
    loc = p.sampling_locations.clone()  # (batch, queries, heads, levels, points, 2), normalised
    size = torch.tensor([[w, h] for h, w in shapes], dtype=loc.dtype).view(1, 1, 1, len(shapes), 1, 2)
    band = torch.rand(loc.shape[:-1], generator=g, dtype=loc.dtype)

    def past_start(axis):  # pixel band - 1, in (-1, 0), normalised
        return (band - 0.5) / size[..., axis]

    def past_end(axis):  # pixel size - 1 + band
        return 1 + past_start(axis)

    if edge == "left":
        loc[..., 0] = past_start(0)
    elif edge == "top":
        loc[..., 1] = past_start(1)
    else:
        loc[..., 0], loc[..., 1] = past_end(0), past_end(1)
    problem = Problem(p.value, p.spatial_shapes, p.level_start_index, loc, p.attention_weights)
    return problem.to(device="cuda", dtype=dtype, coord_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("edge", ["left", "top", "bottom_right"])
def test_tma_ws_mma_backward_points_across_a_level_edge(edge, dtype):
    """Points with corners outside their level, clustered along its edge, so that the MMA window
    takes them: every MMA config, fast and deterministic, against float64."""
    problem = border_encoder_problem(dtype, edge)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    answers = float64_answers(problem, dtype)
    for config, name in mma_configs():
        for deterministic in (False, True):
            check_backward_config(problem, answers, config, name, deterministic)


def spread_encoder_problem(dtype, uniform_heads: str):
    """An encoder (one query per pixel, 48 x 64 at the finest level, 32 channels) without points
    pushed outside: every head sampled around its pixel ('none'), uniformly ('all'), or the even
    heads uniformly and the odd ones around their pixel ('alternate')."""
    shapes, batch, heads = [(48, 64), (24, 32), (12, 16), (6, 8)], 2, 8
    keys = sum(h * w for h, w in shapes)
    g = torch.Generator().manual_seed(29)
    local = make_problem(shapes, batch, keys, heads, 32, 4, generator=g, locality="encoder", outside_fraction=0)
    uniform = make_problem(shapes, batch, keys, heads, 32, 4, generator=g, locality="uniform", outside_fraction=0)
    chosen = {"none": [], "all": list(range(heads)), "alternate": list(range(0, heads, 2))}[uniform_heads]
    loc = local.sampling_locations.clone()
    loc[:, :, chosen] = uniform.sampling_locations[:, :, chosen]
    problem = Problem(local.value, local.spatial_shapes, local.level_start_index, loc, local.attention_weights)
    return problem.to(device="cuda", dtype=dtype, coord_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("uniform_heads", ["none", "all", "alternate"])
def test_tma_ws_spread_fallback_against_float64(uniform_heads, dtype):
    """The fast 32-channel MMA backward leaves each CTA whose first stage's points spread to a
    fallback over the same tiles (fp16/bf16: the plain kernel; fp32: the portable kernel's teams,
    hopper/spread_fallback.cuh): with every CTA clustered (the MMA kernel alone), every CTA spread
    (the fallback alone) and the two mixed in one call, against float64, for every MMA config and
    the default. A tile done by both kernels or by neither would show in grad_value."""
    problem = spread_encoder_problem(dtype, uniform_heads)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    answers = float64_answers(problem, dtype)
    for config, name in [(-1, "default"), *mma_configs()]:
        check_backward_config(problem, answers, config, name, deterministic=False)


def cuda_graph_replays(fn, replays=2):
    """Captures fn() in a CUDA graph (after a warm-up on the capture stream) and yields its outputs
    after each replay, which runs over outputs first filled with NaN: a replay that leaves an
    element unwritten shows it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for _ in range(replays):
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield captured


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("uniform_heads", ["all", "alternate"])
def test_tma_ws_spread_fallback_in_cuda_graph_replays(uniform_heads, dtype):
    """The spread fallback inside a CUDA graph: replayed twice over NaN-filled outputs, it gives the
    eager location and weight gradients bit for bit and the value gradient up to the order of its
    fp32 atomics. fp32's fallback takes its runs of items from a counter that the MMA kernel zeroes
    on every launch, so a replay that found it spent would leave gradients missing."""
    problem = spread_encoder_problem(dtype, uniform_heads)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    grad_output = torch.randn(problem.value.shape[0], problem.sampling_locations.shape[1],
                              problem.value.shape[2] * problem.value.shape[3], device="cuda", dtype=dtype)
    args = problem.args()

    def backward():
        return torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, *args, "tma_ws", -1, False)

    eager = backward()
    for captured in cuda_graph_replays(backward):
        for what, got, want in zip(("grad_value", "grad_locations", "grad_weights"), captured, eager):
            assert not torch.isnan(got).any(), what
            if what == "grad_value":  # fp32 atomics: their order may differ
                torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5, msg=what)
            else:
                assert torch.equal(got, want), what


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tma_ws_spread_fallback_poisons_inconsistent_geometry(dtype):
    """Where the GPU copy of spatial_shapes disagrees with value, the MMA kernel poisons the location
    and weight gradients, as every backward does, and leaves no CTA to the spread fallback."""
    problem = spread_encoder_problem(dtype, "all")
    skip_unless_supported("tma_ws", validate(*problem.args()))
    bad = problem.spatial_shapes.clone()
    bad[0, 1] += 1
    loc = problem.sampling_locations.clone().requires_grad_()
    weights = problem.attention_weights.clone().requires_grad_()
    out = mmdeform_tma.multi_scale_deformable_attn(problem.value, bad, problem.level_start_index, loc, weights, backend="tma_ws")
    out.backward(torch.ones_like(out))
    assert torch.isnan(loc.grad).all() and torch.isnan(weights.grad).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_tma_ws_mma_backward_non_finite_rows_and_large_weights(deterministic):
    """Rows of grad_output with a NaN or an Inf, and attention weights beyond 1, take the MMA
    backward's direct path: a NaN or Inf reaches exactly the value cells the reference's does (a
    product with the dense weight matrix would spread it over the whole window), and the finite
    rest stays within the accuracy rules."""
    problem = cuda_problem(CASES[9], torch.float16, seed=23)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    attn = problem.attention_weights.clone()
    attn[0, :300] *= 4.0
    value, shapes, starts, loc = problem.value, problem.spatial_shapes, problem.level_start_index, problem.sampling_locations
    exact_inputs = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    exact = gather_reference(exact_inputs[0], shapes, starts, exact_inputs[1], exact_inputs[2])
    grad_output = torch.randn(exact.shape, device="cuda", dtype=torch.float16)
    grad_output[0, 7] = float("nan")  # every head of one query
    grad_output[1, 400, 40] = float("inf")  # one channel of one head
    grad_output[1, 401, 100] = -float("inf")
    (want,) = torch.autograd.grad(exact, exact_inputs[0], grad_output.double())
    finite = torch.isfinite(want)
    assert (~finite).any() and finite.any()
    for config, name in mma_configs():
        got = torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, value, shapes, starts, loc, attn, "tma_ws", config, deterministic)[0]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(want)], want[torch.isinf(want)].half()), name
        check(got[finite], want[finite], f"{name} finite grad_value")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tma_ws_heads_outer_tile_order_against_float64(dtype):
    """A value of 61 MB (fp16) or 123 MB (fp32), past 3/4 of any Hopper L2: the tma_ws kernels walk
    their tiles heads outer (window_config.cpp, tile_order_heads_outer), forward and backward, with
    the default heuristic and the tuned configs, and the deterministic backward (bitwise the same
    twice). On a 300 x 400 level, float32 sampling geometry alone is about 1e-5 off: the bound is
    then twice that of a float64 computation on float32 geometry (the FA3 rule)."""
    problem = cuda_problem(("large_value", [(300, 400)], 1, 4096, 8, 32, 4, "uniform"), dtype, seed=41)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    assert problem.value.numel() * problem.value.element_size() > 60e6
    exact, grad_output, exact_grads, geometry32 = float64_answers(problem, dtype)
    value, shapes, starts, loc, attn = problem.args()
    output32 = gather_reference(value.double(), shapes, starts, loc.double(), attn.double(), coord_dtype=torch.float32)
    ops = torch.ops.mmdeform_tma
    default = (ops.ms_deform_attn_forward(*problem.args(), "tma_ws", -1),
               ops.ms_deform_attn_backward(grad_output, *problem.args(), "tma_ws", -1, False))
    deterministic = ops.ms_deform_attn_backward(grad_output, *problem.args(), "tma_ws", -1, True)
    again = ops.ms_deform_attn_backward(grad_output, *problem.args(), "tma_ws", -1, True)
    assert all(torch.equal(a, b) for a, b in zip(deterministic, again))
    problem.requires_grad_()
    out = mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend="tma_ws")
    tuned = (out, torch.autograd.grad(out, (problem.value, problem.sampling_locations, problem.attention_weights), grad_output))
    runs = (("default", default), ("tuned", tuned), ("deterministic", (default[0], deterministic)))
    for label, (out, grads) in runs:
        check(out, exact, f"{label} output", output32)
        for what, got, want, same_dtype in zip(("grad_value", "grad_locations", "grad_weights"), grads, exact_grads, geometry32):
            check(got, want, f"{label} {what}", same_dtype)


@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30], ids=["1e-30", "1", "1e30"])
def test_tma_ws_fp32_mma_backward_keeps_fp32_accuracy_at_any_gradient_scale(magnitude):
    """The fp32 MMA backward puts a tile's output-gradient rows on the tensor cores as fp16 hi + lo
    parts of the rows times a power of two: gradients far outside fp16's range, with rows that
    differ by up to 10^6 within a tile, stay within the fp32 rule, and a NaN or Inf row stays out
    of the scale and the product (it reaches exactly the reference's cells)."""
    problem = cuda_problem(CASES[9], torch.float32, seed=31)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    value, shapes, starts, loc, attn = problem.args()
    exact_inputs = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    exact = gather_reference(exact_inputs[0], shapes, starts, exact_inputs[1], exact_inputs[2])
    g = torch.Generator(device="cuda").manual_seed(37)
    spread = 10.0 ** torch.empty(exact.shape[:2] + (1,), device="cuda").uniform_(-3, 3, generator=g)
    grad_output = (torch.randn(exact.shape, device="cuda", generator=g) * spread * magnitude).float()
    grad_output[0, 5] = float("nan")
    grad_output[1, 600, 17] = float("inf")
    (want,) = torch.autograd.grad(exact, exact_inputs[0], grad_output.double())
    finite = torch.isfinite(want)
    assert (~finite).any() and finite.any()
    for config, name in mma_configs():
        for deterministic in (False, True):
            got = torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, value, shapes, starts, loc, attn, "tma_ws", config, deterministic)[0]
            assert torch.equal(torch.isnan(got), torch.isnan(want)), name
            assert torch.equal(torch.isinf(got), torch.isinf(want)), name
            err = rel_l2(got[finite], want[finite])
            assert err <= 1e-5, f"{name} deterministic={deterministic}: relative L2 error {err:.3e}"


def lean_forward_configs() -> list[tuple[int, str]]:
    return [(i, n) for i, n in enumerate(kernel_configs("tma_ws", "forward")) if re.fullmatch(r"c\d+_t\d+_s\d+_l1(_o\d+)?", n)]


# Decoders with more points a level than DETR's 4, where some `_l1` configs give each team one
# query slot (the half-precision one-slot kernel): 5 points (two pairs and one left over; uniform
# sampling puts points outside every level) and 8 (four pairs; 64-channel heads, four teams a warp).
MANY_POINT_DECODER_CASES = [
    ("decoder_p5", [(20, 30), (10, 15), (5, 8), (3, 4)], 2, 150, 8, 32, 5, "uniform"),
    ("decoder_p8_c64", [(13, 17), (7, 9), (4, 5)], 1, 70, 4, 64, 8, "local"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MANY_POINT_DECODER_CASES, ids=lambda c: c[0])
def test_tma_ws_lean_forward_configs_against_float64(case, dtype):
    """Every windowless forward config (`_l1`) against float64 on decoders of 5 and 8 points a level
    (the other cases have at most 4 where a config gives each team one slot)."""
    problem = cuda_problem(case, dtype, seed=37)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    assert len(lean_forward_configs()) >= 4
    check_forward_configs(problem, lean_forward_configs())


def check_forward_configs(problem, configs: list[tuple[int, str]]) -> None:
    """Each (index, name) tma_ws forward config through the op against the float64 reference."""
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in problem.args()])
    for config, name in configs:
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", config)
        check(out, exact, f"{name} output")


def window_forward_configs() -> list[tuple[int, str]]:
    return [(i, n) for i, n in enumerate(kernel_configs("tma_ws", "forward")) if re.fullmatch(r"c\d+_t\d+_s\d+_w\d+", n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", WINDOW_CASES + [CASES[11]], ids=lambda c: c[0])
def test_tma_ws_window_forward_configs_against_float64(case, dtype):
    """The window forward (`_w16` configs) in the dtypes the every-config test leaves out, on
    encoders (pixel blocks with windows), a decoder (strips) and 8-channel rows (16 bytes)."""
    problem = cuda_problem(case, dtype, seed=29)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    assert len(window_forward_configs()) >= 4
    check_forward_configs(problem, window_forward_configs())


def test_tma_ws_window_forward_non_finite_values():
    """A NaN or Inf in value reaches exactly the outputs the reference's does through every window
    forward, from inside a window (shared memory) as from outside it (global memory)."""
    problem = cuda_problem(CASES[9], torch.float16, seed=31)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    value = problem.value.clone()
    value[0, 100, 3] = float("nan")  # level 0, inside the encoder's windows
    value[1, 900, 5] = float("inf")
    value[1, 1140, 2] = -float("inf")  # the coarsest level
    args = (value, problem.spatial_shapes, problem.level_start_index, problem.sampling_locations, problem.attention_weights)
    expected = gather_reference(*[t.double() if t.is_floating_point() else t for t in args])
    finite = torch.isfinite(expected)
    assert (~finite).any() and finite.any()
    for config, name in window_forward_configs():
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*args, "tma_ws", config)
        assert torch.equal(torch.isnan(out), torch.isnan(expected)), name
        assert torch.equal(torch.isinf(out), torch.isinf(expected)), name
        check(out[finite], expected[finite], f"{name} finite output")


# Cases for the value gradient's layouts: a decoder (32 channels), 8-, 64- and 128-channel rows,
# and an encoder, where every cell is touched; these mark their levels whole. SPARSE_DECODER's two
# fine levels have more keys than a (batch, head) has corners there (160), so they are marked
# cell by cell where corners land; its two coarse levels are marked whole.
SPARSE_DECODER = ("sparse_decoder", [(64, 96), (32, 48), (8, 12), (4, 6)], 2, 20, 4, 32, 2, "local")
LAYOUT_CASES = [SPARSE_DECODER, CASES[0], CASES[11], CASES[3], CASES[4], CASES[9]]


def backward_with_layout(monkeypatch, layout, problem, grad_output, backend, deterministic):
    monkeypatch.setenv("MMDEFORM_TMA_GRAD_VALUE_LAYOUT", layout)
    return torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, *problem.args(), backend, -1, deterministic)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c[0])
def test_value_gradient_layouts_against_float64(monkeypatch, backend, dtype, case):
    """grad_value with its whole accumulator zeroed and with only the touched cells' rows zeroed
    (MMDEFORM_TMA_GRAD_VALUE_LAYOUT), fast and deterministic, against float64. The deterministic
    sums are the same integers in both layouts, so those two results are bitwise equal."""
    problem = cuda_problem(case, dtype, seed=37)
    skip_unless_supported(backend, validate(*problem.args()))
    _, grad_output, exact_grads, geometry32 = float64_answers(problem, dtype)
    deterministic_results = []
    for layout in ("dense", "touched"):
        for deterministic in (False, True):
            grads = backward_with_layout(monkeypatch, layout, problem, grad_output, backend, deterministic)
            for i, (what, got, want) in enumerate(zip(("grad_value", "grad_locations", "grad_weights"), grads, exact_grads)):
                assert got.dtype == problem.args()[(0, 3, 4)[i]].dtype
                check(got, want, f"{layout} deterministic={deterministic} {what}", geometry32[i] if i > 0 else None)
            if deterministic:
                deterministic_results.append(grads[0])
    assert torch.equal(deterministic_results[0], deterministic_results[1])


GRADIENT_NAMES = ("grad_value", "grad_locations", "grad_weights")
# The sorted deterministic backward on the layout cases, on 6- and 12-channel rows (one element per
# lane), and on 256-channel rows (a team of the whole warp, one warp's stage per block in fp32).
SORTED_CASES = [*LAYOUT_CASES, CASES[6], ("c12_sparse", [(9, 13), (5, 7)], 2, 40, 2, 12, 3, "local"), CASES[5]]


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SORTED_CASES, ids=lambda c: c[0])
def test_sorted_deterministic_backward_against_float64(monkeypatch, backend, dtype, case):
    """The deterministic backward with its value-gradient contributions sorted by cell
    (MMDEFORM_TMA_GRAD_VALUE_LAYOUT=sorted): all three gradients against float64, and bitwise the
    same on a second run."""
    problem = cuda_problem(case, dtype, seed=43)
    skip_unless_supported(backend, validate(*problem.args()))
    _, grad_output, exact_grads, geometry32 = float64_answers(problem, dtype)
    first = backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)
    for i, (what, got, want) in enumerate(zip(GRADIENT_NAMES, first, exact_grads)):
        assert got.dtype == problem.args()[(0, 3, 4)[i]].dtype
        check(got, want, f"sorted {what}", geometry32[i] if i > 0 else None)
    second = backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# Cases for the sorted backward's untouched rows. Where one block sorts each (batch, head, level)'s
# entries (queries x points x 4 corners, at most 14,848), grad_value is filled first, sparse or
# dense. Past that, cub sorts and dense problems (two corners per key or more) have their untouched
# rows zeroed where the chunk kernel finds them: 32-, 6- and 3-channel rows (16-, 4- and 2-byte
# stores in fp16), and full chunks of 32 entries (the last lane zeroes the cells after the last
# touched); 1,900 queries x 2 points (15,200 entries) over 6,000 keys is 2.5 corners per key.
DENSE_DECODER = ("dense_decoder", [(60, 100)], 2, 1900, 2, 32, 2, "local")
UNTOUCHED_CASES = [
    SPARSE_DECODER,
    ("wide_sparse_bs2", [(96, 128), (48, 64)], 2, 10, 2, 32, 1, "local"),
    ("dense_decoder_filled", [(16, 24), (8, 12)], 2, 100, 4, 32, 2, "local"),
    DENSE_DECODER,
    ("dense_c6", [(60, 100)], 2, 1900, 3, 6, 2, "local"),
    ("dense_c3", [(60, 100)], 2, 1900, 2, 3, 2, "local"),
    ("dense_full_chunks", [(60, 100)], 1, 3720, 1, 16, 1, "local"),
]
# Dense (10 corners per key) over 24,000 cells, runs of 15,200 entries: with every corner outside,
# one gap longer than a warp zeroes itself, listed in segments for the carry launch's blocks.
DENSE_WIDE_DECODER = ("dense_wide", [(40, 60), (20, 30)], 2, 1900, 4, 32, 2, "local")


def backward_over_poisoned_memory(monkeypatch, problem, grad_output, backend, layout="sorted"):
    """The deterministic backward right after a freed NaN block of grad_value's size, which the
    caching allocator hands to grad_value: a row the kernels leave unwritten stays NaN."""
    poison = [torch.full_like(problem.value, float("nan")) for _ in range(4)]
    del poison
    return backward_with_layout(monkeypatch, layout, problem, grad_output, backend, True)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", UNTOUCHED_CASES, ids=lambda c: c[0])
def test_sorted_backward_zeroes_every_untouched_row(monkeypatch, backend, dtype, case):
    """The sorted backward writes every row of grad_value, filled first or zeroed in place: the
    rows no corner touches are zero (exactly where float64's are), over memory that held NaN."""
    problem = cuda_problem(case, dtype, seed=79)
    skip_unless_supported(backend, validate(*problem.args()))
    _, grad_output, exact_grads, _ = float64_answers(problem, dtype)
    grad_value = backward_over_poisoned_memory(monkeypatch, problem, grad_output, backend)[0]
    untouched = (exact_grads[0] == 0).all(dim=-1)
    assert untouched.any() and not untouched.all(), case[0]
    assert torch.isfinite(grad_value).all()
    assert torch.equal(grad_value[untouched], torch.zeros_like(grad_value[untouched]))
    check(grad_value, exact_grads[0], "grad_value")


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_sorted_backward_with_every_corner_outside_is_zero(monkeypatch, backend):
    """No corner inside any level: every cell is one gap, listed in segments and zeroed by the
    carry launch's blocks; all three gradients are zero."""
    problem = cuda_problem(DENSE_WIDE_DECODER, torch.float32, seed=83)
    skip_unless_supported(backend, validate(*problem.args()))
    problem.sampling_locations.fill_(-3.0)
    grad_output = torch.randn(*problem.sampling_locations.shape[:2], problem.value.shape[2] * problem.value.shape[3],
                              device="cuda")
    grads = backward_over_poisoned_memory(monkeypatch, problem, grad_output, backend)
    for what, got in zip(GRADIENT_NAMES, grads):
        assert torch.equal(got, torch.zeros_like(got)), what


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=lambda c: c[0])
def test_sorted_backward_with_inconsistent_device_geometry(monkeypatch, backend, dtype, case):
    """Level shapes whose GPU copy disagrees with value (the point kernel's blocks check them):
    NaN coordinate gradients and a zero value gradient, over memory that held NaN, whether blocks
    sort the level runs (32 channels) or cub sorts the entries (6)."""
    problem = cuda_problem(case, dtype, seed=89)
    skip_unless_supported(backend, validate(*problem.args()))
    problem.spatial_shapes[0, 1] += 1
    grad_output = torch.randn(*problem.sampling_locations.shape[:2], problem.value.shape[2] * problem.value.shape[3],
                              device="cuda", dtype=dtype)
    grad_value, grad_locations, grad_weights = backward_over_poisoned_memory(monkeypatch, problem, grad_output, backend)
    assert torch.equal(grad_value, torch.zeros_like(grad_value))
    assert torch.isnan(grad_locations).all() and torch.isnan(grad_weights).all()


def cuda_kernel_names(fn) -> set[str]:
    """The CUDA kernels that fn() launched, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# 2^16 keys: 17 key bits beside the small block's 13 index bits.
WIDE_KEYS_DECODER = ("wide_keys_decoder", [(256, 256)], 2, 40, 2, 8, 2, "local")
# Level runs (queries x points x 4 corners) of 5,600 and 12,000 entries: the second and last of the
# sorting block's shapes (to 2,560, 5,632, 7,680, 10,752 and 14,848 entries).
LONG_RUN_DECODER = ("long_run_decoder", [(96, 128), (48, 64)], 2, 700, 2, 8, 2, "local")
LONGER_RUN_DECODER = ("longer_run_decoder", [(96, 128), (48, 64)], 1, 1500, 2, 8, 2, "local")
# Runs of 7,200 and 9,600 entries (the 15- and 21-key shapes) over levels shared by three blocks (36
# runs) and by four (12 runs), and DINO's decoder: 64 runs of 14,400, two blocks each.
FIFTEEN_KEY_DECODER = ("fifteen_key_decoder", [(40, 60), (20, 30), (10, 15)], 3, 900, 4, 32, 2, "local")
TWENTY_ONE_KEY_DECODER = ("twenty_one_key_decoder", [(96, 128), (48, 64), (24, 32)], 1, 1200, 4, 32, 2, "local")
DINO_DECODER = ("dino_decoder", [(100, 152), (50, 76), (25, 38), (13, 19)], 2, 900, 8, 32, 4, "local")
# Level runs of 16,000 entries, past the largest block: cub sorts (in place, at 67 corners per key).
IN_PLACE_DECODER = ("in_place_decoder", [(16, 24), (8, 12)], 1, 1000, 2, 8, 4, "local")
# 64 channels: teams of 8 lanes, 4 to a warp, sum a run's cells.
WIDE_HEAD_DECODER = ("wide_head_decoder", [(40, 60), (20, 30), (10, 15)], 2, 200, 2, 64, 4, "local")
# 256 channels: 400 queries' output-gradient rows (200-400 KB) exceed a block's shared memory and are
# read through L1; a whole warp sums each cell.
UNSTAGED_ROWS_DECODER = ("unstaged_rows_decoder", [(32, 48), (16, 24)], 1, 400, 2, 256, 2, "local")
# 6 channels: single-element lanes, which only cub's device sort serves.
ODD_CHANNELS_DECODER = ("odd_channels_decoder", [(20, 30), (10, 15)], 2, 50, 2, 6, 2, "local")


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case, sorts_level_runs",
    [
        (SPARSE_DECODER, True),
        (LONG_RUN_DECODER, True),
        (LONGER_RUN_DECODER, True),
        (FIFTEEN_KEY_DECODER, True),
        (TWENTY_ONE_KEY_DECODER, True),
        (DINO_DECODER, True),
        (WIDE_KEYS_DECODER, True),
        (WIDE_HEAD_DECODER, True),
        (UNSTAGED_ROWS_DECODER, True),
        (IN_PLACE_DECODER, False),
        (ODD_CHANNELS_DECODER, False),
    ],
    ids=lambda c: c[0] if isinstance(c, tuple) else str(c),
)
def test_sorted_backward_sorts_each_level_run_in_one_block(monkeypatch, backend, dtype, case, sorts_level_runs):
    """Where a (batch, head, level)'s entries fit a block and lanes take 8 elements, one launch sorts
    each level run and sums its cells (every block shape; 17 key bits; 8-64 channels; rows
    staged in shared memory or read through L1) in place of cub's device sort and the chunk sums,
    and the gradients match float64, bitwise the same on a second run; past the large block, or
    with single-element lanes, cub sorts."""
    problem = cuda_problem(case, dtype, seed=61)
    skip_unless_supported(backend, validate(*problem.args()))
    _, grad_output, exact_grads, geometry32 = float64_answers(problem, dtype)
    grads = []
    names = cuda_kernel_names(lambda: grads.append(backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)))
    if not names:
        pytest.skip("the CUDA profiler recorded no kernels (CUPTI unavailable, e.g. under compute-sanitizer)")
    assert any("sort_and_sum_level_runs_kernel" in n for n in names) == sorts_level_runs, sorted(names)
    assert any("DeviceRadixSort" in n for n in names) != sorts_level_runs, sorted(names)
    assert any("sorted_chunk_sums_kernel" in n for n in names) != sorts_level_runs, sorted(names)
    for i, (what, got, want) in enumerate(zip(GRADIENT_NAMES, grads[0], exact_grads)):
        check(got, want, f"sorted {what}", geometry32[i] if i > 0 else None)
    again = backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], again))


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sorted_backward_sums_cells_across_teams_and_blocks(monkeypatch, backend, dtype):
    """300 queries sample one point and 400 another, so each level run of 5,600 entries falls in
    eight cells of 600 or 800: cells span many teams' ranges and the even split of a run between
    the blocks that share it (up to four where the runs are fewer than the SMs). The gradients match
    float64, bitwise the same on a second run."""
    case = ("coincident_points", [(96, 128), (48, 64)], 2, 700, 2, 32, 2, "local")
    problem = cuda_problem(case, dtype, seed=71)
    skip_unless_supported(backend, validate(*problem.args()))
    locations = problem.sampling_locations
    locations[:, :300, ..., 0], locations[:, :300, ..., 1] = 0.37, 0.52
    locations[:, 300:, ..., 0], locations[:, 300:, ..., 1] = 0.611, 0.274
    _, grad_output, exact_grads, geometry32 = float64_answers(problem, dtype)
    grads = []
    names = cuda_kernel_names(lambda: grads.append(backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)))
    if names:  # empty where CUPTI is unavailable (compute-sanitizer)
        assert any("sort_and_sum_level_runs_kernel" in n for n in names), sorted(names)
    for i, (what, got, want) in enumerate(zip(GRADIENT_NAMES, grads[0], exact_grads)):
        check(got, want, f"coincident points {what}", geometry32[i] if i > 0 else None)
    again = backward_with_layout(monkeypatch, "sorted", problem, grad_output, backend, True)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], again))


# A sparse decoder over large levels: 30,720 keys x 8 heads, 0.02 corners per key, level runs of
# 320 entries (one block sorts each).
LARGE_SPARSE_DECODER = ("large_sparse_decoder", [(128, 192), (64, 96)], 5, 40, 8, 32, 2, "local")
# Level runs of 16,000 entries (2,000 queries x 2 points x 4 corners), past the large sorting block,
# over 24,576 keys (0.65 corners per key): 49 K cells at bs 1 x 2 heads, 1.18 M at bs 6 x 8 heads.
LONG_RUN_SPARSE = ("long_run_sparse", [(128, 192)], 1, 2000, 2, 8, 2, "local")
LONG_RUN_SPARSE_LARGE = ("long_run_sparse_large", [(128, 192)], 6, 2000, 8, 8, 2, "local")


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_fast_half_precision_backward_sorts_sparse_problems(monkeypatch, backend):
    """`auto` gives the fast backward the sorted layout where half-precision values are sparse and
    blocks sort the level runs (the kernels that ran say which layout it took); its gradients match
    float64 and the deterministic backward's bit for bit. Runs past the block sort with cub from 2^20
    cells and keep the touched cells below; up to four corners per key, blocks sort from 2^17 cells.
    fp32 values sort where sparse runs are short, or up to four corners per key over 32 runs or
    more, and keep the dense accumulator for a few long runs."""
    problem = cuda_problem(LARGE_SPARSE_DECODER, torch.float16, seed=59)
    skip_unless_supported(backend, validate(*problem.args()))
    _, grad_output, exact_grads, geometry32 = float64_answers(problem, torch.float16)
    grads = None

    def fast_backward(p, go):
        nonlocal grads
        grads = backward_with_layout(monkeypatch, "auto", p, go, backend, False)

    names = cuda_kernel_names(lambda: fast_backward(problem, grad_output))
    if not names:  # the backward always launches kernels: the profiler cannot see them
        pytest.skip("the CUDA profiler recorded no kernels (CUPTI unavailable, e.g. under compute-sanitizer)")
    assert any("sort_and_sum_level_runs_kernel" in n for n in names), sorted(names)
    assert not any("touched" in n for n in names), sorted(names)
    for i, (what, got, want) in enumerate(zip(GRADIENT_NAMES, grads, exact_grads)):
        check(got, want, f"fast sorted {what}", geometry32[i] if i > 0 else None)
    deterministic = backward_with_layout(monkeypatch, "auto", problem, grad_output, backend, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, deterministic))

    def kernels_of(case, dtype):
        p = cuda_problem(case, dtype, seed=59)
        go = torch.randn(*p.sampling_locations.shape[:2], p.value.shape[2] * p.value.shape[3], device="cuda", dtype=dtype)
        return cuda_kernel_names(lambda: fast_backward(p, go))

    names = kernels_of(LONG_RUN_SPARSE, torch.float16)
    assert not any("sorted_" in n for n in names) and any("touched" in n for n in names), sorted(names)
    names = kernels_of(LONG_RUN_SPARSE_LARGE, torch.bfloat16)
    assert any("DeviceRadixSort" in n for n in names) and not any("touched" in n for n in names), sorted(names)
    denser = ("denser_decoder", [(64, 96), (32, 48)], 5, 1000, 8, 32, 2, "local")  # 2.1 corners per key, 307 K cells
    names = kernels_of(denser, torch.float16)
    assert any("sort_and_sum_level_runs_kernel" in n for n in names) and not any("touched" in n for n in names), sorted(names)
    names = kernels_of(denser[:2] + (1,) + denser[3:], torch.bfloat16)  # 61 K cells: the dense buffer
    assert not any("sorted_" in n or "touched" in n for n in names), sorted(names)
    names = kernels_of(LARGE_SPARSE_DECODER, torch.float32)  # runs of 320 entries
    assert any("sort_and_sum_level_runs_kernel" in n for n in names), sorted(names)
    names = kernels_of(SPARSE_DECODER, torch.float32)  # runs of 160 entries
    assert any("sort_and_sum_level_runs_kernel" in n for n in names), sorted(names)
    few_long_runs = ("few_long_runs", [(128, 192), (64, 96)], 1, 900, 2, 32, 4, "local")  # 4 runs of 14,400
    names = kernels_of(few_long_runs, torch.float32)
    assert not any("sorted_" in n for n in names), sorted(names)
    names = kernels_of(DINO_DECODER, torch.float32)  # 2.85 corners per key, 64 runs of 14,400
    assert any("sort_and_sum_level_runs_kernel" in n for n in names), sorted(names)


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize(
    "case, dtype, deterministic",
    [(SPARSE_DECODER, torch.float16, False), (LONG_RUN_DECODER, torch.float32, True), (DENSE_DECODER, torch.bfloat16, True)],
    ids=["fast_fp16_block_sort", "deterministic_fp32_block_sort", "deterministic_bf16_cub_in_place"],
)
def test_sorted_backward_in_cuda_graph_replays(monkeypatch, backend, case, dtype, deterministic):
    """The sorted backward inside a CUDA graph (the block sort and sums with the fill, and cub's sort
    with the untouched rows zeroed in place, whose gap count the point kernel resets on every
    launch): replayed twice over NaN-filled outputs, it gives the eager gradients bit for bit."""
    problem = cuda_problem(case, dtype, seed=67)
    skip_unless_supported(backend, validate(*problem.args()))
    monkeypatch.setenv("MMDEFORM_TMA_GRAD_VALUE_LAYOUT", "auto")
    grad_output = torch.randn(*problem.sampling_locations.shape[:2], problem.value.shape[2] * problem.value.shape[3],
                              device="cuda", dtype=dtype)
    args = problem.args()

    def backward():
        return torch.ops.mmdeform_tma.ms_deform_attn_backward(grad_output, *args, backend, -1, deterministic)

    names = cuda_kernel_names(backward)
    if not names:
        pytest.skip("the CUDA profiler recorded no kernels (CUPTI unavailable, e.g. under compute-sanitizer)")
    block_sort = case is not DENSE_DECODER
    assert any("sort_and_sum_level_runs_kernel" in n for n in names) == block_sort, sorted(names)
    assert any("sorted_chunk_sums_kernel" in n for n in names) != block_sort, sorted(names)
    eager = backward()
    for captured in cuda_graph_replays(backward):
        for what, got, want in zip(GRADIENT_NAMES, captured, eager):
            assert torch.equal(got, want), what


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_auto_sorts_the_deterministic_backward_of_sparse_problems_only(monkeypatch, backend):
    """`auto` sorts the deterministic backward of a decoder (0.08 corners per key), bitwise the
    forced sorted result and not the fixed-point one, and keeps fixed point for an encoder (as many
    queries as keys) and for cross-attention past 64 corners per key (5 levels x 8 points)."""
    dense_cross = ("dense_cross_attention", [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)], 1, 300, 2, 32, 8, "local")
    cases = ((SPARSE_DECODER, "sorted", "dense"), (CASES[9], "dense", "sorted"), (dense_cross, "dense", "sorted"))
    for case, expected, other in cases:
        problem = cuda_problem(case, torch.float32, seed=47)
        skip_unless_supported(backend, validate(*problem.args()))
        grad_output = torch.randn(*problem.sampling_locations.shape[:2], problem.value.shape[2] * problem.value.shape[3], device="cuda")
        chosen = backward_with_layout(monkeypatch, "auto", problem, grad_output, backend, True)[0]
        assert torch.equal(chosen, backward_with_layout(monkeypatch, expected, problem, grad_output, backend, True)[0]), case[0]
        assert not torch.equal(chosen, backward_with_layout(monkeypatch, other, problem, grad_output, backend, True)[0]), case[0]


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
@pytest.mark.parametrize("layout", ["touched", "sorted"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_sparse_layouts_carry_non_finite_gradients(monkeypatch, backend, layout, deterministic):
    """A NaN or Inf in grad_output reaches exactly the value cells the reference's does when only
    the touched cells' rows are zeroed, or the contributions are sorted by cell (deterministic only;
    the fast backward keeps its automatic layout there); every other cell is exactly zero."""
    problem = cuda_problem(SPARSE_DECODER, torch.float16, seed=41)
    skip_unless_supported(backend, validate(*problem.args()))
    value, shapes, starts, loc, attn = problem.args()
    exact_inputs = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    exact = gather_reference(exact_inputs[0], shapes, starts, exact_inputs[1], exact_inputs[2])
    grad_output = torch.randn(exact.shape, device="cuda", dtype=torch.float16)
    grad_output[0, 7] = float("nan")
    grad_output[1, 10, 40] = float("inf")
    grad_output[1, 11, 100] = -float("inf")
    (want,) = torch.autograd.grad(exact, exact_inputs[0], grad_output.double())
    got = backward_with_layout(monkeypatch, layout, problem, grad_output, backend, deterministic)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(want)], want[torch.isinf(want)].half())
    finite = torch.isfinite(want)
    check(got[finite], want[finite], "finite grad_value")
    assert torch.equal(got[want == 0], torch.zeros_like(got[want == 0]))


def test_value_gradient_layout_names_what_it_cannot_do(monkeypatch):
    """Forcing touched cells or sorted contributions where they cannot run raises with the reason,
    as does an unknown layout; `auto` runs."""
    if reason := backend_skip_reason("cuda"):
        pytest.skip(reason)
    problem = cuda_problem(CASES[6], torch.float16)  # 6 channels per head
    grad_output = torch.randn(problem.value.shape[0], problem.sampling_locations.shape[1], 18, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"touched: channels per head \(6\) is not a multiple of 8"):
        backward_with_layout(monkeypatch, "touched", problem, grad_output, "cuda", False)
    with pytest.raises(RuntimeError, match="is 'dense', 'touched', 'sorted' or 'auto', not 'sparse'"):
        backward_with_layout(monkeypatch, "sparse", problem, grad_output, "cuda", False)
    # 36 channels are not whole 8-element lanes: one element per lane, 32 at most.
    wide = cuda_problem(("c36", [(6, 7), (3, 4)], 2, 30, 1, 36, 2, "uniform"), torch.float32)
    wide_grad = torch.randn(*wide.sampling_locations.shape[:2], 36, device="cuda")
    with pytest.raises(RuntimeError, match=r"sorted: channels per head \(36\) exceed a warp's one vector per lane \(32\)"):
        backward_with_layout(monkeypatch, "sorted", wide, wide_grad, "cuda", True)
    grads = backward_with_layout(monkeypatch, "auto", problem, grad_output, "cuda", False)
    assert grads[0].shape == problem.value.shape


# Encoder self-attention (one query per key) of 32-channel heads for the region forward (`rg_*`):
# DETR-like levels; 8 points and 5 levels; 2 levels of odd sizes whose regions are cut at the
# edges; three levels, the second larger than the first (regions of more than 192 queries in
# passes, between which the odd level count moves a level to the other buffer; windows wider than
# the widest box); uniform sampling over levels about the size of a window (points inside and outside
# their windows, the latter summed from global memory); and uniform sampling over a first level
# several windows wide (most points outside their windows: the case for the `c2_t16_s3_l1` fallback,
# correct whichever kernel writes the output).
REGION_CASES = [
    CASES[9],
    ("encoder_p8_five_levels", [(16, 40), (8, 20), (4, 10), (2, 5), (1, 3)], 1, 853, 4, 32, 8, "encoder"),
    ("encoder_odd_two_levels", [(19, 37), (7, 11)], 2, 780, 2, 32, 4, "encoder"),
    ("encoder_large_second_level", [(9, 17), (30, 40), (5, 6)], 1, 1383, 3, 32, 4, "encoder"),
    ("encoder_uniform_three_levels", [(17, 33), (9, 17), (5, 9)], 2, 759, 2, 32, 4, "uniform"),
    ("encoder_uniform_fallback", [(48, 64), (24, 32), (12, 16)], 1, 4032, 2, 32, 4, "uniform"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", REGION_CASES, ids=lambda c: c[0])
def test_tma_ws_region_forward_against_float64(case, dtype):
    """Every region forward config (`rg_*`) against float64 (at most 1.5x the output's rounding error)."""
    problem = cuda_problem(case, dtype, seed=53)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    assert len(region_forward_configs()) >= 1
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in problem.args()])
    names = kernel_configs("tma_ws", "forward")
    for name in region_forward_configs():
        out = torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", names.index(name))
        check(out, exact, f"{name} output")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", REGION_CASES[:4] + REGION_CASES[5:], ids=lambda c: c[0])
def test_tma_ws_region_kernel_alone(case, dtype):
    """The region kernel without its fallback (a test hook): on encoder sampling it leaves the spread
    flag clear and writes every output itself, within the accuracy rule; on uniform sampling over a
    level several windows wide it sets the flag. The configs' own output cannot show either: the
    fallback after the kernel writes every row once the flag is set."""
    problem = cuda_problem(case, dtype, seed=59)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    local = case[-1] == "encoder"
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in problem.args()])
    for name in region_forward_configs():
        out, spread = extension()._region_forward_alone(*problem.args(), name)
        assert spread.item() == (0 if local else 1), f"{name}: spread flag {spread.item()}"
        if local:
            check(out, exact, f"{name} alone")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tma_ws_region_forward_non_finite_inputs(dtype):
    """NaN and +-Inf in value (inside windows and outside them), in the weights (of points inside and
    outside their level) and in the locations reach exactly the outputs the reference's do: the
    tensor-core sums of a pair of queries would spread one query's NaN to the other."""
    problem = cuda_problem(CASES[9], dtype, seed=61)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    value = problem.value.clone()
    value[0, 100, 3] = float("nan")
    value[1, 300, 5] = float("inf")
    value[1, 1140, 2] = -float("inf")  # the coarsest level
    weights = problem.attention_weights.clone()
    loc = problem.sampling_locations.clone()
    weights[0, 7, 1, 0, 2] = float("nan")
    weights[1, 9, 4, 2, 1] = float("inf")
    weights[1, 500, 6, 1, 3] = float("inf")
    loc[1, 500, 6, 1, 3] = 5.0  # outside its level: Inf x 0 is NaN in the reference
    loc[0, 3, 0, 1, 0] = float("nan")
    loc[1, 4, 2, 0, 3] = float("inf")
    check_non_finite_propagation((value, problem.spatial_shapes, problem.level_start_index, loc, weights),
                                 region_forward_configs())


@pytest.mark.parametrize("case", [CASES[0], CASES[10], CASES[11], ("encoder_one_level", [(12, 20)], 2, 240, 2, 32, 4, "encoder")],
                         ids=lambda c: c[0])
def test_tma_ws_region_forward_refuses_what_it_cannot_run(case):
    """A decoder, 64- and 8-channel heads and a single level raise the config's reason."""
    problem = cuda_problem(case, torch.float16, seed=71)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    names = kernel_configs("tma_ws", "forward")
    for name in region_forward_configs():
        reason = region_forward_reason(name, problem)
        assert reason is not None
        with pytest.raises(RuntimeError, match=reason):
            torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", names.index(name))


def test_tma_ws_region_forward_in_cuda_graph_replays():
    """Replayed twice over NaN-filled outputs, the region forward writes every row: its plan is computed
    on the device, nothing of it cached on the host between calls."""
    problem = cuda_problem(REGION_CASES[1], torch.bfloat16, seed=73)
    skip_unless_supported("tma_ws", validate(*problem.args()))
    exact = gather_reference(*[t.double() if t.is_floating_point() else t for t in problem.args()])
    names = kernel_configs("tma_ws", "forward")
    for name in region_forward_configs():
        def call(name=name):
            return (torch.ops.mmdeform_tma.ms_deform_attn_forward(*problem.args(), "tma_ws", names.index(name)),)

        for (got,) in cuda_graph_replays(call):
            check(got, exact, f"{name} replay")
