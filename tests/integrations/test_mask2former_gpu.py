"""GPU checks of panoptic Mask2Former R50 (configs/mask2former) on synthetic 512x640 batches, which
its LSJ data preprocessor pads to 1024x1024: training steps with the pixel decoder on each
mmdeform_tma kernel, in fp32 and AMP bf16 against stock mmcv's fp32 losses, and in AMP fp16
against stock mmcv's AMP fp16 losses (mmdet's head is non-finite there: see that test).

Only the first step's losses are compared: they come from the same initial weights for every
backend and precision, while later ones also carry the first update's rounding and atomics."""

import functools
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]
pytest.importorskip("mmdet")

from msda_cases import backend_skip_reason  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
CONFIG = str(ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py")
BACKENDS = ["cuda", "tma_ws"]


def skip_unless(backend, dtype=torch.float32):
    if reason := backend_skip_reason(backend, dtype):
        pytest.skip(reason)


@functools.cache
def train_losses(backend: str, precision: str, steps: int = 2) -> tuple[dict, ...]:
    from benchmark_e2e import build_model, make_optim_wrapper
    from synthetic_batches import batch_for_config

    device = torch.device("cuda")
    model, cfg = build_model(CONFIG, backend, device, seed=0)
    optim = make_optim_wrapper(model, cfg, precision)
    model.train()
    torch.manual_seed(0)  # Mask2Former samples its mask points at random: the same points for every run
    losses = []
    for step in range(steps):
        out = model.train_step(batch_for_config(cfg, 2, 512, 640, device, seed=step), optim)
        losses.append({k: float(v) for k, v in out.items()})
    del model, optim
    torch.cuda.empty_cache()
    return tuple(losses)


def finite(losses) -> bool:
    return all(torch.isfinite(torch.tensor(v)) for values in losses for v in values.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_training_step_matches_stock_mmcv(backend):
    skip_unless(backend)
    stock, got = train_losses("stock", "fp32")[0], train_losses(backend, "fp32")[0]
    assert set(got) == set(stock)
    for key in stock:
        assert got[key] == pytest.approx(stock[key], rel=1e-3, abs=1e-4), key


def non_finite(losses: dict) -> set[str]:
    return {k for k, v in losses.items() if not torch.isfinite(torch.tensor(v))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_amp_bf16_training_step_is_finite_and_near_stock_fp32(backend):
    """bf16 is the AMP precision for Mask2Former (stock mmcv's op cannot run it)."""
    skip_unless(backend, torch.bfloat16)
    losses = train_losses(backend, "amp-bf16")
    assert finite(losses), losses[0]
    stock = train_losses("stock", "fp32")[0]
    assert losses[0]["loss"] == pytest.approx(stock["loss"], rel=2e-2)
    for key in stock:  # each decoder layer's terms after its own Hungarian matching, hence looser
        assert losses[0][key] == pytest.approx(stock[key], rel=5e-2, abs=1e-3), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_amp_fp16_training_step_matches_stock_mmcv_in_amp_fp16(backend):
    """In AMP fp16, mmdet 3.3.0's Mask2Former head is itself non-finite: it makes its mask-loss
    average factor with `cls_scores.new_tensor(...)`, which autocast makes fp16, and multiplies it by
    its 12,544 sampled points; from 6 masks in a batch that overflows fp16 (65,504) to inf. The
    mask loss is then 0 (finite mask logits over inf) or NaN (a decoder layer's fp16 mask logits
    overflowed too). So against stock mmcv in the same precision: the same terms are non-finite,
    and the finite ones agree within the bf16 test's tolerances (each layer's terms follow its own
    Hungarian matching, which a difference in the MSDA's rounding can flip)."""
    skip_unless(backend, torch.float16)
    ours, stock = train_losses(backend, "amp-fp16")[0], train_losses("stock", "amp-fp16")[0]
    assert set(ours) == set(stock)
    assert non_finite(ours) == non_finite(stock), (ours, stock)
    for key in set(stock) - non_finite(stock):
        assert ours[key] == pytest.approx(stock[key], rel=5e-2, abs=1e-3), key
