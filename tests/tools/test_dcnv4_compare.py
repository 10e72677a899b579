"""`benchmark_op.py --compare dcnv4` on the CPU, against a pure-PyTorch emulation of DCNv4's FlashDeformAttn.

The emulation follows DCNv4 1.0.0.post2's CUDA kernel (`flash_deform_im2col_cuda.cuh`) independently of
the tools' packing code: per (batch, query, head) the levels x K (x, y) pairs, then levels x K logits,
softmax over all of them, pixel = loc * size - 0.5, sampled when strictly inside (-1, size), zero outside.
"""

import importlib.metadata
import json
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import benchmark_op  # noqa: E402
import dcnv4_compare  # noqa: E402

from mmdeform_tma.reference import ms_deform_attn_reference, ms_deform_attn_reference_backward  # noqa: E402


def bilinear(value_level, height, width, x, y):
    """value_level (bs, h*w, heads, ch); x, y (bs, nq, heads) normalised -> (bs, nq, heads, ch)."""
    bs, _, heads, channels = value_level.shape
    w_im, h_im = x * width - 0.5, y * height - 0.5
    inside = (h_im > -1) & (w_im > -1) & (h_im < height) & (w_im < width)
    h0, w0 = h_im.floor(), w_im.floor()
    out = 0
    for dh, dw in ((0, 0), (0, 1), (1, 0), (1, 1)):
        hc, wc = h0 + dh, w0 + dw
        weight = (1 - (h_im - hc).abs()) * (1 - (w_im - wc).abs())
        valid = inside & (hc >= 0) & (hc < height) & (wc >= 0) & (wc < width)
        index = (hc.clamp(0, height - 1) * width + wc.clamp(0, width - 1)).long()  # (bs, nq, heads)
        gathered = torch.stack(
            [value_level[b, index[b, :, h], h] for b in range(bs) for h in range(heads)]
        ).view(bs, heads, -1, channels).transpose(1, 2)
        out = out + gathered * (weight * valid)[..., None]
    return out


def emulated_flash_deform_attn(value, spatial_shapes, level_start_index, sampling_loc_attn, im2col_step, K):
    bs, _, heads, channels = value.shape
    levels = spatial_shapes.shape[0]
    nq = sampling_loc_attn.shape[1]
    per_head = sampling_loc_attn.reshape(bs, nq, heads, levels * K * 3)
    logits = torch.stack([per_head[..., levels * K * 2 + li * K + ki] for li in range(levels) for ki in range(K)], -1)
    opmath = torch.promote_types(value.dtype, torch.float32)  # the kernel computes in at::opmath_type
    weights = logits.to(opmath).softmax(-1)
    locations = per_head.to(opmath)
    out = 0
    for li in range(levels):
        height, width = (int(v) for v in spatial_shapes[li])
        start = int(level_start_index[li])
        level_value = value[:, start : start + height * width].to(opmath)
        for ki in range(K):
            offset = 2 * (li * K + ki)
            sampled = bilinear(level_value, height, width, locations[..., offset], locations[..., offset + 1])
            out = out + sampled * weights[..., li * K + ki, None]
    return out.to(value.dtype).reshape(bs, nq, heads * channels)


class EmulatedFlashDeformAttnFunction:
    fail_backward_for: set = set()

    @staticmethod
    def apply(value, spatial_shapes, level_start_index, sampling_loc_attn, im2col_step, K):
        out = emulated_flash_deform_attn(value, spatial_shapes, level_start_index, sampling_loc_attn, im2col_step, K)
        if out.requires_grad and value.dtype in EmulatedFlashDeformAttnFunction.fail_backward_for:
            def refuse(grad):
                raise RuntimeError(f"expected scalar type Float but found {value.dtype}")

            out.register_hook(refuse)
        return out


def fake_findspec(B, Q, G, C):
    return 8, G * C // 8


def fake_findspec_bwd(B, Q, G, C):
    return 1, G * C


@pytest.fixture
def fake_dcnv4(monkeypatch):
    """An importable `DCNv4.functions.flash_deform_attn_func` backed by the emulation."""
    module = types.ModuleType("DCNv4.functions.flash_deform_attn_func")
    module.FlashDeformAttnFunction = EmulatedFlashDeformAttnFunction
    module.findspec, module.findspec_bwd = fake_findspec, fake_findspec_bwd
    package, functions = types.ModuleType("DCNv4"), types.ModuleType("DCNv4.functions")
    package.__path__, functions.__path__ = [], []
    functions.flash_deform_attn_func = module
    package.functions = functions
    monkeypatch.setitem(sys.modules, "DCNv4", package)
    monkeypatch.setitem(sys.modules, "DCNv4.functions", functions)
    monkeypatch.setitem(sys.modules, "DCNv4.functions.flash_deform_attn_func", module)
    monkeypatch.setattr(EmulatedFlashDeformAttnFunction, "fail_backward_for", set())
    # The fake has no package metadata, also where the real DCNv4 is installed (the device machine).
    real_version = importlib.metadata.version

    def version_without_dcnv4(name):
        if name.lower() == "dcnv4":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version_without_dcnv4)
    dcnv4_compare.load.cache_clear()
    yield EmulatedFlashDeformAttnFunction
    dcnv4_compare.load.cache_clear()


