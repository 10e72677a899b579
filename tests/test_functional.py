"""The public call's host side: plans cached per call signature, no host synchronisation."""

import gc
import weakref

import pytest
import torch

import mmdeform_tma
from mmdeform_tma import dispatch, library
from mmdeform_tma.backends import BACKENDS
from mmdeform_tma.backends import base as backend_base
from mmdeform_tma.backends.mmcv import _mmcv_unavailable_reason
from mmdeform_tma.inputs import validate
from mmdeform_tma.reference import ms_deform_attn_reference
from fake_gpu import CUDA, HostSync, cuda_like, on_cuda, pretend_gpu
from msda_cases import make_problem


@pytest.fixture(autouse=True)
def fresh_caches():
    dispatch.clear_caches()
    yield
    dispatch.clear_caches()


@pytest.fixture
def problem(generator):
    return make_problem([(4, 3), (2, 2)], batch=2, queries=3, heads=2, channels=4, points=2, dtype=torch.float32, generator=generator)


@pytest.fixture
def plans(monkeypatch):
    """Counts the calls that had to be planned (cache misses)."""
    made = []
    plan = dispatch.plan

    def counting(*args, **kwargs):
        made.append(args[0])
        return plan(*args, **kwargs)

    monkeypatch.setattr(dispatch, "plan", counting)
    return made


def call(problem, backend="pytorch", **replace):
    args = dict(zip(("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"), problem.args()))
    args.update(replace)
    return mmdeform_tma.multi_scale_deformable_attn(**args, backend=backend)


def test_a_repeated_call_is_planned_once(problem, plans):
    expected = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    for _ in range(3):
        torch.testing.assert_close(call(problem), expected)
    assert len(plans) == 1 and len(dispatch.PLANS) == 1


@pytest.mark.parametrize(
    "change",
    [
        "queries", "dtype", "requires_grad", "backend", "deterministic", "strict", "shape_values", "start_values",
        "geometry_contiguity",
    ],
)
def test_a_changed_signature_is_planned_again(problem, plans, change):
    call(problem)
    replace, backend = {}, "pytorch"
    if change == "queries":
        replace = dict(sampling_locations=problem.sampling_locations[:, :2], attention_weights=problem.attention_weights[:, :2])
    elif change == "dtype":
        replace = dict(value=problem.value.double())
    elif change == "requires_grad":
        replace = dict(value=problem.value.detach().requires_grad_())
    elif change == "backend":
        backend = "auto"
    elif change == "deterministic":
        torch.use_deterministic_algorithms(True)
    elif change == "strict":
        mmdeform_tma.set_strict_validation(True)
    elif change == "shape_values":  # same shapes and dtypes, other level sizes (still 16 keys)
        replace = dict(spatial_shapes=torch.tensor([[3, 4], [2, 2]]))
    elif change == "start_values":  # values are checked when planned: a wrong one raises
        with pytest.raises(ValueError, match="does not match spatial_shapes"):
            call(problem, level_start_index=torch.tensor([0, 13]))
        assert len(plans) == 2 and len(dispatch.PLANS) == 1
        return
    elif change == "geometry_contiguity":  # contiguity is no part of a signature: the op copies
        replace = dict(spatial_shapes=problem.spatial_shapes.t().contiguous().t())
        call(problem, **replace)
        assert len(plans) == 1
        return
    call(problem, backend=backend, **replace)
    assert len(plans) == 2 and len(dispatch.PLANS) == 2


def test_grad_mode_is_part_of_the_signature(problem, plans):
    problem.value.requires_grad_()
    with torch.no_grad():
        call(problem)
    call(problem).sum().backward()
    assert len(plans) == 2 and problem.value.grad is not None


def test_invalid_inputs_are_never_cached(problem, plans):
    for _ in range(2):
        with pytest.raises(TypeError, match="value must be a torch.Tensor"):
            call(problem, value=problem.value.tolist())
        with pytest.raises(ValueError, match="cover 16 keys .* num_keys = 15"):
            call(problem, value=problem.value[:, :15])
    assert not dispatch.PLANS


