"""The torch.library ops: schema, CPU kernel (the reference), fake kernels, autograd, compile."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mmdeform_tma
from mmdeform_tma import library
from mmdeform_tma.reference import ms_deform_attn_reference
from msda_cases import make_problem, rel_l2

ops = torch.ops.mmdeform_tma
needs_extension = pytest.mark.skipif(not library.OPS_LOADED, reason="mmdeform_tma._C is not built here")


@pytest.fixture
def problem(generator):
    p = make_problem([(4, 3), (2, 2)], batch=2, queries=3, heads=2, channels=4, points=2, generator=generator)
    p.sampling_locations = p.sampling_locations.clamp(-0.2, 1.2) + 1e-3  # off pixel boundaries for gradcheck
    return p


@needs_extension
def test_schema():
    fwd = str(ops.ms_deform_attn_forward.default._schema)
    bwd = str(ops.ms_deform_attn_backward.default._schema)
    assert fwd.startswith("mmdeform_tma::ms_deform_attn_forward(Tensor value, Tensor spatial_shapes")
    assert "str backend, int config, str? backward_backend=None, int backward_config=-1) -> Tensor" in fwd
    assert "bool deterministic) -> (Tensor, Tensor, Tensor)" in bwd


@needs_extension
def test_autograd_is_registered_in_cpp():
    for op in ("ms_deform_attn_forward", "ms_deform_attn_backward"):
        autograd = [line for line in torch._C._dispatch_dump(f"mmdeform_tma::{op}").splitlines() if line.startswith("Autograd")]
        assert len(autograd) == 1 and "csrc/autograd.cpp" in autograd[0], autograd  # no Python autograd.Function


class RecordBackward(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ops.ms_deform_attn_backward.default:
            self.calls.append(args[6:])
        return func(*args, **(kwargs or {}))


@needs_extension
def test_backward_runs_the_backend_and_config_the_forward_carried(problem):
    problem.requires_grad_()
    out = ops.ms_deform_attn_forward(*problem.args(), "pytorch", 3, "pytorch", 7)
    torch.use_deterministic_algorithms(True)  # read when the backward runs, not when the forward did
    with RecordBackward() as recorder:
        out.sum().backward()
    assert recorder.calls == [("pytorch", 7, True)]
    out = ops.ms_deform_attn_forward(*problem.args(), "pytorch", 3)  # no backward choice: the forward's, heuristic config
    torch.use_deterministic_algorithms(False)
    with RecordBackward() as recorder:
        out.sum().backward()
    assert recorder.calls == [("pytorch", -1, False)]


@needs_extension
def test_non_contiguous_inputs_get_contiguous_gradients(problem):
    problem.requires_grad_()
    value = problem.value.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not value.is_contiguous()
    args = (value, *problem.args()[1:])
    grad = torch.autograd.grad(ops.ms_deform_attn_forward(*args, "pytorch", -1).sum(), value)[0]
    want = torch.autograd.grad(ops.ms_deform_attn_forward(*problem.args(), "pytorch", -1).sum(), problem.value)[0]
    torch.testing.assert_close(grad, want)


@needs_extension
def test_double_backward_raises(problem):
    problem.requires_grad_()
    out = ops.ms_deform_attn_forward(*problem.args(), "pytorch", -1)
    (grad_value,) = torch.autograd.grad(out.sum(), problem.value, create_graph=True)
    with pytest.raises(RuntimeError, match="not implemented"):
        grad_value.sum().backward()


@needs_extension
def test_cpu_kernel_refuses_a_cuda_backward(problem):
    with pytest.raises(RuntimeError, match="backend 'cuda' runs on CUDA"):
        ops.ms_deform_attn_forward(*problem.args(), "pytorch", -1, "cuda", -1)


@needs_extension
def test_cpu_kernel_is_the_reference(problem):
    out = ops.ms_deform_attn_forward(*problem.args(), "pytorch", -1)
    expected = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    assert rel_l2(out, expected) == 0.0


@needs_extension
def test_cpu_kernel_refuses_cuda_backends(problem):
    with pytest.raises(RuntimeError, match="backend 'tma_ws' runs on CUDA"):
        ops.ms_deform_attn_forward(*problem.args(), "tma_ws", -1)


@needs_extension
@pytest.mark.parametrize("backward", [(), ("pytorch", 2)])
def test_opcheck_forward(problem, backward):
    problem.requires_grad_()
    torch.library.opcheck(ops.ms_deform_attn_forward.default, (*problem.args(), "pytorch", -1, *backward))


@needs_extension
def test_opcheck_backward(problem):
    grad = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.library.opcheck(ops.ms_deform_attn_backward.default, (grad, *problem.args(), "pytorch", -1, False))


@needs_extension
def test_autograd_through_the_op_matches_reference(problem):
    problem.requires_grad_()
    grad = torch.randn(2, 3, 8, dtype=torch.float64)
    out = ops.ms_deform_attn_forward(*problem.args(), "pytorch", -1)
    got = torch.autograd.grad(out, (problem.value, problem.sampling_locations, problem.attention_weights), grad)
    ref = ms_deform_attn_reference(problem.value, problem.spatial_shapes, problem.sampling_locations, problem.attention_weights)
    want = torch.autograd.grad(ref, (problem.value, problem.sampling_locations, problem.attention_weights), grad)
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-12


@needs_extension
def test_gradcheck_through_the_op(problem):
    problem.requires_grad_()
    fn = lambda v, loc, attn: ops.ms_deform_attn_forward(v, problem.spatial_shapes, problem.level_start_index, loc, attn, "pytorch", -1)
    assert torch.autograd.gradcheck(fn, (problem.value, problem.sampling_locations, problem.attention_weights), eps=1e-6, atol=1e-7)


@needs_extension
def test_fake_tensor_shapes(problem):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in problem.args()]
        out = ops.ms_deform_attn_forward(*fake, "tma_ws", -1)
        grads = ops.ms_deform_attn_backward(torch.empty(2, 3, 8, dtype=torch.float64), *fake, "tma_ws", 3, True)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float64
    assert [g.shape for g in grads] == [t.shape for t in (problem.value, problem.sampling_locations, problem.attention_weights)]


@needs_extension
def test_torch_compile_fullgraph(problem):
    torch._dynamo.reset()

    def fn(value, spatial_shapes, level_start_index, loc, attn):
        return ops.ms_deform_attn_forward(value, spatial_shapes, level_start_index, loc, attn, "pytorch", -1) * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*problem.args()), fn(*problem.args()))


@needs_extension
def test_torch_compile_fullgraph_with_backward(problem):
    """AOTAutograd traces the C++ autograd: forward and backward ops in the graphs."""
    torch._dynamo.reset()

    def fn(value, spatial_shapes, level_start_index, loc, attn):
        return ops.ms_deform_attn_forward(value, spatial_shapes, level_start_index, loc, attn, "pytorch", -1, "pytorch", -1)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    problem.requires_grad_()
    got = torch.autograd.grad(compiled(*problem.args()).sum(), (problem.value, problem.sampling_locations, problem.attention_weights))
    want = torch.autograd.grad(fn(*problem.args()).sum(), (problem.value, problem.sampling_locations, problem.attention_weights))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_torch_compile_functional_api_fullgraph(problem):
    torch._dynamo.reset()

    def fn(value, spatial_shapes, level_start_index, loc, attn):
        return mmdeform_tma.multi_scale_deformable_attn(value, spatial_shapes, level_start_index, loc, attn, backend="pytorch")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    problem.requires_grad_()
    out = compiled(*problem.args())
    torch.testing.assert_close(out, fn(*problem.args()))
    out.sum().backward()
    assert problem.value.grad is not None