def small_inputs():
    """float64 throughout, weights summing to 1 in float64, so that the convention is checked, not rounding."""
    shape = benchmark_op.Shape("t", ((5, 7), (3, 4)), 2, 6, heads=2, channels=4, points=4)
    value, shapes, starts, loc, attn = benchmark_op.make_inputs(shape, torch.float64, "uniform", torch.device("cpu"), 3)
    attn = attn.double()
    return value, shapes, starts, loc.double(), attn / attn.sum((-2, -1), keepdim=True)


def test_packing_matches_the_reference_through_dcnv4s_convention():
    value, shapes, starts, loc, attn = small_inputs()
    packed = dcnv4_compare.pack_locations_and_logits(loc, attn, value.dtype)
    assert packed.shape == (2, 6, 2 * 2 * 4 * 3)
    got = emulated_flash_deform_attn(value, shapes, starts, packed, 64, 4)
    want = ms_deform_attn_reference(value, shapes, loc, attn)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_unpacked_gradients_match_the_reference_and_the_softmax_jacobian():
    value, shapes, starts, loc, attn = small_inputs()
    bound = dcnv4_compare.bind(
        dcnv4_compare.Dcnv4(EmulatedFlashDeformAttnFunction, fake_findspec, fake_findspec_bwd, None), (value, shapes, starts, loc, attn)
    )
    leaves = tuple(t.detach().clone().requires_grad_() for t in bound.leaves)
    out = bound.run(*leaves)
    grad_out = torch.randn_like(out)
    grads = bound.gradients(torch.autograd.grad(out, leaves, grad_out))
    assert set(grads) == {"grad_value", "grad_locations", "grad_logits"}
    exact = ms_deform_attn_reference_backward(grad_out, value, shapes, loc, attn)
    torch.testing.assert_close(grads["grad_value"], exact[0])
    torch.testing.assert_close(grads["grad_locations"], exact[1])
    torch.testing.assert_close(grads["grad_logits"], benchmark_op.logits_gradient(exact[2], attn))
    assert bound.launch_spec == {"forward": {"d_stride": 8, "block_threads": 1}, "backward": {"d_stride": 1, "block_threads": 8}}


def test_logits_gradient_is_the_softmax_backward():
    logits = torch.randn(1, 3, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    weights = logits.flatten(-2).softmax(-1).view_as(logits)
    grad_weights = torch.randn_like(weights)
    (want,) = torch.autograd.grad(weights, logits, grad_weights)
    torch.testing.assert_close(benchmark_op.logits_gradient(grad_weights, weights.detach()), want)


def test_compare_dcnv4_adds_a_row_per_direction(tmp_path, fake_dcnv4):
    out = tmp_path / "op"
    assert benchmark_op.main(["--device", "cpu", "--iters", "2", "--warmup", "1", "--compare", "dcnv4", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = [r for r in data["results"] if r["backend"] == "dcnv4"]
    assert [r["direction"] for r in rows] == ["forward", "backward", "forward+backward"]
    assert all(r["error"] is None and r["timing"]["median_ms"] > 0 for r in rows)
    assert all(r["launch_spec"] == {"forward": {"d_stride": 8, "block_threads": 2}, "backward": {"d_stride": 1, "block_threads": 16}} for r in rows)
    accuracy = rows[0]["accuracy"]
    assert accuracy["rel_err_output"] < 1e-5 and accuracy["rel_err_grad_logits"] < 1e-5 and accuracy["rel_err_grad_value"] < 1e-5
    assert "rel_err_grad_weights" not in accuracy
    assert data["environment"]["dcnv4"] is None  # the fake has no package metadata
    assert "dcnv4, tiny:" in out.with_suffix(".md").read_text()


def test_compare_dcnv4_records_a_failing_backward_per_row(tmp_path, fake_dcnv4):
    fake_dcnv4.fail_backward_for = {torch.bfloat16}
    out = tmp_path / "op"
    args = ["--device", "cpu", "--iters", "1", "--warmup", "1", "--compare", "dcnv4", "--dtypes", "float32", "bfloat16", "--out", str(out)]
    assert benchmark_op.main(args) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    dcnv4 = {(r["dtype"], r["direction"]): r for r in rows if r["backend"] == "dcnv4"}
    assert dcnv4[("bfloat16", "forward")]["timing"] and dcnv4[("bfloat16", "forward")]["error"] is None
    assert "found torch.bfloat16" in dcnv4[("bfloat16", "forward")]["accuracy"]["backward_error"]
    for direction in ("backward", "forward+backward"):
        assert dcnv4[("bfloat16", direction)]["error"].startswith("RuntimeError: expected scalar type Float")
        assert dcnv4[("float32", direction)]["error"] is None
    assert all(r["error"] is None for r in rows if r["backend"] == "pytorch")


def test_compare_dcnv4_stops_with_the_remedy_when_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "DCNv4", None)  # import DCNv4 raises ImportError
    dcnv4_compare.load.cache_clear()
    with pytest.raises(SystemExit, match=r"cannot import DCNv4 .*pip install --no-deps --target /tmp/site"):
        benchmark_op.main(["--device", "cpu", "--compare", "dcnv4", "--iters", "1"])
    dcnv4_compare.load.cache_clear()


def test_compare_rejects_unknown_kernels():
    with pytest.raises(SystemExit):
        benchmark_op.parse_args(["--compare", "flash_attn"])