def test_a_plan_holds_no_input_tensor(problem):
    call(problem)
    value = weakref.ref(problem.value)
    del problem.value
    gc.collect()
    assert value() is None


def test_plans_are_bounded(problem, plans, monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_PLANS", 2)
    for queries in (3, 2, 1):
        call(problem, sampling_locations=problem.sampling_locations[:, :queries], attention_weights=problem.attention_weights[:, :queries])
    assert len(dispatch.PLANS) == 1  # full at the third: started again
    call(problem)
    assert len(plans) == 4 and len(dispatch.PLANS) == 2


def test_an_unhashable_backend_name_gets_the_usual_error(problem):
    with pytest.raises(ValueError, match=r"unknown backend \['cuda'\]; valid names: auto"):
        call(problem, backend=["cuda"])


def test_device_copies_of_cpu_geometry_are_made_once_per_device_and_values():
    shapes = torch.tensor([[4, 3], [2, 2]])
    meta = torch.device("meta")
    copy = backend_base.device_copy(shapes, meta)
    assert copy.device == meta and copy.shape == shapes.shape and copy.dtype == torch.long
    assert backend_base.device_copy(shapes.clone(), meta) is copy
    assert backend_base.device_copy(torch.tensor([[3, 4], [2, 2]]), meta) is not copy
    assert backend_base.device_copy(torch.tensor([[4, 3], [2, 2]], dtype=torch.int32), meta).dtype == torch.int32
    with torch.inference_mode():
        fresh = backend_base.device_copy(torch.tensor([[5, 5]]), meta)
    assert not fresh.is_inference()  # reusable where a backward saves it
    on_meta = backend_base.on_device(shapes, meta)
    assert on_meta(shapes) is copy and on_meta(torch.zeros(0)) is copy
    assert backend_base.on_device(copy, meta)(copy) is copy


def test_compiled_launcher_binds_configs_backward_and_device_copies(problem, monkeypatch):
    calls = []
    monkeypatch.setattr(library, "forward_op", lambda: lambda *args: calls.append(args))
    value, shapes, starts, loc, attn = problem.args()
    meta = [t.to("meta") for t in (value, loc, attn)]
    inputs = validate(meta[0], shapes, starts, meta[1], meta[2])
    for _ in range(2):
        launch = BACKENDS["cuda"].launcher(inputs, BACKENDS["tma_ws"])
        launch(meta[0], shapes, starts, meta[1], meta[2])
    first, second = calls
    assert first[5:] == ("cuda", -1, "tma_ws", -1)
    assert first[1].device.type == "meta" and first[1] is second[1] and first[2] is second[2]


class TestNoHostSync:
    """The public call on CUDA-like inputs reads no device data on the host, planning or cached."""

    @pytest.fixture(autouse=True)
    def gpu(self, monkeypatch):
        pretend_gpu(monkeypatch)

    @staticmethod
    def gpu_problem(generator, dtype=torch.float16):
        return make_problem([(6, 5), (3, 3)], batch=2, queries=7, heads=2, channels=32, points=2, dtype=dtype, generator=generator)

    @pytest.mark.parametrize("backend", ["auto", "cuda", "tma_ws", "mmcv"])
    @pytest.mark.parametrize("geometry", ["cuda", "cpu"])
    def test_public_call(self, generator, backend, geometry):
        # `pytorch` is left out: the reference reads GPU-resident level shapes by design.
        if backend == "mmcv" and _mmcv_unavailable_reason():
            pytest.skip(_mmcv_unavailable_reason())
        p = self.gpu_problem(generator)
        with cuda_like():
            value, shapes, starts, loc, attn = on_cuda(*p.args())
            if geometry == "cpu":
                shapes, starts = p.spatial_shapes, p.level_start_index
            for _ in range(3):  # the planning call, then cached ones
                out = mmdeform_tma.multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend=backend)
            assert out.device == CUDA and out.shape == (2, 7, 64) and out.dtype == torch.float16
        assert len(dispatch.PLANS) == 1

    @pytest.mark.parametrize("backend", ["auto", "cuda", "tma_ws"])
    def test_planning_a_training_call(self, generator, backend):
        """With a backward to choose too; the launch itself is left out (see fake_gpu)."""
        p = self.gpu_problem(generator)
        with cuda_like():
            value, shapes, starts, loc, attn = on_cuda(*p.args())
            launch = dispatch.plan(backend, value.requires_grad_(), shapes, starts, loc.requires_grad_(), attn)
        assert callable(launch)

    def test_it_fails_on_a_planted_sync(self, generator, monkeypatch):
        p = self.gpu_problem(generator)
        validate_ = dispatch.validate
        monkeypatch.setattr(dispatch, "validate", lambda *args: (args[1].tolist(), validate_(*args))[1])
        with cuda_like(), pytest.raises(HostSync, match="cuda:0 tensor"):
            mmdeform_tma.multi_scale_deformable_attn(*on_cuda(*p.args()), backend="cuda")

    def test_it_fails_on_a_planted_sync_in_a_cached_call(self, generator, monkeypatch):
        p = self.gpu_problem(generator)
        signature = dispatch.signature
        with cuda_like():
            args = on_cuda(*p.args())
            mmdeform_tma.multi_scale_deformable_attn(*args, backend="cuda")
            monkeypatch.setattr(dispatch, "signature", lambda *a: (bool(a[3].max()), signature(*a))[1])
            with pytest.raises(HostSync, match="cuda:0 tensor"):
                mmdeform_tma.multi_scale_deformable_attn(*args, backend="cuda")

    def test_strict_mode_reads_gpu_geometry_on_every_call(self, generator, monkeypatch):
        """Strict mode synchronises by design; a plan made without it must not skip its check."""
        p = self.gpu_problem(generator)
        checks = []
        monkeypatch.setattr(dispatch, "check_level_geometry", lambda *args: checks.append(args))
        with cuda_like():
            args = on_cuda(*p.args())
            mmdeform_tma.multi_scale_deformable_attn(*args, backend="cuda")
            with mmdeform_tma.strict_validation_enabled(True):
                with pytest.raises(HostSync):  # validation reads the values when planning
                    mmdeform_tma.multi_scale_deformable_attn(*args, backend="cuda")
                monkeypatch.setattr("mmdeform_tma.inputs.check_level_geometry", lambda *args: checks.append(args))
                for _ in range(3):
                    mmdeform_tma.multi_scale_deformable_attn(*args, backend="cuda")
        assert len(checks) == 2 + 2  # planning: validation and the plan's check; then two cached calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("geometry", ["cuda", "cpu"])
def test_no_host_sync_on_a_gpu(generator, geometry):
    """The same on a GPU, with PyTorch's own detector: forward and backward, planning and cached."""
    reasons = BACKENDS["cuda"].not_supported_reasons(validate(*make_problem([(2, 2)], channels=32).to("cuda").args()))
    if reasons:
        pytest.skip("; ".join(reasons))
    p = make_problem([(6, 5), (3, 3)], batch=2, queries=7, heads=2, channels=32, dtype=torch.float16, generator=generator).to("cuda")
    shapes, starts = (p.spatial_shapes, p.level_start_index) if geometry == "cuda" else (p.spatial_shapes.cpu(), p.level_start_index.cpu())
    p.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for backend in ("auto", "cuda"):
            for _ in range(2):
                out = mmdeform_tma.multi_scale_deformable_attn(p.value, shapes, starts, p.sampling_locations, p.attention_weights, backend=backend)
                out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(p.value.grad).all()
