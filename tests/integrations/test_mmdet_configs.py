"""The configs in configs/: they build mmdet models, train and predict on the CPU with the
reference backend, match stock mmcv, and switch kernels by --cfg-options or MMDEFORM_TMA_BACKEND."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmdet")
from mmcv.ops import MultiScaleDeformableAttention  # noqa: E402
from mmengine.config import Config  # noqa: E402

import mmdeform_tma  # noqa: E402,F401
from mmdet_models import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.py") if "_base_" not in p.parts)
TINY = ROOT / "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py"
sys.path.insert(0, str(ROOT / "tools"))


def msda_backends(model):
    return [m.backend for m in model.modules() if isinstance(m, MultiScaleDeformableAttention)]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_its_model(path):
    cfg = Config.fromfile(str(path))
    assert "mmdeform_tma" in cfg.custom_imports.imports and not cfg.custom_imports.allow_failed_imports
    model = build_model(cfg)
    backends = msda_backends(model)
    assert backends and len(set(backends)) == 1
    assert backends[0] == ("pytorch" if "tiny" in path.stem else "tma_ws")


def tiny_batch(num_classes=3, seed=0):
    from synthetic_batches import synthetic_batch

    return synthetic_batch(2, 96, 128, num_classes, torch.device("cpu"), seed)


def test_tiny_model_trains_and_predicts_on_cpu():
    from mmengine.optim import build_optim_wrapper

    cfg = Config.fromfile(str(TINY))
    model = build_model(cfg)
    optim = build_optim_wrapper(model, cfg.optim_wrapper)
    losses = model.train_step(tiny_batch(), optim)
    assert all(torch.isfinite(v).all() for v in losses.values())
    model.eval()
    with torch.no_grad():
        results = model.test_step(tiny_batch(seed=1))
    assert len(results) == 2 and results[0].pred_instances.bboxes.shape[-1] == 4


def test_state_dict_keys_match_stock_mmcv():
    cfg = Config.fromfile(str(TINY))
    plugged, stock = build_model(cfg, seed=5), build_model(cfg, backend=None, seed=5)
    assert list(plugged.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(plugged.state_dict())


def test_reference_backend_matches_stock_mmcv_outputs():
    cfg = Config.fromfile(str(TINY))
    plugged, stock = build_model(cfg, backend="pytorch", seed=7), build_model(cfg, backend=None, seed=7)
    stock.load_state_dict(plugged.state_dict())
    batch = tiny_batch(seed=3)
    for model in (plugged, stock):
        model.eval()
    with torch.no_grad():
        data = plugged.data_preprocessor(batch, False)
        a = plugged._forward(data["inputs"], data["data_samples"])
        b = stock._forward(data["inputs"], data["data_samples"])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_cfg_options_and_environment_switch_the_kernel(monkeypatch):
    from train import build_config, parse_args

    config = str(ROOT / "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py")
    args = parse_args([config, "--cfg-options", "model.encoder.layer_cfg.self_attn_cfg.backend=cuda", "model.decoder.layer_cfg.cross_attn_cfg.backend=pytorch"])
    model = build_model(build_config(args))
    assert msda_backends(model) == ["cuda"] * 6 + ["pytorch"] * 6
    monkeypatch.setenv("MMDEFORM_TMA_BACKEND", "pytorch")
    assert set(msda_backends(build_model(Config.fromfile(config)))) == {"pytorch"}


def test_amp_flag_sets_the_optim_wrapper():
    from train import build_config, parse_args

    cfg = build_config(parse_args([str(TINY), "--amp", "bf16", "--work-dir", "/tmp/x"]))
    assert cfg.optim_wrapper.type == "AmpOptimWrapper" and cfg.optim_wrapper.dtype == "bfloat16"
    cfg = build_config(parse_args([str(TINY), "--amp"]))
    assert cfg.optim_wrapper.dtype == "float16"


def test_unknown_backend_in_a_config_fails_at_build():
    cfg = Config.fromfile(str(TINY))
    cfg.model.encoder.layer_cfg.self_attn_cfg.backend = "fast"
    with pytest.raises(ValueError, match="valid names"):
        build_model(cfg)


def test_custom_imports_alone_enable_backend_in_a_fresh_interpreter():
    code = (
        "from mmengine.config import Config; from mmengine.registry import init_default_scope; "
        "from mmdet.registry import MODELS; import sys; "
        f"cfg = Config.fromfile({str(TINY)!r}); assert 'mmdeform_tma' in sys.modules; "
        "init_default_scope('mmdet'); cfg.model.backbone.init_cfg = None; MODELS.build(cfg.model); print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
