"""GPU checks of the OpenMMLab integration: a Deformable DETR training step gives mmcv's loss with
every backend that runs here, AMP fp16/bf16 steps work, the module compiles with fullgraph and
captures in a CUDA graph. Parametrized over the backends, so a new kernel is covered at once."""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]
pytest.importorskip("mmdet")

from mmdet_models import switch_off_dropout  # noqa: E402
from msda_cases import backend_skip_reason  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
CONFIG = str(ROOT / "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py")
DINO_CONFIG = str(ROOT / "configs/synthetic/dino-4scale_r50_synthetic_tma-ws.py")
KERNEL_BACKENDS = ["mmcv", "cuda", "tma_ws"]


def skip_unless(backend, dtype=torch.float32):
    if reason := backend_skip_reason(backend, dtype):
        pytest.skip(reason)


def train_losses(backend, precision, steps=2, fast=None, dropout=True, perturb=0.0, config=CONFIG):
    """Training losses per step; `perturb` scales every weight by (1 + perturb x N(0, 1)) first."""
    from benchmark_e2e import build_model, make_optim_wrapper
    from synthetic_batches import synthetic_batch

    device = torch.device("cuda")
    model, cfg = build_model(config, backend, device, seed=0, fast=fast)
    if not dropout:  # compiled graphs draw dropout masks differently from eager
        switch_off_dropout(model)
    if perturb:
        g = torch.Generator(device=device).manual_seed(1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1 + perturb * torch.randn(parameter.shape, device=device, generator=g))
    optim = make_optim_wrapper(model, cfg, precision)
    model.train()
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        out = model.train_step(synthetic_batch(2, 512, 640, 3, device, seed=step), optim)
        losses.append({k: float(v) for k, v in out.items()})
    return losses


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_training_step_matches_mmcv(backend):
    skip_unless(backend)
    stock = train_losses("stock", "fp32")
    got = train_losses(backend, "fp32")
    for a, b in zip(got, stock):
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


def largest_rel_diff(a_steps, b_steps):
    """The largest relative difference of any loss term at any step."""
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-4) for a, b in zip(a_steps, b_steps) for k in b)


FAST_PATH_CASES = [
    *[
        (mode, scope, "detr")
        for scope in ("layers", "network", "network+decoder")
        for mode in ("default", "reduce-overhead")
    ],
    ("reduce-overhead", "network+decoder", "dino"),  # the default path of the fast switch, on DINO
]


@pytest.mark.parametrize("mode, scope, model", FAST_PATH_CASES)
def test_fast_path_training_steps_match_the_default_path(mode, scope, model, monkeypatch):
    """tools/train.py --fast: compiled transformer layers (inductor; CUDA graphs with
    reduce-overhead; scope 'network' compiles the backbone and neck too, 'network+decoder' also
    the decoder whole), fused AdamW, bucket padding (512x640 is a bucket already, so the inputs
    are the same). Deformable DETR in every mode and scope; DINO (whose decoder takes the box
    branches and a denoising mask) in the defaults.

    Every dropout is off, nn.MultiheadAttention's attention dropout included: compiled graphs
    draw other masks than eager. With that one left on, the fast path drifted 2.2e-2 from eager
    on an H100 (2026-11-23, commits 88fd07b and dda54f1, cuDNN TF32 on or off alike); on the CPU,
    inductor drifts 8e-3 with it on and not at all with it off. cuDNN's TF32 is off for both
    paths, so that the floor is fp32 rounding: inductor may lay convolutions out channels-last,
    where cuDNN picks other TF32 kernels.

    Losses still move with rounding: the Hungarian matching of near-tied queries flips on
    fp32-level differences, and Adam's first updates, about lr x sign(grad), move weights with
    near-zero gradients by a whole step. So the drift is measured, not guessed: the default path
    from weights perturbed by 1e-6 (a few fp32 ulps) sets the floor, and the fast path may drift
    at most 3x as far. A wrong compiled layer moves the losses by far more than either."""
    skip_unless("cuda")  # auto runs a compiled backend
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    config = DINO_CONFIG if model == "dino" else CONFIG
    eager = train_losses("auto", "fp32", steps=3, dropout=False, config=config)
    nudged = train_losses("auto", "fp32", steps=3, dropout=False, perturb=1e-6, config=config)
    fast = train_losses("auto", "fp32", steps=3, fast=dict(mode=mode, scope=scope), dropout=False, config=config)
    torch._dynamo.reset()
    floor, drift = largest_rel_diff(nudged, eager), largest_rel_diff(fast, eager)
    assert drift <= 3 * floor + 1e-5, f"fast path drifts {drift:.2e} from eager; rounding-level noise drifts {floor:.2e}"
    assert fast[0]["loss"] != fast[-1]["loss"]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("precision", ["amp-fp16", "amp-bf16"])
def test_amp_training_step(backend, precision):
    dtype = torch.float16 if precision == "amp-fp16" else torch.bfloat16
    skip_unless(backend, dtype)
    losses = train_losses(backend, precision)
    assert all(torch.isfinite(torch.tensor(list(step.values()))).all() for step in losses)


def msda_module(backend):
    from mmcv.ops import MultiScaleDeformableAttention

    torch.manual_seed(0)
    return MultiScaleDeformableAttention(
        embed_dims=256, num_heads=8, num_levels=4, num_points=4, batch_first=True, dropout=0.0, backend=backend
    ).cuda()


def module_inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = torch.tensor([[40, 60], [20, 30], [10, 15], [5, 8]], device="cuda")
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    keys = int((shapes[:, 0] * shapes[:, 1]).sum())
    return dict(
        query=torch.randn(2, 300, 256, device="cuda", generator=g),
        value=torch.randn(2, keys, 256, device="cuda", generator=g),
        reference_points=torch.rand(2, 300, 4, 2, device="cuda", generator=g),
        spatial_shapes=shapes,
        level_start_index=starts,
    )


@pytest.mark.parametrize("backend", ["pytorch", *KERNEL_BACKENDS])
def test_module_compiles_fullgraph(backend):
    skip_unless(backend)
    torch._dynamo.reset()
    module = msda_module(backend).eval()
    inputs = module_inputs()
    with torch.no_grad():
        eager = module(**inputs)
        compiled = torch.compile(module, fullgraph=True)(**inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cuda", "tma_ws"])
def test_module_forward_backward_captures_in_a_cuda_graph(backend):
    skip_unless(backend)
    module = msda_module(backend)
    inputs = module_inputs()
    inputs["query"].requires_grad_()

    def step():
        out = module(**inputs)
        return torch.autograd.grad(out.square().sum(), [inputs["query"], *module.parameters()])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cuda", "tma_ws"])
def test_full_detector_training_replays_from_cuda_graphs(backend):
    """Backbone to head, forward and backward, captured once and replayed for every step: the same
    losses as eager training from the same weights and batches (tools/cuda_graph_train_step.py)."""
    skip_unless(backend)
    from cuda_graph_train_step import compare

    result = compare(CONFIG, backend, batch_size=2, height=512, width=640, steps=3)
    assert result["max_rel_diff"] < 1e-4, result
    assert result["eager_losses"][0] != result["eager_losses"][-1]  # the weights did move
