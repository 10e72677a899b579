"""configs/mask2former: the panoptic Mask2Former config puts its pixel decoder's
MultiScaleDeformableAttention modules on `tma_ws` and changes nothing else, the kernel switches by
--cfg-options or MMDEFORM_TMA_BACKEND, and the reference backend gives stock mmcv's outputs (CPU)."""

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
CONFIG = ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py"
BACKEND_KEY = "model.panoptic_head.pixel_decoder.encoder.layer_cfg.self_attn_cfg.backend"
sys.path.insert(0, str(ROOT / "tools"))


def msda_modules(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiScaleDeformableAttention)}


def test_config_merges_the_backend_into_mmdets_pixel_decoder():
    import mmdet

    cfg = Config.fromfile(str(CONFIG))
    assert "mmdeform_tma" in cfg.custom_imports.imports and not cfg.custom_imports.allow_failed_imports
    mmdet_configs = Path(mmdet.__file__).parent / ".mim/configs"
    base = Config.fromfile(str(mmdet_configs / "mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic.py"))
    attention = cfg.model.panoptic_head.pixel_decoder.encoder.layer_cfg.self_attn_cfg
    assert attention.pop("backend") == "tma_ws"
    assert attention == base.model.panoptic_head.pixel_decoder.encoder.layer_cfg.self_attn_cfg
    cfg.model.panoptic_head.pixel_decoder.encoder.layer_cfg.self_attn_cfg = attention
    assert cfg.model.pop("_scope_") == "mmdet"  # mmengine's mark of a base from another package
    assert cfg.model == base.model  # the backend is the config's only change to the model


def test_every_msda_module_of_the_model_is_on_tma_ws():
    modules = msda_modules(build_model(Config.fromfile(str(CONFIG))))
    assert len(modules) == 6 and all(name.startswith("panoptic_head.pixel_decoder.encoder.layers.") for name in modules)
    assert {m.backend for m in modules.values()} == {"tma_ws"}
    assert {(m.num_levels, m.num_heads, m.num_points) for m in modules.values()} == {(3, 8, 4)}


def test_cfg_options_and_environment_switch_the_kernel(monkeypatch):
    from train import build_config, parse_args

    cfg = build_config(parse_args([str(CONFIG), "--cfg-options", f"{BACKEND_KEY}=cuda"]))
    assert {m.backend for m in msda_modules(build_model(cfg)).values()} == {"cuda"}
    monkeypatch.setenv("MMDEFORM_TMA_BACKEND", "pytorch")
    assert {m.backend for m in msda_modules(build_model(Config.fromfile(str(CONFIG)))).values()} == {"pytorch"}


def test_state_dict_loads_into_stock_mmcv_and_reference_backend_gives_its_outputs():
    from synthetic_batches import batch_for_config

    cfg = Config.fromfile(str(CONFIG))
    plugged, stock = build_model(cfg, backend="pytorch", seed=3), build_model(cfg, backend=None, seed=4)
    assert list(plugged.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(plugged.state_dict())
    batch = batch_for_config(cfg, 2, 96, 128, torch.device("cpu"), seed=2)
    plugged.eval()
    stock.eval()
    with torch.no_grad():
        data = plugged.data_preprocessor(batch, False)
        features = plugged.extract_feat(data["inputs"])
        cls_plugged, masks_plugged = plugged.panoptic_head(features, data["data_samples"])
        cls_stock, masks_stock = stock.panoptic_head(features, data["data_samples"])
    assert len(cls_plugged) == len(cls_stock) == 10  # the 9 decoder layers and the prediction before them
    for a, b in zip([*cls_plugged, *masks_plugged], [*cls_stock, *masks_stock]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
